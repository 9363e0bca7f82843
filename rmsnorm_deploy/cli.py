"""The ``rmsnorm-deploy`` command line.

Each subcommand lives in ``rmsnorm_deploy/commands/<name>.py`` with ``add_arguments(parser)``
and ``run(args) -> int``; building the parser imports no optional dependency, so ``--help``
works with only torch, onnx and onnxscript installed. Errors the user can fix print one line
and exit with code 2; a failed parity check exits with code 1.

Whatever happens inside :func:`main`, the terminal gets one line, never a traceback: Ctrl-C
anywhere (start-up included) exits 130 and SIGTERM 143, both unwinding the stack so that
staging folders and temporary files are removed; a refusal of the file system (a name too long,
a folder under ``/proc``) exits 2 naming the path; a closed pipe (``| head``) ends quietly with
141, as the shell's own tools do; text that the terminal's encoding cannot show is escaped.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import errno
import importlib
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator, Sequence

from rmsnorm_deploy.errors import (
    UserError,
    check_interrupted,
    clear_interrupts,
    interrupt_pending,
    note_interrupt,
    one_line,
    take_interrupt,
)
from rmsnorm_deploy.resources import __version__

#: command name -> (module under rmsnorm_deploy.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "sweep": ("sweep", "build the standalone RMSNorm model of each lowering, run it in ONNX Runtime CPU against the "
              "float64 oracle, print the table"),
    "validate": ("validate", "run a model on each backend (ONNX Runtime CPU/CUDA/TensorRT, TensorRT) and compare it with "
                 "its PyTorch source or float64 oracle; exit 1 on a parity failure"),
    "audit": ("audit", "list every RMSNorm/LayerNorm reduction and the dtype it accumulates in, as written and after "
              "ONNX Runtime's optimizations; exit 1 if any is float16/bfloat16"),
    "export": ("export", "export a pre-norm model (preset or Hugging Face folder) to ONNX, every RMSNorm exact; check parity"),
    "generate": ("generate", "generate tokens with a KV-cache model (export --kv-cache) in ONNX Runtime: greedy or "
                 "sampled, past/present bound with IOBinding; prints prefill ms, decode ms/token, tokens/s"),
    "perplexity": ("perplexity", "perplexity of a KV-cache model (ours, onnxruntime-genai's or optimum's folder) over "
                   "a text in llama-perplexity's scheme (chunks of 256, second half scored; --stride N: sliding "
                   "windows); --kl-divergence REF_DIR: KL divergence and top-1 agreement with a reference model"),
    "env": ("env", "print the environment: versions, GPU, ONNX Runtime providers, TensorRT, plugin"),
    "build": ("build", "build a strongly typed TensorRT engine from an ONNX model and check where its norms run"),
    "check-trt": ("check_trt", "check without TensorRT whether a TensorRT version's ONNX parser imports a model"),
    "serve": ("serve", "serve an exported model with Triton Inference Server (embedded): KServe v2 HTTP/gRPC, dynamic "
              "batching, ONNX Runtime inside"),
    "triton-repo": ("triton_repo", "write a model repository for the standalone Triton Inference Server "
                    "(onnxruntime or tensorrt backend) from an exported model or engine"),
}

#: old command name -> its name now; the old one still works, with a note on stderr
RENAMED: dict[str, str] = {"parity": "sweep"}


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line with exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rmsnorm-deploy",
        description="RMSNorm from PyTorch to ONNX, ONNX Runtime and TensorRT with its numerics guaranteed.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(f"rmsnorm_deploy.commands.{module_name}")
        aliases = [old for old, new in RENAMED.items() if new == name]
        cmd = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(), aliases=aliases)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


#: exit codes of a command stopped from outside, as the shell reports a process killed by the signal
EXIT_INTERRUPTED = 130  # SIGINT (Ctrl-C)
EXIT_BROKEN_PIPE = 141  # SIGPIPE: the reader of stdout went away
EXIT_TERMINATED = 143  # SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that it cleans up exactly as on Ctrl-C."""


def _raise_terminated(signum: int, frame: object) -> None:
    note_interrupt(Terminated)
    raise Terminated()


def _raise_interrupted(signum: int, frame: object) -> None:
    """Python's own Ctrl-C, recorded first (``errors.note_interrupt``)."""
    note_interrupt(KeyboardInterrupt)
    raise KeyboardInterrupt()


def _signal_again(unraisable: Any, previous: Callable[[Any], None]) -> None:
    """``sys.unraisablehook`` while a command runs: a Ctrl-C or SIGTERM raised inside a finalizer
    (a weakref callback, a ``__del__``), where Python can only print and drop it, is raised again a
    moment later in the program's own code, so the command still stops and cleans up (unless a
    stage boundary has raised it again first: ``errors.check_interrupted``)."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        previous(unraisable)
        return
    signum = signal.SIGTERM if isinstance(unraisable.exc_value, Terminated) else signal.SIGINT

    def again() -> None:
        if interrupt_pending():
            _thread.interrupt_main(signum)

    timer = threading.Timer(0.01, again)
    timer.daemon = True
    timer.start()


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` while the command runs (in the main thread only: signal
    handlers can be set nowhere else); the previous handler comes back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    previous_int = signal.signal(signal.SIGINT, _raise_interrupted)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: _signal_again(unraisable, previous_hook)
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        # None: the previous handler was not set from Python; the default is the nearest to it
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        signal.signal(signal.SIGINT, previous_int if previous_int is not None else signal.default_int_handler)


def _escape_unprintable() -> None:
    """Text the output's encoding cannot show (a path in an ASCII terminal) is escaped, not an error."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="backslashreplace")


def _fill_closed_std_streams() -> None:
    """A standard stream the caller closed (``cmd >&-``) is /dev/null for this process: Python leaves
    ``sys.stdout`` None then, and the next file opened would take descriptor 1, where anything that
    writes to standard output would write into it."""
    for fd, name, mode in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY), (2, "stderr", os.O_WRONLY)):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, mode)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "r" if fd == 0 else "w", encoding="utf-8"))  # noqa: SIM115


def _silence_stdout() -> None:
    """After the reader of our stdout went away: point it at /dev/null, so that the flush at exit
    does not complain a second time."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


_OS_ERROR_FIXES = {
    errno.ENAMETOOLONG: "shorten the path (a file name holds at most 255 bytes)",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder; choose another path",
    errno.EACCES: "choose a path you may write, or change its permissions",
    errno.EPERM: "choose a path you may write, or change its permissions",
    errno.EROFS: "choose a path on a writable file system",
    errno.ENOSPC: "free some disk space or choose another path",
}


def os_error_line(exc: OSError) -> str:
    """An operating-system refusal as one line: the path, the system's reason, and what to do."""
    where = " -> ".join(str(name) for name in (exc.filename, exc.filename2) if name is not None)
    reason = exc.strerror or one_line(exc)
    fix = _OS_ERROR_FIXES.get(exc.errno, "check the path and the file system")
    return f"{where + ': ' if where else ''}{reason}; {fix}"


def main(argv: Sequence[str] | None = None) -> int:
    _fill_closed_std_streams()
    _escape_unprintable()
    prog = "rmsnorm-deploy"
    clear_interrupts()
    try:
        with _sigterm_unwinds():
            parser = build_parser()
            args = parser.parse_args(argv)
            if not getattr(args, "_run", None):
                parser.print_help()
                return 2
            if args.command in RENAMED:
                print(f"rmsnorm-deploy: note: `{args.command}` is now `{RENAMED[args.command]}`; the old name still "
                      "works but will be removed", file=sys.stderr)
            prog = f"rmsnorm-deploy {args.command}"
            code = int(args._run(args) or 0)
            check_interrupted()  # one swallowed on its way up: the command's answer is not to be trusted
            sys.stdout.flush()  # a closed pipe is found here, not at interpreter exit
            return code
    except UserError as exc:
        swallowed = take_interrupt()  # an error that an interrupt turned into: report the interrupt
        if swallowed is not None:
            return _interrupted(prog, swallowed)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # Terminated included
        clear_interrupts()
        return _interrupted(prog, type(exc))
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        print(f"{prog}: error: {os_error_line(exc)}", file=sys.stderr)
        return 2


def _interrupted(prog: str, kind: type[BaseException]) -> int:
    if issubclass(kind, Terminated):
        print(f"{prog}: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    print(f"{prog}: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
