"""Generation over a KV-cache graph (``export --kv-cache``) in ONNX Runtime.

:class:`KVCacheModel` opens a model folder (or ``.onnx`` file): it reads the KV-cache layout
from the metadata (``decoder.convention``; a model without it is refused), checks the graph's
real inputs and outputs against it, and creates the session through
:class:`~rmsnorm_deploy.runners.onnxruntime.OnnxRuntimeRunner` (the requested provider or a
one-line error, never a silent fallback). Opening it checks every side file that holds special
tokens (``decoder.genai_config.folder_tokens``: types, nesting, ids inside the vocabulary), so
``serve``, which opens a KV-cache folder through this class, refuses a damaged folder before any
port opens. The tokens come from the folder's ``genai_config.json`` (else ``config.json`` and
``generation_config.json``), the tokenizer from ``tokenizer.json`` through ``tokenizers`` when
the folder has one.

:func:`generate` is the entry point of generation: it checks the prompts against the model,
takes the special tokens from the folder, and runs the one decode loop,
``decoder.loop.decode_loop`` (prefill, then one step per new token; positions from the
mask, left padding, end-of-sequence handling, greedy or seeded sampling with a temperature and
top-k), with ONNX Runtime's step (``decoder.ort_step.OrtStep``): each step's ``present``
tensors stay ``OrtValue``\\ s on the provider's device and are bound as the next step's
``past`` through IOBinding (or written in place in a shared past/present buffer); only the last
position's logits come back to numpy. :func:`stream` hands out one prompt's new tokens as that
same loop makes them (the streaming endpoint of ``serve``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from rmsnorm_deploy.contract.dtypes import numpy_dtype
from rmsnorm_deploy.decoder.convention import KVCacheLayout, check_io, graph_io, layout_of, left_padded
from rmsnorm_deploy.decoder.genai_config import folder_tokens
from rmsnorm_deploy.decoder.loop import Sampling, decode_loop, decode_steps, token_picker
from rmsnorm_deploy.decoder.ort_step import DECODE_OPTIMIZATION, CacheLayout, OrtStep
from rmsnorm_deploy.decoder.speculative import (SPECULATION_LONGROPE, DraftModel, PromptLookup, Speculator,
                                                check_draft)
from rmsnorm_deploy.errors import InputError, UserError, one_line
from rmsnorm_deploy.exporter.hf_files import side_file
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.graph.onnx_file import load_onnx
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner, provider_name

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "DEFAULT_SPECULATIVE_K", "FROM_FOLDER", "GenerationResult", "KVCacheModel",
           "Sampling", "SpeculationOptions", "generate", "model_file"]

MODEL_FILE = "model.onnx"
DEFAULT_MAX_NEW_TOKENS = 32
#: ``--speculative-k``'s default: the most tokens proposed for one run (adapted down as they fail).
DEFAULT_SPECULATIVE_K = 5
#: ``generate``'s default special tokens: those of the model folder (genai_config.json / config.json).
FROM_FOLDER = "from the model folder"


@dataclasses.dataclass
class GenerationResult:
    prompts: list[list[int]]  # the prompt token ids of each row (without padding)
    tokens: list[list[int]]  # the new tokens of each row (pad after its end-of-sequence token)
    prefill_ms: float
    decode_ms_per_token: float  # mean time of one decode step (all rows together)
    steps: int  # decode steps run after the prefill
    providers: list[str]
    text: list[str] | None = None
    #: With ``return_logits``: each step's last-position logits, [batch, vocab] float32 arrays.
    step_logits: list[np.ndarray] | None = None
    #: With speculation: ``decoder.speculative.SpeculationStats.to_dict()`` (acceptance, tokens per run).
    speculation: dict[str, Any] | None = None

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second in the decode phase, over all rows."""
        if not self.steps or self.decode_ms_per_token <= 0:
            return 0.0
        return len(self.tokens) * 1000.0 / self.decode_ms_per_token

    def to_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "tokens": self.tokens, "text": self.text, "providers": self.providers,
                "prefill_ms": round(self.prefill_ms, 3), "decode_ms_per_token": round(self.decode_ms_per_token, 3),
                "decode_steps": self.steps, "tokens_per_s": round(self.tokens_per_s, 1),
                **({"speculation": self.speculation} if self.speculation is not None else {})}


def model_file(path: str | os.PathLike) -> Path:
    """MODEL_DIR of ``generate``: a folder with ``model.onnx`` or an ``.onnx`` file."""
    p = Path(path)
    if p.is_dir():
        p = p / MODEL_FILE
        if not p.is_file():
            raise UserError(f"{path}: no {MODEL_FILE} in this folder; give the folder `export --kv-cache` wrote")
    elif not p.is_file():
        raise UserError(f"{path}: no such file or folder")
    return p


class SessionScope:
    """A model whose ONNX Runtime session (``self.runner``) lives inside a ``with`` block: shared by
    our KV-cache folders and the foreign ones ``perplexity`` reads (``decoder.kv_folders``)."""

    runner: OnnxRuntimeRunner

    def __enter__(self):
        self.runner.activate()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.runner.deactivate()

    @property
    def session(self) -> Any:
        if not self.runner.is_active:
            raise RuntimeError(f"{type(self).__name__} used outside its `with` block")
        return self.runner.session


class KVCacheModel(SessionScope):
    """An exported KV-cache model in an ONNX Runtime session (a context manager); ``provider_options``
    as :class:`OnnxRuntimeRunner` takes them (e.g. ``{"cuda": {"use_tf32": "0"}}``)."""

    def __init__(self, path: str | os.PathLike, providers: Sequence[str] = ("cpu",), *,
                 intra_op_threads: int | None = None, provider_options: dict[str, dict[str, Any]] | None = None):

        self.path = model_file(path)
        self.folder = self.path.parent
        for p in providers:
            provider_name(p)  # an unknown provider is refused before the model is read
        graph = load_onnx(self.path, load_external=False)
        self.metadata = ModelMetadata.read(graph)
        self.layout: KVCacheLayout = layout_of(self.metadata, what=str(self.path))
        inputs, outputs = graph_io(graph)
        check_io(self.layout, inputs, outputs, what=str(self.path))
        del graph
        self.special = folder_tokens(self.folder, self.layout.vocab_size)
        self.tokenizer = _tokenizer(self.folder)
        self._device = "cuda" if any(provider_name(p) != "CPUExecutionProvider" for p in providers) else "cpu"
        # the decode level was measured and checked bit-identical on CPU only; a GPU session keeps "all"
        self.runner = OnnxRuntimeRunner(self.path, providers, intra_op_threads=intra_op_threads,
                                        optimization=DECODE_OPTIMIZATION if self._device == "cpu" else "all",
                                        provider_options=provider_options)
        self._step: OrtStep | None = None

    # -- inputs ---------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise UserError(f"{self.folder} has no tokenizer.json; give token ids with --input-ids instead of --prompt")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # bytes that were not UTF-8 reach Python as lone surrogates
            bad = prompt[exc.start:exc.end]
            try:
                raw = bad.encode("utf-8", "surrogateescape")
                shown = ("byte " if len(raw) == 1 else "bytes ") + raw.hex(" ")
            except UnicodeEncodeError:
                shown = repr(bad)
            raise InputError(f"the prompt is not UTF-8 text ({shown} at character {exc.start}); give UTF-8 text, "
                             "or token ids with --input-ids") from None
        ids = self.tokenizer.encode(prompt).ids
        if not ids:
            raise InputError("the prompt encodes to no tokens")
        return list(ids)

    def decode(self, ids: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def check_prompts(self, rows: Sequence[Sequence[int]], max_new_tokens: int, *,
                      name: str = "--max-new-tokens") -> None:
        """Refuse (``InputError``) empty prompts, ids outside the vocabulary, and prompts that with
        ``max_new_tokens`` new tokens do not fit the model; ``name`` is what the user calls that number."""
        lay = self.layout
        if not rows:
            raise InputError("no prompt given")
        for row in rows:
            if not len(row):
                raise InputError("a prompt has no tokens")
            bad = [t for t in row if not (isinstance(t, (int, np.integer)) and 0 <= int(t) < lay.vocab_size)]
            if bad:
                raise InputError(f"token id {bad[0]!r} is outside the model's vocabulary [0, {lay.vocab_size})")
        longest = max(len(r) for r in rows)
        if longest > lay.max_length:
            raise InputError(f"the prompt has {longest} tokens, longer than the model's maximum of {lay.max_length}")
        if longest + max_new_tokens > lay.max_length:
            raise InputError(f"{longest} prompt tokens + {max_new_tokens} new tokens exceed the model's maximum of "
                             f"{lay.max_length}; lower {name} to at most {lay.max_length - longest}")

    @property
    def stepper(self) -> OrtStep:
        """ONNX Runtime's step of the decode loop, on this session (inside the ``with`` block)."""
        session = self.session
        if self._step is None or self._step.session is not session:
            self._step = OrtStep(session, CacheLayout.of(self.layout), dtype=numpy_dtype(self.layout.dtype),
                                 device=self._device)
        return self._step


def check_max_new_tokens(max_new_tokens: Any, *, name: str = "--max-new-tokens") -> None:
    """Refuse (``InputError``) anything but an integer >= 1; ``name`` is what the user calls it."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"{name} must be an integer >= 1, got {max_new_tokens!r}")


def _prepare(model: KVCacheModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             eos_token_id: int | Sequence[int] | str | None,
             pad_token_id: int | None) -> tuple[list[list[int]], set[int], int]:
    """The checked prompts, the end-of-sequence ids and the pad id (see :func:`generate`)."""
    check_max_new_tokens(max_new_tokens)
    rows = [[int(t) for t in r] for r in prompts]
    model.check_prompts(rows, max_new_tokens)
    if eos_token_id == FROM_FOLDER:
        eos_token_id = model.special.get("eos_token_id")
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    pad = pad_token_id if pad_token_id is not None else model.special.get("pad_token_id")
    if pad is None:
        pad = min(eos) if eos else 0
    return rows, eos, pad


def generate(model: KVCacheModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
             sampling: Sampling | None = None, return_logits: bool = False,
             eos_token_id: int | Sequence[int] | str | None = FROM_FOLDER,
             pad_token_id: int | None = None, speculation: SpeculationOptions | None = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` after each prompt (see the module docstring).

    ``eos_token_id``: the end-of-sequence ids; by default (:data:`FROM_FOLDER`) the folder's,
    ``None`` to never stop early. ``pad_token_id``: by default the folder's, else the first
    end-of-sequence id, else 0. ``speculation``: propose tokens and check several per run
    (``decoder.speculative``; greedy gives the same tokens, sampling the same distribution).
    """
    rows, eos, pad = _prepare(model, prompts, max_new_tokens, eos_token_id, pad_token_id)
    ids, mask = left_padded(rows, pad)
    speculator = speculation.speculator(model, ids.shape[1] + max_new_tokens, sampling) if speculation else None
    run = decode_loop(model.stepper, ids, mask, max_new_tokens=max_new_tokens, pick=token_picker(sampling),
                      eos_token_ids=eos, pad_token_id=pad, keep_logits=return_logits, speculation=speculator)
    tokens = run.tokens.tolist()
    text = [model.decode(t) for t in tokens] if model.tokenizer is not None else None
    return GenerationResult(
        prompts=rows, tokens=tokens, prefill_ms=run.prefill_s * 1000,
        decode_ms_per_token=run.decode_ms_per_token, steps=run.steps,
        providers=list(model.runner.actual_providers), text=text,
        step_logits=[np.asarray(g, dtype=np.float32) for g in run.step_logits] if return_logits else None,
        speculation=speculator.stats.to_dict() if speculator else None,
    )


def stream(model: KVCacheModel, prompt: Sequence[int], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
           sampling: Sampling | None = None, eos_token_id: int | Sequence[int] | str | None = FROM_FOLDER,
           pad_token_id: int | None = None, speculation: SpeculationOptions | None = None) -> Iterator[int]:
    """One prompt's new tokens, one at a time, as :func:`generate` makes them (the same loop, so the
    same tokens). The request is checked here, before the first token is asked for."""
    rows, eos, pad = _prepare(model, [prompt], max_new_tokens, eos_token_id, pad_token_id)
    ids, mask = left_padded(rows, pad)
    speculator = speculation.speculator(model, ids.shape[1] + max_new_tokens, sampling) if speculation else None
    steps = decode_steps(model.stepper, ids, mask, max_new_tokens=max_new_tokens, pick=token_picker(sampling),
                         eos_token_ids=eos, pad_token_id=pad, speculation=speculator)
    return (int(token[0]) for token, _ in steps)


@dataclasses.dataclass(frozen=True)
class SpeculationOptions:
    """``generate --speculative``: ``proposer`` is ``"ngram"`` (prompt lookup) or an open
    :class:`KVCacheModel` of the same vocabulary (a draft model); at most ``k`` tokens a run."""

    proposer: Any = "ngram"
    k: int = DEFAULT_SPECULATIVE_K

    def check(self, model: KVCacheModel, longest: int) -> None:
        """Refuse (``InputError``) what speculation cannot run exactly on ``model`` (``serve`` checks
        it at start, ``generate`` per generation; ``longest``: prompt + new tokens):

        - a graph computing in int8 (``--accuracy-level 4``): a run over several tokens rounds the
          activations per block differently from a run over one (measured on SmolLM2 int4: up to 0.6
          logits after 30 layers, greedy tokens changed on 4 of 6 prompts), so its tokens would not be
          the graph's own;
        - a model that recomputes its cache (Phi-3's LongRoPE switch);
        - a draft model of another vocabulary or tokenizer, or shorter than ``longest``."""
        entry = model.metadata.quantization if model.metadata is not None else None
        if isinstance(entry, dict) and entry.get("compute") == "int8":
            raise InputError(f"{model.folder}: speculation would change this graph's tokens: it computes in int8 "
                             "(--accuracy-level 4), which rounds a run of several tokens differently from one; "
                             "export it with --accuracy-level 1 to speculate, or run without --speculative")
        if model.layout.recompute_past is not None:
            raise InputError(SPECULATION_LONGROPE.format(past=model.layout.recompute_past))
        if self.proposer == "ngram":
            return
        if not isinstance(self.proposer, KVCacheModel):
            raise UserError(f"--speculative takes ngram or a draft model folder, got {self.proposer!r}")
        check_draft(model, self.proposer, longest)

    @property
    def name(self) -> str:
        """The proposer's name in the stats: ``ngram`` or ``draft:FOLDER``."""
        return "ngram" if self.proposer == "ngram" else f"draft:{self.proposer.folder.name}"

    def proposer_for(self) -> PromptLookup | DraftModel:
        """A fresh proposer for one generation (a draft keeps its own cache per generation)."""
        if self.proposer == "ngram":
            return PromptLookup()
        return DraftModel(self.proposer.stepper, name=self.name)

    def speculator(self, model: KVCacheModel, longest: int, sampling: Sampling | None) -> Speculator:
        """A fresh :class:`~rmsnorm_deploy.decoder.speculative.Speculator` for one generation
        (checked first: :meth:`check`)."""
        self.check(model, longest)
        return Speculator(self.proposer_for(), self.k, sampling)


def _tokenizer(folder: Path) -> Any:
    path = side_file(folder, "tokenizer.json")
    if path is None:
        return None
    tokenizers = require("tokenizers", "reading the model folder's tokenizer.json")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own exception type
        raise UserError(f"{folder / 'tokenizer.json'}: tokenizers cannot read it ({one_line(exc)})") from None
