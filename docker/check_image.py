"""Check a built GPU image against its pins, at the end of ``docker build`` (no GPU needed).

The image is what docker/requirements-gpu.txt and the base image say, or the build stops:

* TensorRT (from the base image) is the version the Dockerfile's ``TENSORRT_VERSION`` names;
* torch is a CUDA 13 build, and Triton is the version that torch build requires;
* onnxruntime-gpu is installed with its CUDA provider, and the CPU-only ``onnxruntime``
  package is not (both own the ``onnxruntime`` module: the second one installed wins);
* every pin of the requirements file is installed at exactly its version;
* rmsnorm-deploy is installed and its command line starts.

``read_pins`` is also what tests/docker/test_docker.py uses to read the requirements file, so the
file is parsed one way everywhere.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

#: "differs from constraints.txt:" on a pin's line says why it is not constraints.txt's version.
DIFFERS_MARK = "differs from constraints.txt:"


class Pin(NamedTuple):
    name: str  # normalized: lower case, runs of -_. as one "-"
    version: str
    comment: str  # the text after "#" on the pin's own line, or ""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: str | Path) -> tuple[list[Pin], list[str]]:
    """The ``name==version`` pins of a requirements file and its option lines (``--extra-index-url ...``).

    Anything else (a range, a URL, a bare name) is an error: the file is only exact pins.
    """
    pins: list[Pin] = []
    options: list[str] = []
    for number, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        line, _, comment = raw.partition(" #")
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            options.append(line)
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
        if not match:
            raise ValueError(f"{path}:{number}: {line!r} is not an exact pin NAME==VERSION")
        pins.append(Pin(normalize(match.group(1)), match.group(2), comment.strip()))
    names = [p.name for p in pins]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{path}: pinned more than once: {', '.join(duplicates)}")
    return pins, options


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _required_pin(dist: str, requirement: str) -> str | None:
    """The exact version ``dist`` requires of ``requirement`` (``triton==3.7.1; ...``), if it pins one."""
    for req in importlib.metadata.requires(dist) or []:
        match = re.match(rf"{requirement}\s*\(?==\s*([^;,\s)]+)", req)
        if match:
            return match.group(1)
    return None


def stack_problems(tensorrt_version: str) -> list[str]:
    """TensorRT, torch, Triton and ONNX Runtime as the image needs them, or what is wrong."""
    found: list[str] = []
    try:
        import tensorrt

        if tensorrt.__version__ != tensorrt_version:
            found.append(f"TensorRT is {tensorrt.__version__}, the Dockerfile expects {tensorrt_version}: "
                         "update ARG TENSORRT_VERSION together with ARG BASE_IMAGE")
    except Exception as exc:  # ImportError, or libnvinfer failing to load
        found.append(f"tensorrt does not import ({exc}); the base image should provide it")

    import torch

    if not (torch.version.cuda or "").startswith("13."):
        found.append(f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, not CUDA 13")
    triton_wanted = _required_pin("torch", "triton")
    if triton_wanted and _installed("triton") != triton_wanted:
        found.append(f"torch requires triton=={triton_wanted}, installed: {_installed('triton')}; fix the triton pin")

    if _installed("onnxruntime") is not None:
        found.append("the CPU-only onnxruntime package is installed beside onnxruntime-gpu; it shadows the GPU build")
    try:
        import onnxruntime

        providers = onnxruntime.get_available_providers()
        if "CUDAExecutionProvider" not in providers:
            found.append(f"onnxruntime has no CUDAExecutionProvider (providers: {', '.join(providers)})")
    except ImportError as exc:
        found.append(f"onnxruntime does not import ({exc})")
    return found


def pin_problems(pins: list[Pin]) -> list[str]:
    """Each pin that is not installed at exactly its version."""
    found = []
    for pin in pins:
        have = _installed(pin.name)
        if have != pin.version:
            found.append(f"{pin.name}: pinned {pin.version}, installed {have or 'nothing'}")
    return found


def cli_problems() -> list[str]:
    cli = subprocess.run([sys.executable, "-m", "rmsnorm_deploy", "--version"], capture_output=True, text=True)
    if cli.returncode != 0:
        return [f"rmsnorm-deploy --version failed: {cli.stderr.strip()[-500:]}"]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pins", required=True, help="docker/requirements-gpu.txt")
    parser.add_argument("--tensorrt-version", required=True, help="the TensorRT version the base image must ship")
    args = parser.parse_args(argv)
    pins, _ = read_pins(args.pins)
    found = stack_problems(args.tensorrt_version) + pin_problems(pins) + cli_problems()
    for problem in found:
        print(f"check_image: {problem}", file=sys.stderr)
    if found:
        print(f"check_image: {len(found)} problem(s); the image does not match its pins", file=sys.stderr)
        return 1
    print(f"check_image: ok ({len(pins)} pins, TensorRT {args.tensorrt_version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
