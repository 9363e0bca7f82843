"""Constrained decoding: a stream's tokens kept inside a JSON schema, any JSON object, a regular
expression or a Lark grammar, through llguidance (the library behind vLLM's ``guidance`` backend
and llama.cpp's ``--grammar`` option of the same name).

Why llguidance and not xgrammar: both build the allowed-token mask of SmolLM2's 49,152 tokens in
tens of microseconds per token (``benchmarks/bench_openai_fields.py``, results in
``benchmarks/results/openai_fields.md``), but xgrammar 0.2.8 needs torch and triton where
llguidance needs nothing beyond its own wheel, and it reads the folder's ``tokenizer.json`` as it
is (no transformers on the serving path).

:class:`Grammars` is the model's tokenizer as llguidance sees it, made once per model (~1 s for a
vocabulary of 49k); :meth:`Grammars.constraints` compiles one request's grammar into
:class:`Constraint` s, the per-stream matchers that mask each step's logits (tokens the grammar
forbids at -inf) and advance by the token picked. The grammar allows the model's end-of-sequence
token only where the text is complete, so a constrained stream ends with a whole value; only
``max_tokens`` can cut it short (``finish_reason: "length"``, as in OpenAI's API).

**Admission.** llguidance reports what is past its limits when a grammar is compiled, when a mask
is computed and when a token is consumed ("too many expressions constructed", "Too many items
(limit 50000)", "Current row has N items; max is 2000"); a request must learn it before it takes
a slot, not as a failed generation. So :meth:`Grammars.constraints` refuses (``InputError``, one
line) before anything is queued:

- a grammar llguidance does not compile, or compiles past :func:`limits`;
- a JSON schema that requires itself without end (``schema_recursion``: no finite value);
- a grammar that can match no text (its first mask allows no token, or only an end it has not
  reached) or only the empty text (nothing to generate);
- a grammar past the limits on the way in: a probe walks up to :data:`PROBE_TOKENS` tokens into an
  answer (the grammar's longest allowed token each step; past :data:`PROBE_AT_LEAST` tokens within
  :data:`PROBE_BUDGET_S`), which is where the limits of a 10^6 repeat, a 1 MB pattern, a
  3,000-branch ``anyOf`` or a rule without end show.

llguidance's fuel bounds each step, so the admission of the worst of these takes about a second
(``benchmarks/results/hostile_openai.md``). A limit met later, deeper in an answer the probe did
not take, or a dead end there, ends that stream alone with :class:`GrammarStopped` (an
``InputError``: the request's grammar, not the server, is at fault), never a token the grammar did
not allow and never an empty "stop".
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Sequence

import numpy as np

from rmsnorm_deploy.errors import InputError, one_line
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.serving.engine.schema_recursion import endless_requirement

#: the kinds of constraint a request can ask for, and what each one's ``source`` is
KINDS = {"json_object": "nothing (any JSON object)", "json_schema": "a JSON schema (an object)",
         "regex": "a regular expression (Rust regex syntax)", "grammar": "a Lark grammar (llguidance's syntax)"}
#: JSON written compactly (one space after ``:`` and ``,``, no newlines) unless the schema's own
#: ``x-guidance`` says otherwise: free whitespace lets a small model loop on spaces until max_tokens
JSON_DEFAULTS = {"whitespace_flexible": False}
FEATURE = "constrained decoding (response_format json_object/json_schema, regex, grammar)"
#: llguidance's fuel for building a grammar's lexer (its default is 1,000,000): at the default a
#: 10^6 repeat or a 1 MB pattern spends 1.4 to 4 s of one core on the first mask before failing
#: (SmolLM2's 49k vocabulary); at 200,000 it fails in 0.3 to 0.7 s, and real patterns (dates,
#: e-mail addresses, 10^4 repeats, the JSON schemas of the tests, an enum of 10,000 strings) compile
#: as before. The price: an enum of 20,000 strings, admitted at the default, is refused here.
INITIAL_LEXER_FUEL = 200_000
#: tokens the admission probe walks into an answer, and the seconds it may take once it has walked
#: PROBE_AT_LEAST (then it stops looking, having found nothing: the limits still hold for every step
#: of the generation). The first tokens are always walked, whatever the machine's load: the limits
#: of a huge repeat or pattern show at the first token, of a recursive rule at the second mask.
PROBE_TOKENS, PROBE_AT_LEAST, PROBE_BUDGET_S = 16, 2, 1.0
#: the first line of llguidance's error when the text so far can only end where the grammar does not
DEAD_END = ("NoExtension", "NoExtensionBias")
#: how llguidance begins a schema that no value matches (bounds that contradict, an empty enum)
UNSATISFIABLE = "Unsatisfiable schema"
#: llguidance's words for a compile error that is a limit, not a mistake in the grammar
LIMIT_WORDS = re.compile(r"fuel|limit|too many|too large|max is|exceed", re.IGNORECASE)
HINT = "simplify it (fewer alternatives, shorter repetitions, less nesting)"


def _llguidance() -> Any:
    return require("llguidance", FEATURE)


def limits() -> Any:
    """llguidance's limits for every matcher here: its defaults (2,000 items per row, 50,000 items
    and 200,000 lexer fuel per step, 250,000 lexer states, 500,000 grammar symbols) but the
    initial lexer fuel (:data:`INITIAL_LEXER_FUEL`), and errors without the parser's state in them."""
    return _llguidance().LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL, verbose_errors=False)


class GrammarStopped(InputError):
    """A stream's grammar cannot go on: past llguidance's limits, or at a dead end (one line)."""


def _first_line(error: str) -> str:
    line = next((x.strip() for x in str(error).splitlines() if x.strip()), "")
    return line[:200] or "no reason given"


def _dead_end(what: str, where: str) -> str:
    if where:
        return (f"{what} has no way to go on {where}: no text that begins so matches it (a rule or pattern "
                "that can never end)")
    return f"{what} can match no text, so no answer could satisfy it"


def _problem(matcher: Any, what: str, where: str) -> str | None:
    """Why ``matcher`` cannot go on, in one line naming ``what`` (``where``: how far into the answer,
    empty at its start), or None while it can."""
    if not matcher.is_error():
        return None
    error = _first_line(matcher.get_error())
    if error in DEAD_END:
        return _dead_end(what, where)
    return f"{what} is beyond the grammar engine's limits{' ' + where if where else ''} ({error}); {HINT}"


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
        self.eos = np.zeros(self.vocab_size, bool)
        self.eos[[e for e in eos if 0 <= e < self.vocab_size]] = True
        #: each token's length in bytes: the probe takes the longest allowed token (deepest into the answer)
        self.lengths = np.array([len(self.tokenizer.decode_bytes([t])) for t in range(self.vocab_size)], np.int64)

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

    def constraints(self, kind: str, source: Any = None, n: int = 1, *, what: str | None = None) -> list[Constraint]:
        """``n`` fresh matchers of one grammar, compiled once and admitted (see the module
        docstring); what is refused is an ``InputError`` naming ``what`` (default: the kind)."""
        llg, what = _llguidance(), what or f"the {kind}"
        if kind == "json_schema" and (endless := endless_requirement(source)) is not None:
            raise InputError(f"{what} can match no value: {endless}")
        try:
            grammar = self.grammar(kind, source)
        except (ValueError, TypeError, RecursionError) as exc:
            raise InputError(f"{what} is not valid: {one_line(exc)}") from None
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits())
        if matcher.is_error():
            error = matcher.get_error()
            if _first_line(error).startswith(UNSATISFIABLE):
                raise InputError(f"{what} can match no value: {_first_line(error)[len(UNSATISFIABLE):].strip(': ')}")
            if LIMIT_WORDS.search(_first_line(error)):
                raise InputError(f"{what} is beyond the grammar engine's limits ({_first_line(error)}); {HINT}")
            raise InputError(f"{what} is not valid: {_first_line_or_all(error)}")
        self._probe(matcher.deep_copy(), what)
        return [Constraint(matcher if i == 0 else matcher.deep_copy(), self, what) for i in range(n)]

    def _probe(self, matcher: Any, what: str) -> None:
        """Walk into an answer (see the module docstring); raise ``InputError`` at what the grammar
        cannot do."""
        bits, start, taken = np.zeros(self.words, np.int32), time.perf_counter(), []
        while True:
            where = f"after the text {self.tokenizer.decode_str(taken)[:80]!r}" if taken else ""
            allowed = self._allowed(matcher, bits)
            problem = _problem(matcher, what, where)
            if problem is not None:
                raise InputError(problem)
            words = allowed & ~self.eos
            if not words.any():
                if not taken and allowed.any() and matcher.is_accepting():
                    raise InputError(f"{what} matches only the empty text, so there is nothing to generate; give one "
                                     "that matches some text")
                if not matcher.is_accepting():
                    raise InputError(_dead_end(what, where))
                return  # the probe's answer is whole
            if len(taken) == PROBE_TOKENS or (len(taken) >= PROBE_AT_LEAST and
                                              time.perf_counter() - start > PROBE_BUDGET_S):
                return
            taken.append(int(np.argmax(np.where(words, self.lengths, -1))))
            if not matcher.consume_token(taken[-1]):
                raise InputError(_problem(matcher, what, where) or f"{what} refused a token its own mask allowed")

    def _allowed(self, matcher: Any, bits: np.ndarray) -> np.ndarray:
        matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        return np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)


def _first_line_or_all(error: str) -> str:
    """A compile error: the whole message on one line when it points into the client's own text
    (llguidance's ``at 1(8): ...`` with the source line), else its first line."""
    return one_line(error) if str(error).startswith("at ") else _first_line(error)


class Constraint:
    """One stream's grammar state: :meth:`mask` its logits, :meth:`advance` by the token picked;
    either raises :class:`GrammarStopped` where the grammar cannot go on."""

    def __init__(self, matcher: Any, grammars: Grammars, what: str):
        self.matcher, self.grammars, self.what = matcher, grammars, what
        self.bits = np.zeros(grammars.words, np.int32)
        self.tokens = 0  # consumed so far

    @property
    def _where(self) -> str:
        return f"after {self.tokens} tokens of the answer" if self.tokens else ""

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, as booleans [vocab]."""
        allowed = self.grammars._allowed(self.matcher, self.bits)
        self._check()
        if not (allowed & ~self.grammars.eos).any() and not self.matcher.is_accepting():
            raise GrammarStopped(_dead_end(self.what, self._where))
        return allowed

    def mask(self, logits: np.ndarray) -> None:
        """Forbidden tokens of ``logits`` [vocab] (float64, written in place) at -inf."""
        logits[~self.allowed()] = -np.inf

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            self._check()
            raise GrammarStopped(f"{self.what} refused token {int(token)} {self._where or 'at the start'}")
        self.tokens += 1

    def _check(self) -> None:
        problem = _problem(self.matcher, self.what, self._where)
        if problem is not None:
            raise GrammarStopped(problem)

    @property
    def finished(self) -> bool:
        return bool(self.matcher.is_stopped())
