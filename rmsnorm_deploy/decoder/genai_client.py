"""onnxruntime-genai as a client of our export folders: its own ``Generator``, greedy.

A folder written by ``export --kv-cache`` carries a ``genai_config.json``, so onnxruntime-genai
runs it unmodified; this is the one place that asks it for tokens (the generation parity test and
``benchmarks/sweeps/kv_cache_parity.py``). onnxruntime-genai is optional and loaded here, lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from rmsnorm_deploy.optional import require


def genai_greedy(folder: str | Path, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """The tokens onnxruntime-genai's greedy search adds after ``prompt`` (one row), up to
    ``max_new_tokens``; fewer when it meets the folder's end-of-sequence token."""
    og = require("onnxruntime_genai", "running an export folder with onnxruntime-genai")
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + max_new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([list(prompt)], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(prompt):]
