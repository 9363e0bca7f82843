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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from rmsnorm_deploy.errors import UserError, one_line
from rmsnorm_deploy.optional import require

#: The four bytes every GGUF file starts with.
GGUF_MAGIC = b"GGUF"
#: The file written last into a converted folder: what it was converted from.
SOURCE_RECORD = "gguf_source.json"
#: The environment variable that moves the cache (default: ``$XDG_CACHE_HOME/rmsnorm-deploy`` or ``~/.cache/...``).
CACHE_ENV = "RMSNORM_DEPLOY_CACHE"


class GGUFError(UserError):
    """A GGUF file that cannot be read or converted (exit 2, one line)."""


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
def _locked(lock_path: Path) -> Iterator[None]:
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
    with _locked(root / f"{sha[:16]}.lock"):
        if _complete(target, sha, loader):
            return target
        if target.exists():
            shutil.rmtree(target)  # a folder from another file under the same name prefix, or damaged
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            _convert(path, tmp)
            (tmp / SOURCE_RECORD).write_text(json.dumps({"gguf": str(path.resolve()), "sha256": sha,
                                                               "transformers": loader}, indent=1))
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


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


def _convert(path: Path, out: Path) -> None:
    """Dequantize ``path`` through transformers' GGUF loader and save it as a Hugging Face folder in ``out``."""
    require("gguf", f"exporting the GGUF file {path.name}")
    require("accelerate", f"exporting the GGUF file {path.name}")
    transformers = require("transformers", f"exporting the GGUF file {path.name}")
    import torch

    folder, name = str(path.parent), path.name
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                                  local_files_only=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError, NotImplementedError, RuntimeError, OSError, TypeError) as exc:
        raise GGUFError(f"{path}: transformers' GGUF loader cannot read it ({one_line(exc)}); convert the checkpoint "
                        "with a GGUF architecture and tensor types transformers supports, or give its Hugging Face "
                        "folder") from None
    # the loader marks the model as quantized; its weights are plain float32 now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
