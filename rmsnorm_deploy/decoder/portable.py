"""The ``--kv-cache`` part of the export pipeline: what differs from an ``input_ids -> logits`` graph.

``pipeline.run_export`` asks :class:`KVExport` for the module to run and export
(``kv_model.KVCacheLM``), the feed it traces, the parity feeds, the ``torch.onnx.export`` call
and the metadata, and writes the serving files through it once the model is saved. The rest
(detection, the exact norm nodes, lowering, audit, check, atomic save, parity) is the same
pipeline as every export.

The traced example has a past of a few positions (a past of 0 or 1 would be specialized by
``torch.export``) and a left-padded first row; ``past`` is declared dynamic from 0, so the
same graph prefills. Parity runs two feeds through ONNX Runtime CPU and PyTorch (and its
float64 run), every output compared, presents included: a prefill (past 0) and a decode step
(sequence 1, a past of ``seq + 3`` whose first row is left-padded, one more row). The prefill
is not padded: a padded query position attends to nothing, and what a runtime returns there
(torch: zeros; ONNX Runtime: an average) is never used, but it would differ in every output
after it. Left padding is checked where it matters, on the generated tokens
(``tests/serving``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from rmsnorm_deploy.contract.dtypes import torch_dtype
from rmsnorm_deploy.decoder.convention import KVCacheLayout
from rmsnorm_deploy.decoder.genai_config import write_serving_files
from rmsnorm_deploy.decoder.kv_model import KVCacheLM, PositionalKVCacheLM, example_feed, export_args
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.exporter.loaded_model import LoadedModel
from rmsnorm_deploy.exporter.plan import MAX_BATCH

#: The past length of the traced example (0 and 1 would be specialized by torch.export).
TRACE_PAST = 3
#: Left padding of the first row in the traced and parity feeds.
LEFT_PAD = 2


def layout_for(loaded: LoadedModel, dtype: str) -> tuple[torch.nn.Module, KVCacheLayout]:
    """The inner model of ``loaded`` and its KV-cache layout, or why it has none."""
    inner = getattr(loaded.module, "model", None)
    config = getattr(inner, "config", None)
    if config is not None and hasattr(config, "num_hidden_layers"):
        return inner, KVCacheLayout.from_hf_config(config, dtype)
    args = getattr(inner, "args", None)
    if args is not None and hasattr(inner, "forward_cached"):
        return inner, KVCacheLayout(num_layers=args.n_layers, num_heads=args.n_heads, kv_heads=args.kv_heads,
                                    head_dim=args.resolved_head_dim, hidden_size=args.dim,
                                    vocab_size=args.vocab_size, max_length=args.max_seq_len, dtype=dtype)
    raise UserError(f"{loaded.name}: --kv-cache needs a causal LM with a key/value cache (a Hugging Face "
                    "model or a preset); this model has none")


@dataclasses.dataclass
class KVExport:
    loaded: LoadedModel
    layout: KVCacheLayout
    module: KVCacheLM
    batch: int
    seq: int
    seed: int
    force: bool = False

    @classmethod
    def of(cls, loaded: LoadedModel, options: Any) -> KVExport:
        inner, layout = layout_for(loaded, options.dtype)
        if options.seq + TRACE_PAST + 4 > layout.max_length:
            raise UserError(f"--seq {options.seq} leaves no room for a past in the model's {layout.max_length} positions")
        module = KVCacheLM(inner, layout).eval()
        return cls(loaded, layout, module, options.batch, options.seq, options.seed, options.force)

    def _feed(self, *, batch: int, sequence: int, past: int, seed: int, left_pad: int) -> dict[str, torch.Tensor]:
        return example_feed(self.layout, batch=batch, sequence=sequence, past=past, vocab=self.layout.vocab_size,
                            seed=seed, dtype=torch_dtype(self.layout.dtype), left_pad=left_pad)

    @property
    def trace_feed(self) -> dict[str, torch.Tensor]:
        return self._feed(batch=self.batch, sequence=self.seq, past=TRACE_PAST, seed=self.seed, left_pad=LEFT_PAD)

    def parity_feeds(self) -> list[dict[str, torch.Tensor]]:
        prefill = self._feed(batch=self.batch, sequence=self.seq, past=0, seed=self.seed, left_pad=0)
        decode = self._feed(batch=self.batch + 1, sequence=1, past=self.seq + 3, seed=self.seed + 1,
                            left_pad=LEFT_PAD)
        return [prefill, decode]

    def export_call(self) -> dict[str, Any]:
        """The arguments of ``torch.onnx.export`` for this graph (``pipeline._torch_export``)."""
        args, shapes = export_args(self.trace_feed, self.layout)
        return {"exported": PositionalKVCacheLM(self.module), "args": args, "kwargs": None,
                "input_names": self.layout.input_names(), "output_names": self.layout.output_names(),
                "dynamic_shapes": shapes}

    def describe(self, meta: Any, report: dict[str, Any]) -> None:
        """The metadata and report entries of a KV-cache graph."""

        meta.inputs = self.layout.metadata_inputs()
        meta.dims = self.layout.dims(batch=self.batch, sequence=self.seq, max_batch=MAX_BATCH)
        meta.kv_cache = self.layout.to_dict()
        report["kv_cache"] = self.layout.to_dict()

    def write_serving_files(self, target: Path) -> list[str]:

        return write_serving_files(target, self.layout, self.loaded.source, hf_folder=self.loaded.folder,
                                   force=self.force)
