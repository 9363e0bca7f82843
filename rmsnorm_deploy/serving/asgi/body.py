"""A request's body as both HTTP APIs of ``serve`` read it (KServe's front and the OpenAI API): within
a time limit, within a size limit, decompressed where the client compressed it.

- **Time.** A client that trickles its body holds a connection and a task: the whole body must
  arrive within ``timeout_s`` (:data:`BODY_TIMEOUT_S`), else 408.
- **Size.** A body over the limit is a 413, whether ``Content-Length`` says so or its bytes do
  (chunked, or a lie). It is still read and dropped up to :data:`DRAIN_FACTOR` times the limit,
  so that a client still sending reads the 413 rather than a connection reset; a
  ``Content-Length`` beyond that is refused before a byte is read.
- **Encoding.** gzip and deflate are decompressed here to at most the limit (a small bomb is a
  413); other encodings are a 415.
- **A client gone mid-body** (Starlette's ``ClientDisconnect``) is one line in the server's log,
  not a traceback: nobody is left to answer.

Every refusal is a :class:`BodyRefused` (an HTTP status and one line), which each API answers in
its own error form.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from typing import Any

#: seconds a client may take to send its body (a client that trickles bytes holds a connection)
BODY_TIMEOUT_S = 30.0
#: a body over the limit is still read (and dropped) up to this many times the limit before the
#: refusal, so that the client, still sending, reads the 413 instead of a connection reset
DRAIN_FACTOR = 3
#: the status of a request whose client left before its body arrived (nobody reads the answer)
CLIENT_GONE = 499
#: where a body's size limit is set, named in the refusal
LIMIT_FLAG = "serve --max-request-bytes"
_DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_log = logging.getLogger("rmsnorm_deploy.serving")


class BodyRefused(Exception):
    """A body this server does not take: ``status`` (4xx) and a one-line ``message``."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(" ".join(message.split()))
        self.status = status

    @property
    def message(self) -> str:
        return str(self)


def _over(limit: int, size: str | None = None) -> BodyRefused:
    said = f"is {size} bytes, over" if size else "is over"
    return BodyRefused(f"the body {said} this server's limit of {limit} bytes; send less ({LIMIT_FLAG})", 413)


async def read_body(request: Any, limit: int, *, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The body of ``request`` (a Starlette ``Request``) as sent; :class:`BodyRefused` with 413 above
    ``limit`` bytes, 408 after ``timeout_s`` seconds, 499 when the client closed mid-body."""
    from starlette.requests import ClientDisconnect  # optional: the serve extra

    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BodyRefused(f"Content-Length {declared[:40]!r} is not a byte count")
        if int(declared) > DRAIN_FACTOR * limit:
            raise _over(limit, declared)
    chunks: list[bytes] = []
    size = 0

    async def collect() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                chunks.clear()
            if size > DRAIN_FACTOR * limit:
                break
            if size <= limit:
                chunks.append(chunk)

    try:
        await asyncio.wait_for(collect(), timeout_s)
    except asyncio.TimeoutError:
        raise BodyRefused(f"the body did not arrive within {timeout_s:g} s", 408) from None
    except ClientDisconnect:
        _log.warning("a client closed its connection after %d bytes of its body to %s; nothing was answered", size,
                     request.url.path[:200])
        raise BodyRefused("the client closed its connection before its body arrived", CLIENT_GONE) from None
    said_over = declared is not None and int(declared) > limit
    if size > limit or said_over:
        raise _over(limit, declared if said_over else None)
    return b"".join(chunks)


def decode_body(body: bytes, encoding: str | None, limit: int) -> bytes:
    """``body`` decompressed (gzip, deflate), refused (413) if it would exceed ``limit`` bytes."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding not in _DECODERS:
        raise BodyRefused(f"Content-Encoding {encoding[:40]!r} is not supported; send gzip, deflate or identity", 415)
    decoder = zlib.decompressobj(_DECODERS[encoding])
    try:
        plain = decoder.decompress(body, limit + 1)
    except zlib.error as exc:
        raise BodyRefused(f"the body is not valid {encoding} ({exc})") from None
    if len(plain) > limit or decoder.unconsumed_tail:
        raise BodyRefused(f"the body decompresses to more than this server's limit of {limit} bytes; send less "
                          f"({LIMIT_FLAG})", 413)
    if not decoder.eof or decoder.unused_data:
        raise BodyRefused(f"the {encoding} body is truncated or has data after its end")
    return plain


async def read_plain_body(request: Any, limit: int, *, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """:func:`read_body`, then :func:`decode_body` by the request's ``Content-Encoding``."""
    body = await read_body(request, limit, timeout_s=timeout_s)
    return decode_body(body, request.headers.get("content-encoding"), limit)
