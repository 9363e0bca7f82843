"""The JSON file beside every engine: what built it, for what, and with what.

A TensorRT engine only runs on the TensorRT version and the GPU (compute capability) it was
built for; TensorRT notices a mismatch only deep inside deserialization. The sidecar
(``<engine>.json``) records the TensorRT version, the GPU, the optimization profile, whether
our plugin is inside, the hash of the source model and of the engine itself, so a runner can
refuse a foreign or stale engine with a one-line reason *before* deserializing it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from rmsnorm_deploy.errors import UserError

FORMAT = 1
SUFFIX = ".json"


class EngineMismatchError(UserError):
    """An engine built for another TensorRT version or GPU, or whose sidecar does not describe it."""


@dataclasses.dataclass(frozen=True)
class Device:
    """The TensorRT version and the GPU an engine is built for or run on."""

    tensorrt: str
    gpu: str
    compute_capability: str  # "9.0"

    @classmethod
    def current(cls, trt_version: str) -> Device:
        """This process's TensorRT version and CUDA device 0; a one-line error without a GPU."""
        import torch

        if not torch.cuda.is_available():
            raise UserError("TensorRT needs a CUDA GPU and none is visible to torch (torch "
                            f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); run on a GPU machine, "
                            "e.g. in the Docker image with `docker run --gpus all`")
        major, minor = torch.cuda.get_device_capability(0)
        return cls(trt_version, torch.cuda.get_device_name(0), f"{major}.{minor}")


@dataclasses.dataclass
class Sidecar:
    engine_sha256: str
    device: Device
    profiles: dict[str, Any]
    plugin: dict[str, Any] | None
    source_model: dict[str, Any]
    lowering: str = ""
    dtype: str = ""
    norms: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    strongly_typed: bool = True
    built_by: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "engine_sha256": self.engine_sha256,
            "tensorrt": self.device.tensorrt,
            "gpu": self.device.gpu,
            "compute_capability": self.device.compute_capability,
            "strongly_typed": self.strongly_typed,
            "profiles": self.profiles,
            "plugin": self.plugin,
            "source_model": self.source_model,
            "lowering": self.lowering,
            "dtype": self.dtype,
            "norms": self.norms,
            "built_by": self.built_by,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "sidecar") -> Sidecar:
        if not isinstance(data, dict):
            raise EngineMismatchError(f"{where} is not a JSON object; rebuild the engine with `rmsnorm-deploy build`")
        if data.get("format") != FORMAT:
            raise EngineMismatchError(f"{where} has format {data.get('format')!r}, this version reads format {FORMAT}; "
                                      "rebuild the engine with `rmsnorm-deploy build`")
        try:
            return cls(
                engine_sha256=str(data["engine_sha256"]),
                device=Device(str(data["tensorrt"]), str(data["gpu"]), str(data["compute_capability"])),
                profiles=dict(data["profiles"]),
                plugin=data.get("plugin"),
                source_model=dict(data.get("source_model", {})),
                lowering=str(data.get("lowering", "")),
                dtype=str(data.get("dtype", "")),
                norms=list(data.get("norms", [])),
                strongly_typed=bool(data.get("strongly_typed", True)),
                built_by=str(data.get("built_by", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineMismatchError(f"{where} is missing {exc}; rebuild the engine with `rmsnorm-deploy build`") from None


def sidecar_path(engine_path: str | os.PathLike) -> Path:
    p = Path(engine_path)
    return p.with_name(p.name + SUFFIX)


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_sidecar(sidecar: Sidecar, path: str | os.PathLike) -> None:
    """Write ``sidecar`` to ``path`` (the caller owns atomicity: pass a temporary path)."""
    Path(path).write_text(json.dumps(sidecar.to_dict(), indent=1, sort_keys=True) + "\n")


def read_sidecar(engine_path: str | os.PathLike) -> Sidecar:
    """The sidecar of ``engine_path``; a one-line error if the engine or its sidecar is missing or damaged."""
    engine = Path(engine_path)
    if not engine.is_file():
        raise UserError(f"{engine}: no such engine file; build one with `rmsnorm-deploy build MODEL.onnx -o {engine}`")
    side = sidecar_path(engine)
    if not side.is_file():
        raise EngineMismatchError(f"{engine} has no sidecar {side.name}, so its TensorRT version and GPU are unknown; "
                                  "rebuild it with `rmsnorm-deploy build`")
    try:
        data = json.loads(side.read_text())
    except (OSError, ValueError) as exc:
        raise EngineMismatchError(f"{side}: unreadable ({exc}); rebuild the engine with `rmsnorm-deploy build`") from None
    return Sidecar.from_dict(data, where=str(side))


def check_compatible(sidecar: Sidecar, current: Device, *, engine_path: str | os.PathLike = "engine") -> None:
    """Refuse an engine built for another TensorRT version or GPU, naming both sides."""
    built = sidecar.device
    problems = []
    if built.tensorrt != current.tensorrt:
        problems.append(f"TensorRT {built.tensorrt} (this is {current.tensorrt})")
    if built.compute_capability != current.compute_capability:
        problems.append(f"compute capability {built.compute_capability} (this GPU has {current.compute_capability})")
    if built.gpu != current.gpu:
        problems.append(f"GPU {built.gpu!r} (this is {current.gpu!r})")
    if problems:
        raise EngineMismatchError(f"{engine_path} was built for {', '.join(problems)}; engines only run where they "
                                  "were built: rebuild it here with `rmsnorm-deploy build`")


def check_engine_hash(sidecar: Sidecar, engine_path: str | os.PathLike) -> None:
    """Refuse an engine file that is not the one its sidecar describes (replaced or truncated)."""
    actual = sha256_file(engine_path)
    if actual != sidecar.engine_sha256:
        raise EngineMismatchError(f"{engine_path} does not match its sidecar (sha256 {actual[:12]}… vs "
                                  f"{sidecar.engine_sha256[:12]}…): the engine was replaced or damaged; rebuild it")
