"""The tiny preset exported once for every serving test, plain and with a KV cache."""

from __future__ import annotations

import pytest

from rmsnorm_deploy.cli import main


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """``rmsnorm-deploy export tiny -o DIR``: the folder holding ``model.onnx`` (float32, function lowering)."""
    folder = tmp_path_factory.mktemp("tiny-export")
    assert main(["export", "tiny", "-o", str(folder / "model.onnx"), "--force"]) == 0
    return folder


@pytest.fixture(scope="session")
def tiny_kv_export(tmp_path_factory):
    """``rmsnorm-deploy export tiny --kv-cache -o DIR``: the folder."""
    folder = tmp_path_factory.mktemp("tiny-kv-export")
    assert main(["export", "tiny", "--kv-cache", "-o", str(folder), "--force"]) == 0
    return folder
