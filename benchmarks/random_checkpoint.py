"""A Hugging Face Llama checkpoint with random bfloat16 weights, written tensor by tensor.

Not a test, not the product: ``bench_export_scale.py --model 8b`` needs a checkpoint of
Llama-3-8B's exact shape without holding 16 GB in memory. Each shard's safetensors header
(8-byte length, then JSON: dtype, shape, byte offsets) is written first, then each tensor's
values, generated block by block of rows (seeded normal, std 0.02 as the model's initializer;
norm gains 1 + N(0, 0.1)) and appended, so the largest thing in memory is one block. Shards
are cut at 5 GB, in the order of the layers, with ``model.safetensors.index.json``, as the
published checkpoint is sharded.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

import torch

#: Llama-3-8B's config (meta-llama/Meta-Llama-3-8B config.json).
LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
                 bos_token_id=128000, eos_token_id=128001, attention_bias=False, mlp_bias=False)
SHARD_BYTES = 5 * 10**9
BLOCK_ROWS = 4096


def tensors_of(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every weight of a Llama config, in layer order."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}"
        out += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.self_attn.q_proj.weight", (h, h)),
                (f"{p}.self_attn.k_proj.weight", (kv, h)), (f"{p}.self_attn.v_proj.weight", (kv, h)),
                (f"{p}.self_attn.o_proj.weight", (h, h)), (f"{p}.post_attention_layernorm.weight", (h,)),
                (f"{p}.mlp.gate_proj.weight", (i, h)), (f"{p}.mlp.up_proj.weight", (i, h)),
                (f"{p}.mlp.down_proj.weight", (h, i))]
    out += [("model.norm.weight", (h,))]
    if not config.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, h)))
    return out


def _values(name: str, shape: tuple[int, ...], seed: int) -> Iterator[torch.Tensor]:
    """Blocks of rows of one random bfloat16 tensor."""
    gen = torch.Generator().manual_seed(seed)
    if len(shape) == 1:  # a norm gain
        yield (1.0 + 0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        return
    for start in range(0, shape[0], BLOCK_ROWS):
        rows = min(BLOCK_ROWS, shape[0] - start)
        yield (0.02 * torch.randn((rows, *shape[1:]), generator=gen)).to(torch.bfloat16)


def _write_shard(path: Path, items: list[tuple[str, tuple[int, ...], int]]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in items:
        size = 2 * int(torch.tensor(shape).prod())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape, seed in items:
            for block in _values(name, shape, seed):
                f.write(block.view(torch.int16).numpy().tobytes())


def write_checkpoint(folder: Path, config: dict[str, Any], *, seed: int = 0) -> int:
    """The checkpoint of ``config`` in ``folder`` (config.json, shards, index); returns its bytes."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    data = dict(config)
    transformers.AutoConfig.for_model(data.pop("model_type"), **data, dtype="bfloat16").save_pretrained(folder)
    shards: list[list[tuple[str, tuple[int, ...], int]]] = [[]]
    size = 0
    for k, (name, shape) in enumerate(tensors_of(config)):
        nbytes = 2 * int(torch.tensor(shape).prod())
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape, seed * 100003 + k))
        size += nbytes
    weight_map, total = {}, 0
    for n, items in enumerate(shards, start=1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(folder / file, items)
        for name, shape, _ in items:
            weight_map[name] = file
            total += 2 * int(torch.tensor(shape).prod())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return total
