"""Tools the CI promises (`.ci/run` installs Debian's prometheus, promtool and qemu-user; the dev extra the pip
ones): a test that needs one skips where it is missing, saying how to install it, and fails under CI."""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest


def under_ci() -> bool:
    """The environment variable CI is "true" or "1" (what CI runners set)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def missing(what: str) -> NoReturn:
    """Skip the test for want of `what`; under CI fail it instead: CI promised the tool."""
    if under_ci():
        pytest.fail(f"{what}, and under CI, which promises it", pytrace=False)
    pytest.skip(what)


def required_tool(name: str, install: str) -> str:
    """The path of the command `name`; missing (see `missing`) where it is not on PATH."""
    path = shutil.which(name)
    if path is None:
        missing(f"`{name}` is missing: {install}")
    return path
