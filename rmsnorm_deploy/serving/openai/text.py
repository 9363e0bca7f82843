"""Text in and out of the generation engine: chat prompts through the folder's chat template, and
a token stream turned into text as it comes, cut at stop strings.

:class:`TextStream` hands out the text of a growing list of tokens piece by piece, so that the
pieces joined are exactly the folder tokenizer's ``decode`` of all the tokens (what ``generate``
prints), and a piece never holds a character that a later token could still change: a character
of several UTF-8 bytes split across byte-level tokens decodes as U+FFFD until its last byte comes,
so trailing U+FFFD are held back until a later character follows them (or the stream ends). Stop
strings are matched in the text, not in tokens, so one that spans tokens is found; the text ends
before its first match, and text that could still become the start of a stop string is held back
until it cannot.

Why not decode each token alone: byte-level tokens split characters, and decoders join tokens with
context (SentencePiece drops the first token's leading space). Decoding everything again at each
token is exact but costs O(n) per token, so the stream decodes from an anchor: a token index ``a``
where decode(tokens[:a]) + decode(tokens[a:]) equalled the whole text when the anchor was set
(checked every :data:`ANCHOR_EVERY` tokens, :data:`ANCHOR_KEEP` tokens behind the end). A decoder
for which no split ever checks out keeps the anchor at 0 and decodes everything each time.

:class:`ChatTemplate` renders chat messages with transformers' ``apply_chat_template`` from the
folder's ``tokenizer_config.json`` / ``chat_template.jinja``, the tokenizer read from the folder
alone (``local_files_only``: never a hub).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rmsnorm_deploy.errors import InputError, UserError, one_line
from rmsnorm_deploy.optional import require

#: how often (in tokens) the stream tries to move its anchor, and how many tokens stay after it
ANCHOR_EVERY, ANCHOR_KEEP = 32, 4
_REPLACEMENT = "\ufffd"


class TextStream:
    """Tokens in, text pieces out (see the module docstring). ``decode(ids) -> str`` is the
    folder tokenizer's decode; ``stop``: the stop strings (none empty)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        if any(not s for s in stop):
            raise InputError("a stop string is empty; give non-empty strings")
        self.decode = decode
        self.stop = list(stop)
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.text = ""  # the text of every token so far
        self.sent = 0  # characters of self.text handed out
        self.stopped = False  # a stop string was found: the text ends before it
        self._anchor, self._anchor_text = 0, ""

    def push(self, token: int) -> str:
        """Add one token; the text it releases ('' while held back, and after a stop string)."""
        if self.stopped:
            return ""
        self.ids.append(int(token))
        self.text = self._anchor_text + self.decode(self.ids[self._anchor:])
        if len(self.ids) - self._anchor >= ANCHOR_EVERY + ANCHOR_KEEP:
            self._move_anchor()
        return self._release(final=False)

    def finish(self) -> str:
        """The text still held back, once the stream has ended (a trailing U+FFFD included: the
        stream ended inside a character, and ``decode`` says so)."""
        return "" if self.stopped else self._release(final=True)

    @property
    def released(self) -> str:
        return self.text[:self.sent]

    def _move_anchor(self) -> None:
        split = len(self.ids) - ANCHOR_KEEP
        head = self._anchor_text + self.decode(self.ids[self._anchor:split])
        if head + self.decode(self.ids[split:]) == self.text:
            self._anchor, self._anchor_text = split, head

    def _release(self, *, final: bool) -> str:
        text, start = self.text, self.sent
        if self.stop:
            search = max(0, start - self.longest_stop + 1)
            hits = [i for i in (text.find(s, search) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                end = max(min(hits), start)
                self.sent = end
                return text[start:end]
        end = len(text)
        if not final:
            end = len(text.rstrip(_REPLACEMENT))  # a character may still be completed by the next token
            end -= _stop_prefix_length(text[start:end], self.stop)
        end = max(end, start)
        self.sent = end
        return text[start:end]


def _stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that is the start of a stop string (held back)."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def chat_template_source(folder: Path) -> str | None:
    """The folder's chat template: ``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of named templates with a ``default``); None without one."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8", errors="replace")
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise UserError(f"{path}: not readable JSON ({one_line(exc)})") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


class ChatTemplate:
    """The folder's chat template, rendered by transformers (see the module docstring). Build it
    with :meth:`load`, which says why chat is refused when it cannot be served."""

    PROBE = [{"role": "user", "content": "hello"}]

    def __init__(self, tokenizer: Any, source: str | None = None):
        self.tokenizer, self.source = tokenizer, source  # source: the template's text

    @classmethod
    def load(cls, folder: Path) -> tuple[ChatTemplate | None, str | None]:
        """``(template, None)``, or ``(None, why chat is refused)`` for a folder without a usable
        template; a damaged tokenizer_config.json is a :class:`UserError`."""
        source = chat_template_source(folder)
        if source is None:
            return None, (f"{folder} has no chat template (tokenizer_config.json's chat_template or "
                          "chat_template.jinja); send the prompt as text to /v1/completions")
        transformers = require("transformers", "rendering the folder's chat template")
        try:
            tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad folder
            return None, f"transformers cannot read the tokenizer of {folder} ({one_line(exc)})"
        template = cls(tokenizer, source)
        try:
            template.render(cls.PROBE)
        except InputError as exc:
            return None, f"the chat template of {folder} does not render a one-message chat ({exc})"
        return template, None

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text of ``messages`` (and ``tools``, OpenAI's tool objects) with the assistant's
        turn opened (``add_generation_prompt``); a template that refuses them (``raise_exception``) or
        fails is an :class:`InputError`."""
        try:
            text = self.tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                      tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja2 and the template's own raise_exception
            raise InputError(f"the model's chat template refused these messages: {one_line(exc)}") from None
        if not isinstance(text, str):
            raise InputError(f"the model's chat template rendered {type(text).__name__}, not text")
        return text
