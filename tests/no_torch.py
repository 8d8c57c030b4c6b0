"""Running Python as where torch is not installed: a meta-path finder that makes `import torch` fail."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NO_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked: {name}")
sys.meta_path.insert(0, NoTorch())
"""


def run_without_torch(code: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter at the repository root, `import torch` failing."""
    command = [sys.executable, "-c", NO_TORCH + code]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
