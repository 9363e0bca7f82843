"""Requests whose HTTP framing is broken, answered in the API's own JSON error line.

h11 (uvicorn's HTTP/1.1 parser here) refuses a request it cannot frame (a negative or conflicting
``Content-Length``, a bad chunk header, a request line or header line that is not HTTP, an
unsupported ``Transfer-Encoding``) before the app sees it, and uvicorn answers
``Invalid HTTP request received.`` in plain text. :func:`framing_protocol` is uvicorn's h11
protocol with that answer replaced: the status h11 suggests (a 4xx; its 501 for a transfer coding
it does not know is a 400 here, the client's to fix), ``Connection: close``, and the body the
front gives for a message (the OpenAI API's error object, KServe's ``{"error": ...}``) naming
what h11 found, without the client's bytes echoed back.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

#: a refusal's body for its one-line message: the JSON of each API's error shape
RefusalBody = Callable[[str], bytes]


def kserve_refusal(message: str) -> bytes:
    """KServe's (and Triton's) error shape."""
    return json.dumps({"error": message}).encode()


def framing_message(exc: BaseException | None) -> tuple[int, str]:
    """The status and the one line for h11's ``RemoteProtocolError`` ``exc`` (None: unknown)."""
    reason = " ".join(str(exc or "").split()).split(": bytearray(", 1)[0][:120] or "not HTTP/1.1"
    hint = getattr(exc, "error_status_hint", 400)
    status = hint if isinstance(hint, int) and 400 <= hint < 500 else 400
    return status, (f"the request is not valid HTTP/1.1 ({reason}); nothing of it was read: send one Content-Length "
                    "or chunked Transfer-Encoding, with the body it announces")


def framing_protocol(refusal_body: RefusalBody) -> type:
    """uvicorn's h11 protocol class that answers a request it cannot frame with
    ``refusal_body(message)`` (``uvicorn.Config(http=...)``)."""
    import h11  # optional: comes with uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class FramingProtocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            # uvicorn calls this from its `except h11.RemoteProtocolError` block: the error is the one
            # being handled
            status, message = framing_message(sys.exc_info()[1])
            cycle = getattr(self, "cycle", None)
            if cycle is not None:  # an app reading this request's body sees it end, and its answer is dropped
                cycle.disconnected = True
                cycle.message_event.set()
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                body = refusal_body(message)
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                           (b"connection", b"close")]
                for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body),
                              h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            self.transport.close()

    return FramingProtocol
