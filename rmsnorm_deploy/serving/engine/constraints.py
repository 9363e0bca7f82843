"""Constrained decoding: a stream's tokens kept inside a JSON schema, any JSON object, a regular
expression or a Lark grammar, through llguidance (the library behind vLLM's ``guidance`` backend
and llama.cpp's ``--grammar`` option of the same name).

Why llguidance and not xgrammar: both build the allowed-token mask of SmolLM2's 49,152 tokens in
tens of microseconds per token (``benchmarks/bench_openai_fields.py``, results in
``benchmarks/results/openai_fields.md``), but xgrammar 0.2.8 needs torch and triton where
llguidance needs nothing beyond its own wheel, and it reads the folder's ``tokenizer.json`` as it
is (no transformers on the serving path).

:class:`Grammars` is the model's tokenizer as llguidance sees it, made once per model (~1 s for a
vocabulary of 49k); :meth:`Grammars.constraint` compiles one request's grammar (a bad one is an
``InputError`` in one line) into a :class:`Constraint`, the per-stream matcher that masks each
step's logits (tokens the grammar forbids at -inf) and advances by the token picked. The grammar
allows the model's end-of-sequence token only where the text is complete, so a constrained stream
ends with a whole value; only ``max_tokens`` can cut it short (``finish_reason: "length"``, as in
OpenAI's API).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from rmsnorm_deploy.errors import InputError, one_line
from rmsnorm_deploy.optional import require

#: the kinds of constraint a request can ask for, and what each one's ``source`` is
KINDS = {"json_object": "nothing (any JSON object)", "json_schema": "a JSON schema (an object)",
         "regex": "a regular expression (Rust regex syntax)", "grammar": "a Lark grammar (llguidance's syntax)"}
#: JSON written compactly (one space after ``:`` and ``,``, no newlines) unless the schema's own
#: ``x-guidance`` says otherwise: free whitespace lets a small model loop on spaces until max_tokens
JSON_DEFAULTS = {"whitespace_flexible": False}
FEATURE = "constrained decoding (response_format json_object/json_schema, regex, grammar)"


def _llguidance() -> Any:
    return require("llguidance", FEATURE)


class Grammars:
    """The model's tokenizer for llguidance (``tokenizer_json``: the folder's ``tokenizer.json``
    text; ``vocab_size``: the width of the model's logits; ``eos``: its end-of-sequence tokens)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: Sequence[int]):
        llg = _llguidance()
        if not eos:
            raise InputError("constrained decoding needs the model's end-of-sequence token (none in the folder): "
                             "a constrained answer could never end")
        self.vocab_size = int(vocab_size)
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=self.vocab_size, eos_token=list(eos))
        self.words = (self.vocab_size + 31) // 32  # 32-bit words of a mask

    def grammar(self, kind: str, source: Any = None) -> str:
        """llguidance's grammar text for ``kind`` (:data:`KINDS`)."""
        llg = _llguidance()
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if kind == "json_schema":
            if not isinstance(source, dict):
                raise InputError("the JSON schema must be an object")
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(source), defaults=JSON_DEFAULTS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(str(source))
        if kind == "grammar":
            return llg.LLMatcher.grammar_from_lark(str(source))
        raise InputError(f"unknown constraint {kind!r}; one of {', '.join(KINDS)}")

    def constraint(self, kind: str, source: Any = None) -> Constraint:
        """A fresh matcher for one stream; a grammar llguidance refuses is an ``InputError``."""
        llg = _llguidance()
        try:
            grammar = self.grammar(kind, source)
        except (ValueError, TypeError) as exc:
            raise InputError(f"the {kind} is not valid: {one_line(exc)}") from None
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise InputError(f"the {kind} is not valid: {one_line(error)}")
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InputError(f"the {kind} is not valid: {one_line(matcher.get_error())}")
        return Constraint(matcher, self.words, self.vocab_size)


class Constraint:
    """One stream's grammar state: :meth:`mask` its logits, :meth:`advance` by the token picked."""

    def __init__(self, matcher: Any, words: int, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.bits = np.zeros(words, np.int32)

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, as booleans [vocab]."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        return np.unpackbits(self.bits.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)

    def mask(self, logits: np.ndarray) -> None:
        """Forbidden tokens of ``logits`` [vocab] (float64, written in place) at -inf."""
        logits[~self.allowed()] = -np.inf

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"the grammar refused token {int(token)}, which its own mask allowed: "
                               f"{one_line(self.matcher.get_error())}")

    @property
    def finished(self) -> bool:
        return bool(self.matcher.is_stopped())
