"""Errors a user can act on.

Every :class:`UserError` carries a one-line message that names the problem and the fix;
the CLI prints it and exits with code 2, without a traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: printed as one line, CLI exit code 2."""

    exit_code = 2


class SpecError(UserError, ValueError):
    """An RMSNormSpec that does not describe a valid RMSNorm."""


class LoweringError(UserError):
    """A spec that the requested lowering cannot represent exactly."""


class MissingDependencyError(UserError, ImportError):
    """An optional dependency (onnxruntime, tensorrt, triton, transformers) is not installed."""


class ProviderError(UserError):
    """A requested execution provider is not what actually runs (never a silent fallback)."""


class ModelFileError(UserError):
    """An ONNX file that cannot be read safely: missing, not ONNX, truncated, unsafe external data."""


class InputError(UserError):
    """Inputs of the wrong name, shape or dtype for a model."""


class OutputExistsError(UserError, FileExistsError):
    """An output file exists and ``--force`` was not given."""


def one_line(exc: BaseException, *, limit: int = 400) -> str:
    """An exception's message folded onto one line, for errors that quote a library's reason.

    ONNX Runtime's source locations and C++ signatures are dropped: the sentence after them is
    what the user needs. An empty message gives the exception's type name.
    """
    import re

    text = " ".join(str(exc).split())
    text = re.sub(r"/onnxruntime_src/\S+:\d+ (?:[^()]*\([^()]*\) )?", "", text)
    return text[:limit] if text else type(exc).__name__


#: Ctrl-C and SIGTERM raised while a command runs, until the command has answered for them
_interrupts: list[type[BaseException]] = []


def note_interrupt(kind: type[BaseException]) -> None:
    """Record a Ctrl-C or SIGTERM as its exception is raised (the CLI's signal handlers call this).

    Why: on its way up, such an exception can be swallowed (a library that turns it into its own
    error, a finalizer where Python can only drop it), and the command would carry on as if nothing
    had happened: a check reported failed, an output published. :func:`check_interrupted` raises it
    again at the next stage boundary and when the command returns.
    """
    _interrupts.append(kind)


def check_interrupted() -> None:
    """Raise the last recorded Ctrl-C or SIGTERM again, once (nothing when none came)."""
    if _interrupts:
        kind = _interrupts[-1]
        _interrupts.clear()
        raise kind()


def interrupt_pending() -> bool:
    return bool(_interrupts)


def take_interrupt() -> type[BaseException] | None:
    """The last recorded Ctrl-C or SIGTERM not yet answered for (cleared), or ``None``."""
    kind = _interrupts[-1] if _interrupts else None
    _interrupts.clear()
    return kind


def clear_interrupts() -> None:
    """The command has answered for the interrupts so far (it unwound and said so)."""
    _interrupts.clear()
