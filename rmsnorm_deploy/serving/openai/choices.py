"""A request's choices: the sampling fields of each (``serving.engine.sampling``), its engine stream,
its text as it comes, and its tokens' logprobs in OpenAI's two shapes.

``n`` choices are ``n`` engine streams of the same prompt, decoded together in the engine's batch:
the first prefills the prompt, the others start from copies of its prompt KV and its last prompt
logits (``Engine.submit(follow=...)``), so the prompt is prefilled once. Choice ``i`` of a
request with a ``seed`` samples with ``seed + i``, so the choices differ and a request repeated
with its seed answers the same.

Logprobs: a token's ``token`` is its text and ``bytes`` its UTF-8 bytes (a byte-level token that
holds part of a character has its bytes, its text shows U+FFFD), as OpenAI's chat logprobs give
them; completions' legacy shape lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict
per token) and ``text_offset``. Only tokens whose text was handed out are listed: none after a
stop string, and no end-of-sequence token.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any

from rmsnorm_deploy.serving.engine.sampling import Chooser, Record, SamplingFields
from rmsnorm_deploy.serving.openai.text import TextStream

#: OpenAI's default temperature
DEFAULT_TEMPERATURE = 1.0
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def sampling_fields(req: Any, index: int, seed: int, bias: dict[int, float], *, logprobs: bool,
                    top_logprobs: int) -> SamplingFields:
    """Choice ``index``'s fields from a request (``seed``: the request's, or one drawn for it)."""
    temperature = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
    return SamplingFields(
        temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0, min_p=req.min_p or 0.0, seed=(seed + index) % 2**63,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=bias, logprobs=logprobs, top_logprobs=top_logprobs)


def request_seed(req: Any) -> int:
    return req.seed if req.seed is not None else secrets.randbits(63)


@dataclasses.dataclass
class Choice:
    """One choice of a request: its index, engine stream, picker and text."""

    index: int
    stream: Any
    chooser: Chooser
    text: TextStream
    logged: int = 0  # tokens whose logprobs were handed out (streaming)

    def shown_records(self, eos: frozenset[int], *, final: bool) -> list[Record]:
        """The records of the tokens not yet listed whose text was handed out (all of them once
        ``final``, except after a stop string and end-of-sequence tokens)."""
        records = self.chooser.records
        end = len(self.text.ids)
        if self.text.stopped:
            end = max(self.logged, end - 1)  # the token that completed the stop string is not shown
        elif not final and len(self.text.released) < len(self.text.text):
            end = self.logged  # text held back: its tokens wait for it
        new = [r for r in records[self.logged:end] if r.token not in eos]
        self.logged = max(self.logged, end)
        return new


class TokenTexts:
    """Each token's text and UTF-8 bytes for logprobs, from the folder's tokenizer (``tokenizers``)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        self.byte_level = "ByteLevel" in json.dumps(decoder)
        self.table = {c: b for b, c in byte_chars().items()}
        self.added = set(tokenizer.get_added_tokens_decoder())  # written as their text, not in bytes
        self._cache: dict[int, bytes] = {}

    def bytes(self, token: int) -> bytes:
        if token not in self._cache:
            piece = self.tokenizer.id_to_token(token) or ""
            if token in self.added:
                raw = piece.encode()
            elif self.byte_level and all(c in self.table for c in piece):
                raw = bytes(self.table[c] for c in piece)
            elif _BYTE_TOKEN.match(piece):
                raw = bytes([int(_BYTE_TOKEN.match(piece).group(1), 16)])
            else:
                raw = piece.replace("\u2581", " ").encode()
            self._cache[token] = raw
        return self._cache[token]

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="replace")

    def entry(self, token: int, logprob: float) -> dict[str, Any]:
        return {"token": self.text(token), "logprob": logprob, "bytes": list(self.bytes(token))}

    def chat(self, records: list[Record]) -> dict[str, Any]:
        """Chat's ``logprobs``: ``{"content": [...], "refusal": None}``."""
        return {"content": [{**self.entry(r.token, r.logprob), "top_logprobs": [self.entry(t, lp) for t, lp in r.top]}
                            for r in records], "refusal": None}

    def completion(self, records: list[Record], offset: int = 0) -> dict[str, Any]:
        """Completions' ``logprobs`` (``offset``: where the first token's text starts in the answer)."""
        tokens = [self.text(r.token) for r in records]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
                "top_logprobs": [self._top(r) for r in records], "text_offset": offsets}

    def _top(self, record: Record) -> dict[str, float]:
        """A token's alternatives keyed by text (two tokens of one text: the likelier one's logprob)."""
        top: dict[str, float] = {}
        for token, logprob in record.top:
            top.setdefault(self.text(token), logprob)
        return top


def byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are written in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
