"""GGUF checkpoints in: a ``.gguf`` file as the Hugging Face folder transformers' GGUF loader reads from it.

llama.cpp and Ollama users hold GGUF files, not safetensors. transformers reads a GGUF file
(``from_pretrained(dir, gguf_file=...)``, needing ``gguf`` and ``accelerate``) and dequantizes
every tensor to float32: those float32 weights *are* the checkpoint an export is held to. The
folder :func:`hf_folder_from_gguf` writes holds them as safetensors with the config, the
generation config, the tokenizer and its chat template the loader rebuilt from the GGUF metadata,
so every path that takes a Hugging Face folder (plain and KV-cache exports, ``generate --prompt``,
``serve --openai-port``) takes a GGUF file too.

Converted folders are cached by the file's SHA-256 (``gguf_cache_dir``), written into a temporary
folder and renamed into place, so an interrupted conversion never leaves a folder that looks
complete, and two processes converting the same file wait for each other instead of doing the
work twice.

MODEL of ``export`` names a GGUF checkpoint when it is a ``.gguf`` file, or a folder with no
config.json holding exactly one (:func:`named_gguf`, which reads nothing but names); the model's
metadata ``source`` then records the file itself (path, SHA-256, architecture: :class:`GGUFCheckpoint`),
not the cache folder, and ``validate`` converts that file again, held to the same SHA-256.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from rmsnorm_deploy.errors import UserError, one_line
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.resources import check_memory

#: The four bytes every GGUF file starts with.
GGUF_MAGIC = b"GGUF"
#: The file written last into a converted folder: what it was converted from.
SOURCE_RECORD = "gguf_source.json"
#: The environment variable that moves the cache (default: ``$XDG_CACHE_HOME/rmsnorm-deploy`` or ``~/.cache/...``).
CACHE_ENV = "RMSNORM_DEPLOY_CACHE"


class GGUFError(UserError):
    """A GGUF file that cannot be read or converted (exit 2, one line)."""


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file and the Hugging Face folder it was converted into."""

    file: Path  # resolved
    sha256: str
    architecture: str  # the file's own ``general.architecture`` (llama, qwen2, gemma3, ...)
    folder: Path  # the cached conversion: float32 safetensors, config, tokenizer

    @property
    def name(self) -> str:
        """The default model name: the file's stem."""
        return self.file.stem

    def source(self, model_type: str) -> dict[str, Any]:
        """The metadata ``source`` of a model exported from this file (``model_type``: transformers')."""
        return {"kind": "gguf", "path": str(self.file), "sha256": self.sha256, "architecture": self.architecture,
                "model_type": model_type}


def named_gguf(ref: str | os.PathLike) -> Path | None:
    """The GGUF file MODEL names, or None when it names none; reads names only, nothing is converted.

    A file named ``*.gguf`` or starting with the GGUF magic is one (a ``.gguf`` that is not a GGUF
    is refused when it is converted, naming why). A folder with config.json is a Hugging Face folder;
    one without it names the single ``*.gguf`` inside, and several are refused: which one was meant
    cannot be known.
    """
    path = Path(ref)
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        return path  # a missing one too: its conversion says so
    if path.is_file():
        return path if is_gguf(path) else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.glob("*") if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        raise GGUFError(f"{path}: holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); give the "
                        f"file to export, e.g. {path / found[0].name}")
    return found[0] if found else None


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            return p.is_file() and f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def cache_root() -> Path:
    """Where converted checkpoints are kept."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rmsnorm-deploy"


def gguf_cache_dir() -> Path:
    return cache_root() / "gguf"


def file_sha256(path: Path, *, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive lock on ``lock_path`` (POSIX ``flock``; elsewhere no lock, the rename still makes it safe)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def hf_folder_from_gguf(gguf_file: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """The Hugging Face folder of ``gguf_file`` (float32 safetensors, config, tokenizer, chat template),
    converted once and cached by the file's SHA-256 under ``cache_dir`` (default :func:`gguf_cache_dir`)."""
    return convert_gguf(gguf_file, cache_dir=cache_dir).folder


def convert_gguf(gguf_file: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> GGUFCheckpoint:
    """``gguf_file`` and its converted folder (:func:`hf_folder_from_gguf`), converted on first use."""
    path = Path(gguf_file)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file; give a .gguf file or a folder holding one")
    if not is_gguf(path):
        raise GGUFError(f"{path}: not a GGUF file (it does not start with the GGUF magic); give a llama.cpp/Ollama "
                        ".gguf file")
    sha = file_sha256(path)
    loader = _loader_version()
    root = Path(cache_dir) if cache_dir is not None else gguf_cache_dir()
    target = root / f"{sha[:16]}-{_safe_stem(path)}"
    with file_lock(root / f"{sha[:16]}.lock"):
        if _complete(target, sha, loader):
            return GGUFCheckpoint(path.resolve(), sha, _recorded_architecture(target, path), target)
        if target.exists():
            shutil.rmtree(target)  # a folder from another file under the same name prefix, or damaged
        root.mkdir(parents=True, exist_ok=True)
        architecture, tensor_types = inspect_gguf(path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            _convert(path, tmp, architecture, tensor_types)
            _write_record(tmp, {"gguf": str(path.resolve()), "sha256": sha, "transformers": loader,
                                "architecture": architecture})
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return GGUFCheckpoint(path.resolve(), sha, architecture, target)


def inspect_gguf(path: Path) -> tuple[str, list[str]]:
    """The file's architecture and tensor types (``Q4_1``, ``F32``, ...), its header and tensor table
    read whole (``gguf.GGUFReader``): a truncated or damaged file is refused here, before transformers
    reads it; and the memory the float32 conversion will hold is checked against the budget."""
    require("gguf", f"exporting the GGUF file {path.name}")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        field = reader.fields.get("general.architecture")
        architecture = field.contents() if field is not None else None
        elements = sum(int(t.n_elements) for t in reader.tensors)
        tensor_types = sorted({t.tensor_type.name for t in reader.tensors})
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError, ... on a damaged file
        raise GGUFError(f"{path}: damaged or truncated GGUF file ({type(exc).__name__}: {one_line(exc)}); download "
                        "or convert it again") from None
    if not isinstance(architecture, str) or not architecture:
        raise GGUFError(f"{path}: damaged GGUF file: it has no general.architecture; convert it again with llama.cpp")
    check_memory(elements * 4, f"{path}: {elements:,} weights dequantized to float32",
                 "convert it on a machine with more memory")
    return architecture, tensor_types


def _write_record(folder: Path, record: dict[str, Any]) -> None:
    tmp = folder / f".{SOURCE_RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, folder / SOURCE_RECORD)


def _recorded_architecture(folder: Path, path: Path) -> str:
    """The architecture a complete folder's record names; a record written before it was kept gets it now."""
    record = json.loads((folder / SOURCE_RECORD).read_text())
    if not isinstance(record.get("architecture"), str):
        record["architecture"] = inspect_gguf(path)[0]
        _write_record(folder, record)
    return record["architecture"]


def _safe_stem(path: Path) -> str:
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem)
    return stem[:64] or "model"


def _loader_version() -> str:
    """The version of transformers, whose loader's dequantization a cached folder holds."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return ""


def _complete(folder: Path, sha: str, loader: str) -> bool:
    """Whether ``folder`` was converted from the file ``sha`` by this version of the loader."""
    try:
        record = json.loads((folder / SOURCE_RECORD).read_text())
        return record.get("sha256") == sha and record.get("transformers") == loader
    except (OSError, ValueError, AttributeError):
        return False


def _convert(path: Path, out: Path, architecture: str, tensor_types: list[str]) -> None:
    """Dequantize ``path`` through transformers' GGUF loader and save it as a Hugging Face folder in ``out``.
    The loader is the authority on what it reads: an architecture or a tensor type it cannot
    dequantize is refused with its own reason, and the file's tensor types."""
    require("gguf", f"exporting the GGUF file {path.name}")
    require("accelerate", f"exporting the GGUF file {path.name}")
    transformers = require("transformers", f"exporting the GGUF file {path.name}")
    import torch

    folder, name = str(path.parent), path.name
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                                  local_files_only=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError, NotImplementedError, RuntimeError, OSError, TypeError, AttributeError) as exc:
        raise GGUFError(f"{path}: transformers {_loader_version()}'s GGUF loader cannot read this {architecture!r} "
                        f"file with tensor types {', '.join(tensor_types)} ({one_line(exc)}); convert the "
                        "checkpoint with an architecture and tensor types transformers supports, or give its Hugging "
                        "Face folder") from None
    # the loader marks the model as quantized; its weights are plain float32 now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))

