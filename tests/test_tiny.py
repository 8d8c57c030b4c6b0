"""The torch-free tiny model (tests/tiny.py) is the artifact the PyTorch model saves: same config, same tensors
by name, shape and dtype, initialised alike, and PyTorch loads it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

from model.files import CONFIG_FILE, WEIGHTS_FILE
from tests.tiny import build_tiny_artifact


def test_the_torch_free_tiny_model_is_the_artifact_pytorch_saves(tmp_path: Path) -> None:
    from model.training.artifact import load_artifact
    from tests.tiny_torch import build_torch_artifact

    ours, theirs = build_tiny_artifact(tmp_path / "numpy"), build_torch_artifact(tmp_path / "torch")
    assert json.loads((ours / CONFIG_FILE).read_text()) == json.loads((theirs / CONFIG_FILE).read_text())
    with safe_open(str(ours / WEIGHTS_FILE), "np") as a, safe_open(str(theirs / WEIGHTS_FILE), "np") as b:
        assert a.metadata() == b.metadata()
    mine, reference = load_file(str(ours / WEIGHTS_FILE)), load_file(str(theirs / WEIGHTS_FILE))
    assert {k: (v.shape, v.dtype) for k, v in mine.items()} == {k: (v.shape, v.dtype) for k, v in reference.items()}
    for name, expected in reference.items():
        if np.all(expected == expected.flat[0]):  # LayerNorm scales and biases: constants
            np.testing.assert_array_equal(mine[name], expected, err_msg=name)
        else:  # random: the same distribution, so the same spread
            assert 0.8 < mine[name].std() / expected.std() < 1.25, name
    load_artifact(ours)
