"""KV-cache models exported once per test process and shared by tests/exporter and tests/serving,
and the left-padded token batch the exporter's decoder tests feed them.

Exporting a tiny model with a cache takes torch.onnx 20-30 s on 2 cores, so each
(family, dtype, fuse) is exported at most once per process into a temporary folder that is
removed at exit; the PyTorch model it came from is rebuilt from the same config and seed.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import numpy as np

#: Families the parity tests cover: Llama, Qwen3 (q/k norms), Gemma3 (1 + w, sandwich norms), OLMo2.
KV_FAMILIES = ["llama", "qwen3", "gemma3", "olmo2"]

_ROOT = Path(tempfile.mkdtemp(prefix="rmsnorm-kv-tests-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def exported_kv(family: str, dtype: str = "float32", fuse_attention: bool = False):
    """``(folder, ExportResult)`` of the tiny ``family`` model exported with ``--kv-cache``."""
    from rmsnorm_deploy.exporter.hf import TINY_CONFIGS, from_config
    from rmsnorm_deploy.decoder.export import export_decoder
    from rmsnorm_deploy.exporter.plan import ExportOptions

    folder = _ROOT / f"{family}-{dtype}{'-fused' if fuse_attention else ''}"
    loaded = from_config(TINY_CONFIGS[family], dtype)
    result = export_decoder(loaded, folder / "model.onnx",
                          ExportOptions(dtype=dtype, fuse_attention=fuse_attention))
    return folder, result


def hf_model(family: str, dtype: str = "float32"):
    """The transformers model ``exported_kv(family, dtype)`` came from (same config, same seed)."""
    from rmsnorm_deploy.exporter.hf import TINY_CONFIGS, from_config

    return from_config(TINY_CONFIGS[family], dtype).module.model


def random_left_padded(batch: int, prompt: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, attention_mask)``: seeded tokens in [3, vocab), row ``r`` left-padded by ``2 r``
    slots of pad id 0, so every row of a batch has its own padding."""
    ids = np.random.default_rng(seed).integers(3, vocab, size=(batch, prompt), dtype=np.int64)
    mask = np.ones_like(ids)
    for row in range(1, batch):
        mask[row, : 2 * row] = 0
        ids[row, : 2 * row] = 0
    return ids, mask
