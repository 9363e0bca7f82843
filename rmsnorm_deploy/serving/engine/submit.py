"""How a front end submits a generation to the engine and learns how it ended, when it ended other
than with its tokens: one small outcome type, :class:`Refusal`, that each front maps to its own
codes (the KServe models to Triton's error codes, the OpenAI API to its HTTP statuses and error
types).

===========  ==========================================  =====================  ===========
kind         when                                        KServe (HTTP / gRPC)   OpenAI
===========  ==========================================  =====================  ===========
invalid      the request is wrong (``InputError``; its      400 / INVALID_ARGUMENT 400
             grammar's ``GrammarStopped`` mid-answer)
busy         every slot busy, the queue full             503 / UNAVAILABLE      429
unavailable  the engine warming up or draining           503 / UNAVAILABLE      503
cancelled    the server ended it (a drain out of time)   503 / UNAVAILABLE      503
failed       a generation step failed                    500 / INTERNAL         500
===========  ==========================================  =====================  ===========
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from rmsnorm_deploy.errors import InputError, one_line
from rmsnorm_deploy.serving.engine.constraints import GrammarStopped
from rmsnorm_deploy.serving.engine.engine import EngineBusy, EngineUnavailable, Stream, StreamCancelled, StreamFailed

#: the kinds of :class:`Refusal`, in the order of the module docstring's table
KINDS = ("invalid", "busy", "unavailable", "cancelled", "failed")


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A generation not answered with its tokens: its ``kind`` (:data:`KINDS`) and one line."""

    kind: str
    message: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown refusal kind {self.kind!r}; one of {KINDS}")
        object.__setattr__(self, "message", one_line(self.message))


def submit_generation(engine: Any, prompt: Sequence[int], max_new_tokens: int, *, sampling: Any = None,
                      name: str = "max_new_tokens", pick: Any = None, **more: Any) -> Stream | Refusal:
    """The request's :class:`Stream` in ``engine``, or the :class:`Refusal` to answer it with
    (``name``: how the front calls ``max_new_tokens`` in its messages; ``pick``: the stream's own
    picker, ``Engine.submit``'s; ``more``: ``Engine.submit``'s other keywords)."""
    try:
        return engine.submit(prompt, max_new_tokens=max_new_tokens, sampling=sampling, name=name, pick=pick, **more)
    except EngineBusy as exc:
        return Refusal("busy", str(exc))
    except EngineUnavailable as exc:
        return Refusal("unavailable", str(exc))
    except InputError as exc:
        return Refusal("invalid", str(exc))


def ending(exc: BaseException) -> Refusal:
    """The :class:`Refusal` a stream that raised ``exc`` while a front read it ends with."""
    if isinstance(exc, StreamCancelled):
        return Refusal("cancelled", str(exc))
    if isinstance(exc, StreamFailed):
        return Refusal("failed", str(exc))
    if isinstance(exc, GrammarStopped):
        return Refusal("invalid", str(exc))
    return Refusal("failed", f"generation failed: {one_line(exc)}")
