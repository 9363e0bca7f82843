"""Reading and writing ONNX files safely.

Reading: a path that is not a file, a file that is not ONNX or is truncated, a node with
fewer or more inputs or outputs than its op takes, and external data that points outside the
model's folder are one-line errors, checked before any runtime opens the file. Writing:
atomically (a temporary file in the same folder, then a rename), never over an existing file
unless ``force``, with external data past 2 GB.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import onnx
from onnx import external_data_helper

from rmsnorm_deploy.errors import ModelFileError, OutputExistsError, one_line


def _read_umask() -> int:
    # os.umask can only be read by setting it; done once, at import, before any thread writes files.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: The user's umask: outputs get the mode any tool of theirs would give (``0o666 & ~umask``),
#: not ``tempfile.mkstemp``'s 0600.
UMASK = _read_umask()
FILE_MODE = 0o666 & ~UMASK
#: The mode of a folder we publish (``tempfile.mkdtemp`` makes them 0700).
DIR_MODE = 0o777 & ~UMASK

#: Protobuf cannot serialize a message of 2 GB or more: past this, weights go to a side file.
EXTERNAL_DATA_THRESHOLD = 2**31 - 2**26


def check_model_file(path: str | os.PathLike) -> Path:
    """Check that ``path`` is a readable ONNX file whose external data stays in its folder."""
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"{p}: no such file; give the path of an .onnx model")
    if not p.is_file():
        raise ModelFileError(f"{p}: not a file; give the path of an .onnx model, not a folder")
    model = _parse(p, load_external=False)
    check_external_data(model, p.parent)
    return p


def load_onnx(path: str | os.PathLike, *, load_external: bool = True) -> onnx.ModelProto:
    """Load an ONNX file after :func:`check_model_file`; external data is loaded only from inside its folder."""
    p = check_model_file(path)
    model = _parse(p, load_external=False)
    if load_external and _has_external_data(model):
        check_external_data(model, p.parent, require_data=True)
        try:
            external_data_helper.load_external_data_for_model(model, str(p.parent))
        except (OSError, ValueError) as exc:
            raise ModelFileError(f"{p}: cannot read its external data ({exc}); keep the data file beside the model") from None
    return model


def _parse(p: Path, *, load_external: bool) -> onnx.ModelProto:
    try:
        model = onnx.load(str(p), load_external_data=load_external)
    except Exception as exc:  # protobuf raises DecodeError, onnx raises ValueError/OSError
        raise ModelFileError(f"{p}: not a readable ONNX model ({type(exc).__name__}: {one_line(exc)}); "
                             "the file may be truncated or not ONNX") from None
    if not model.graph.node and not model.graph.output:
        raise ModelFileError(f"{p}: parses as protobuf but holds no ONNX graph; the file may be truncated or not ONNX")
    if not model.opset_import:
        raise ModelFileError(f"{p}: has no opset import, so it is not a valid ONNX model")
    check_node_arity(model, p)
    return model


#: ONNX Runtime's own norm ops, which have no ONNX schema: the inputs and outputs a node needs at least.
_ORT_OP_ARITY = {"SimplifiedLayerNormalization": (2, 1), "SkipSimplifiedLayerNormalization": (3, 1),
                 "SkipLayerNormalization": (3, 1)}
_UNBOUNDED = 2**31 - 1


@functools.lru_cache(maxsize=None)
def _arity(op_type: str, domain: str, version: int) -> tuple[int, int, int, int] | None:
    """``(min inputs, max inputs, min outputs, max outputs)`` of an op at an opset version (else
    its latest schema), or ``None`` for an op without an ONNX schema that we do not know."""
    for args in ((op_type, version, domain), (op_type, domain)):
        try:
            s = onnx.defs.get_schema(*args)
        except onnx.defs.SchemaError:
            continue
        return s.min_input, s.max_input, s.min_output, s.max_output
    if domain in ("", "ai.onnx", "com.microsoft") and op_type in _ORT_OP_ARITY:
        min_in, min_out = _ORT_OP_ARITY[op_type]
        return min_in, _UNBOUNDED, min_out, _UNBOUNDED
    return None


def check_node_arity(model: onnx.ModelProto, p: Path) -> None:
    """Every node of the graph and of its functions has as many inputs and outputs as its op takes
    (and at least one output): what every reader of a node's first input or output relies on."""
    def check(nodes: Iterable[onnx.NodeProto], opsets: dict[str, int]) -> None:
        for node in nodes:
            label = f"node {node.name or (node.output[0] if node.output else '?')!r} ({node.op_type})"
            if not node.output:
                raise ModelFileError(f"{p}: {label} has no output; the model is damaged: re-export it")
            arity = _arity(node.op_type, node.domain, opsets.get(node.domain or "", opsets.get("ai.onnx", 1)))
            if arity is None:
                continue
            for what, count, low, high in (("inputs", len(node.input), *arity[:2]),
                                           ("outputs", len(node.output), *arity[2:])):
                if not low <= count <= high:
                    takes = f"at least {low}" if high >= _UNBOUNDED else f"{low} to {high}" if low != high else str(low)
                    raise ModelFileError(f"{p}: {label} has {count} {what} but {node.op_type} takes {takes}; the "
                                         "model is damaged: re-export it")

    check(model.graph.node, {o.domain: o.version for o in model.opset_import})
    for function in model.functions:
        check(function.node, {o.domain: o.version for o in function.opset_import})


def _has_external_data(model: onnx.ModelProto) -> bool:
    return any(external_data_helper.uses_external_data(t) for t in external_data_helper._get_all_tensors(model))


def check_external_data(model: onnx.ModelProto, base_dir: Path, *, require_data: bool = False) -> None:
    """Refuse external-data locations that are absolute, lead outside ``base_dir``, hold a NUL byte
    or name something other than a regular file; with ``require_data``, missing files too."""
    base = base_dir.resolve()
    for tensor in external_data_helper._get_all_tensors(model):
        if not external_data_helper.uses_external_data(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if "\x00" in location:
            raise ModelFileError(f"tensor {tensor.name!r}: external data location {location!r} holds a NUL byte; "
                                 "the model is damaged: re-export it")
        if not location or os.path.isabs(location) or Path(location).drive:
            raise ModelFileError(
                f"tensor {tensor.name!r}: external data location {location!r} is not a relative path inside the "
                "model's folder; refusing to read it"
            )
        target = (base / location).resolve()
        if target != base and base not in target.parents:
            raise ModelFileError(
                f"tensor {tensor.name!r}: external data {location!r} points outside the model's folder {base}; "
                "refusing to read it"
            )
        if target.exists() and not target.is_file():  # a FIFO would block the reader forever
            raise ModelFileError(f"tensor {tensor.name!r}: external data {location!r} is not a regular file; keep the "
                                 "model's data file beside it")
        if require_data and not target.exists():
            raise ModelFileError(f"tensor {tensor.name!r}: external data file {location!r} is missing from {base}; keep "
                                 "the model's data file beside it")


def check_graph(path: str | os.PathLike, *, unknown_ops_ok: bool = False) -> None:
    """``onnx.checker`` full check of the file at ``path`` (its external data resolved beside it):
    cycles, undefined tensors, attributes of the wrong type, missing external data; a
    :class:`ModelFileError` with the checker's first line. ``unknown_ops_ok``: an op without an
    ONNX schema (ONNX Runtime's own ops in the default domain) is left for the caller to judge."""
    p = check_model_file(path)
    try:
        onnx.checker.check_model(str(p), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, ValueError, OSError) as exc:
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        if unknown_ops_ok and first.startswith("No Op registered for"):
            return
        raise ModelFileError(f"{p}: not a valid ONNX graph: onnx.checker says: {first[:300]}; fix or re-export the "
                             "model") from None


def ensure_writable(path: str | os.PathLike, *, force: bool) -> Path:
    """Refuse to replace an existing file unless ``force``; create the parent folder."""
    p = Path(path)
    if p.exists() and not force:
        raise OutputExistsError(f"{p} exists; pass --force to replace it or choose another output")
    if p.exists() and p.is_dir():
        raise OutputExistsError(f"{p} is a folder; give a file path for the model")
    return p


def check_folder_writable(folder: str | os.PathLike) -> None:
    """The folder can be created and written in (its nearest existing ancestor is a writable
    folder), checked before any work: a one-line error naming the blocking path."""
    f = Path(folder).absolute()
    for candidate in (f, *f.parents):
        if candidate.exists():
            if not candidate.is_dir():
                raise OutputExistsError(f"cannot write into {f}: {candidate} is a file, not a folder; choose another "
                                        "output")
            if not os.access(candidate, os.W_OK | os.X_OK):
                raise OutputExistsError(f"cannot write into {f}: {candidate} is not writable; choose another output "
                                        "or change its permissions")
            return


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, force: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` in one rename."""
    target = ensure_writable(path, force=force)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        if target.exists() and not force:  # appeared while we were writing
            raise OutputExistsError(f"{target} appeared while writing; pass --force to replace it")
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


# -- a model and the files that vouch for it, published together ---------------------------------
@contextlib.contextmanager
def output_lock(target: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on the folder of ``target`` (``flock`` on the folder itself: no lock
    file is left behind) while a writer stages and publishes its outputs; another writer into
    the same folder waits."""
    folder = Path(target).parent
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no advisory locks; staging still publishes in one step
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def remove_stale(target: str | os.PathLike) -> list[Path]:
    """Remove the hidden leftovers of a killed writer of ``target``: ``.<name>.*.tmp`` files of
    :func:`atomic_path` and ``.<name>.staging-*`` folders of :func:`staging_folder`. Call it
    only under :func:`output_lock`, so that no live writer owns them."""
    import shutil

    t = Path(target)
    removed = []
    for stale in list(t.parent.glob(f".{t.name}.*.tmp")) + list(t.parent.glob(f".{t.name}.staging-*")):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
        removed.append(stale)
    return removed


@contextlib.contextmanager
def staging_folder(target: str | os.PathLike) -> Iterator[Path]:
    """A hidden folder beside ``target`` (``.<name>.staging-*``) where its files are written under
    their final names; removed on exit, whatever happens. :func:`publish` moves them out."""
    import shutil

    t = Path(target)
    t.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{t.name}.staging-", dir=t.parent))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def publish(stage: Path, target: str | os.PathLike, names: list[str], *, force: bool) -> None:
    """Move ``names`` (the model file first in the list) from ``stage`` beside ``target``.

    The model file is what makes an output look finished, so it is removed first and moved in
    last: a writer killed in between leaves no model beside a report of another one.
    """
    t = Path(target)
    model_name, others = names[0], names[1:]
    destinations = [t.parent / n for n in names]
    if not force:
        for dest in destinations:
            if dest.exists():
                raise OutputExistsError(f"{dest} appeared while exporting; pass --force to replace it")
    (t.parent / model_name).unlink(missing_ok=True)
    for name in others:
        if (stage / name).exists():
            os.chmod(stage / name, FILE_MODE)
            os.replace(stage / name, t.parent / name)
    stale_data = t.parent / (model_name + ".data")
    if stale_data.is_file() and f"{model_name}.data" not in names:
        stale_data.unlink()  # a replaced large model's weights; the new model keeps its own inline
    os.chmod(stage / model_name, FILE_MODE)
    os.replace(stage / model_name, t.parent / model_name)


# -- weights streamed into a model file, one tensor at a time ---------------------------------------
#: Field numbers (onnx.proto) of ``ModelProto.graph``, ``GraphProto.initializer``, ``TensorProto.raw_data``.
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9


def _field_head(field: int, length: int) -> bytes:
    """The tag and length of a length-delimited protobuf field."""
    out = bytearray()
    for n in ((field << 3) | 2, length):
        while n > 0x7F:
            out.append((n & 0x7F) | 0x80)
            n >>= 7
        out.append(n)
    return bytes(out)


def _streamable(tensor: Any) -> bool:
    """A tensor whose little-endian bytes ``tofile`` writes as they are (not strings, not external data)."""
    import onnx_ir as ir

    return not isinstance(tensor, (ir.StringTensor, ir.ExternalTensor, ir.serde.TensorProtoTensor))


def write_with_weights(model: onnx.ModelProto, weights: Iterable[Any], path: str | os.PathLike) -> int:
    """Write ``model`` to ``path``, then each of ``weights`` (onnx_ir tensors, named) as an
    initializer of its graph, straight from the tensor's memory; returns the bytes written.

    Protobuf parses a message field that occurs twice as the two merged, so each weight is
    appended as ``graph { initializer { ... } }`` after the serialized model: the file reads
    as the model with the weights in it, while the writer never holds a serialized copy of
    them (``onnx.save_model`` of a model with its weights holds the message and its bytes:
    twice the weights). Files past protobuf's 2 GB limit need external data instead.
    """
    import onnx_ir as ir

    with open(path, "wb") as f:
        f.write(model.SerializeToString())
        for tensor in weights:
            if not _streamable(tensor):
                body = ir.serde.serialize_tensor(tensor).SerializeToString()
                initializer = _field_head(_GRAPH_INITIALIZER, len(body))
                f.write(_field_head(_MODEL_GRAPH, len(initializer) + len(body)) + initializer + body)
                continue
            header = onnx.TensorProto(name=tensor.name, data_type=tensor.dtype.value, dims=tensor.shape.numpy())
            if tensor.doc_string:
                header.doc_string = tensor.doc_string
            for key, value in tensor.metadata_props.items():
                header.metadata_props.add(key=key, value=value)
            head = header.SerializeToString() + _field_head(_TENSOR_RAW_DATA, tensor.nbytes)
            body_length = len(head) + tensor.nbytes
            initializer = _field_head(_GRAPH_INITIALIZER, body_length)
            f.write(_field_head(_MODEL_GRAPH, len(initializer) + body_length) + initializer + head)
            start = f.tell()
            tensor.tofile(f)
            if f.tell() - start != tensor.nbytes:
                raise ValueError(f"weight {tensor.name!r}: wrote {f.tell() - start} bytes for its {tensor.nbytes}")
        size = f.tell()
    if size >= EXTERNAL_DATA_THRESHOLD:
        raise ValueError(f"{path}: {size} bytes is past protobuf's 2 GB limit; write the weights as external data")
    return size


def save_onnx(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    *,
    force: bool = False,
    staged_data: Path | None = None,
    weights: Sequence[Any] = (),
    check: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``model`` to ``path`` atomically; weights go to ``<name>.data`` beside it past 2 GB.

    ``check``: called with the path of the written temporary file (its external data in
    place) before it replaces ``path``; if it raises, nothing is replaced. Checking the file
    rather than the in-memory model spares a serialized copy of the weights.

    ``weights``: onnx_ir tensors written into the file as initializers of ``model``'s graph, one
    at a time from their own memory (:func:`write_with_weights`); the file must stay under 2 GB.

    ``staged_data``: a file in the target's folder that already holds the model's external
    data (the export pipeline writes weights there straight from torch, so they are never
    copied into a protobuf); the model's references to it are renamed to ``<name>.data`` and
    the file moves into place together with the model. A stale ``<name>.data`` left by a
    replaced large model is removed when the new model keeps its weights inline.
    """
    target = Path(path)
    data_name = target.name + ".data"
    data_path = target.parent / data_name
    if staged_data is not None:
        ensure_writable(data_path, force=force)
        with atomic_path(target, force=force) as tmp:
            if check is not None:  # checked while it still points at the staged data
                onnx.save_model(model, str(tmp))
                check(tmp)
            _set_external_location(model, staged_data.name, data_name)
            onnx.save_model(model, str(tmp))
            os.chmod(staged_data, FILE_MODE)
            os.replace(staged_data, data_path)
        return target
    if weights:
        with atomic_path(target, force=force) as tmp:
            write_with_weights(model, weights, tmp)
            if check is not None:
                check(tmp)
        if force and data_path.is_file() and not _references(model, data_name):
            data_path.unlink()
        return target
    large = model.ByteSize() >= EXTERNAL_DATA_THRESHOLD if _small_enough_to_size(model) else True
    if large:
        ensure_writable(data_path, force=force)
    with atomic_path(target, force=force) as tmp:
        if large:
            with atomic_path(data_path, force=force) as tmp_data:
                onnx.save_model(
                    model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=tmp_data.name, size_threshold=1024,
                )
                if check is not None:
                    check(tmp)
                # The model names its data file; point it at the final name before the renames.
                _rename_external_location(tmp, tmp_data.name, data_name)
        else:
            onnx.save_model(model, str(tmp))
            if check is not None:
                check(tmp)
    if not large and force and data_path.is_file() and not _references(model, data_name):
        data_path.unlink()
    return target


def _references(model: onnx.ModelProto, location: str) -> bool:
    for tensor in external_data_helper._get_all_tensors(model):
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value == location:
                return True
    return False


def _set_external_location(model: onnx.ModelProto, old: str, new: str) -> None:
    for tensor in external_data_helper._get_all_tensors(model):
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value == old:
                entry.value = new


def _small_enough_to_size(model: onnx.ModelProto) -> bool:
    try:
        model.ByteSize()
        return True
    except Exception:  # pragma: no cover - protobuf refuses to size messages past 2 GB on some builds
        return False


def _rename_external_location(model_path: Path, old: str, new: str) -> None:
    model = onnx.load(str(model_path), load_external_data=False)
    _set_external_location(model, old, new)
    onnx.save_model(model, str(model_path))
