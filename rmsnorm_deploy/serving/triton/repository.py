"""``triton-repo``: a model repository for the standalone Triton Inference Server (the NGC image).

The model runs in Triton's native backends, with no Python in the serving path: ``onnxruntime``
for an ``.onnx`` model, ``tensorrt`` for an engine built by ``rmsnorm-deploy build`` (its JSON
sidecar names the source model, which gives the engine's inputs and outputs, and the profile,
which bounds the batch). Layout::

    REPO/<name>/config.pbtxt
    REPO/<name>/1/model.onnx (+ its external data)   or   REPO/<name>/1/model.plan (+ model.plan.json)

``config.pbtxt`` is derived from the graph's signature (``serving.kserve.signature``):

- stateless graphs: inputs and outputs with dynamic dims as -1, the batch dim owned by Triton
  (``max_batch_size``) and ``dynamic_batching``;
- KV-cache graphs (``past_key_values.{i}.key/value`` -> ``present.{i}.key/value``): the cache
  stays inside Triton as *implicit state* of the sequence batcher (each step's ``present`` is the
  next step's ``past``; a new sequence starts from an empty cache, ``initial_state`` with past
  length 0 and ``zero_data``), so a client sends only ``input_ids``, ``attention_mask`` and
  ``position_ids`` with a sequence id. One sequence per execution (``max_batch_size: 1``,
  ``direct`` strategy): sequences at different past lengths cannot share a batch of one
  tensor. Concurrency comes from instances (``--instances``).

Every config is parsed back into Triton's own ``ModelConfig`` protobuf (tritonclient ships
``model_config_pb2``) before anything is written, and the repository appears in one rename.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rmsnorm_deploy.errors import ModelFileError, OutputExistsError, UserError, one_line
from rmsnorm_deploy.graph.onnx_file import DIR_MODE, check_folder_writable, load_onnx
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.serving.triton.process import check_model_name
from rmsnorm_deploy.serving.kserve.signature import Signature, TensorSpec, model_path, read_signature
from rmsnorm_deploy.tensorrt.sidecar import check_engine_hash, read_sidecar, sidecar_path

KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}
#: the dynamic batcher may hold a request this long to fill a batch
QUEUE_DELAY_US = 500
#: a KV-cache sequence idle this long is ended and its state freed
SEQUENCE_IDLE_US = 60_000_000


@dataclasses.dataclass(frozen=True)
class RepoOptions:
    model_name: str = "model"
    max_batch: int | None = None
    instances: int = 1
    kind: str = "cpu"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What goes under ``1/``: the file, its backend, and files that must travel with it."""

    path: Path
    backend: str  # onnxruntime | tensorrt
    filename: str  # model.onnx | model.plan
    extra: tuple[tuple[Path, str], ...]  # (source file, name under 1/)
    signature: Signature


def _dims(dims: list[int]) -> str:
    return "[ " + ", ".join(str(d) for d in dims) + " ]"


def _tensor_block(t: TensorSpec, batched: bool) -> str:
    return f'  {{\n    name: "{t.name}"\n    data_type: {t.triton_type}\n    dims: {_dims(t.dims(batched=batched))}\n  }}'


def config_text(source: ModelSource, options: RepoOptions) -> str:
    """The ``config.pbtxt`` text for ``source`` (protobuf text format of Triton's ``ModelConfig``)."""
    sig = source.signature
    if options.instances < 1:
        raise UserError(f"--instances {options.instances}: give at least 1")
    if options.kind not in KINDS:
        raise UserError(f"--kind {options.kind!r}: choose from {', '.join(KINDS)}")
    if source.backend == "tensorrt" and options.kind != "gpu":
        raise UserError("a TensorRT engine runs on a GPU only: use --kind gpu")
    lines = [f'name: "{options.model_name}"', f'backend: "{source.backend}"']
    if sig.is_kv_cache:
        batched = True  # Triton owns a batch dim of 1: one sequence per execution
        max_batch = 1
    else:
        batched = sig.batched
        max_batch = sig.max_batch if batched else 0
    lines.append(f"max_batch_size: {max_batch}")
    lines.append(f'default_model_filename: "{source.filename}"')
    inputs = sig.stateless_inputs()
    outputs = sig.stateless_outputs()
    lines.append("input [\n" + ",\n".join(_tensor_block(t, batched) for t in inputs) + "\n]")
    lines.append("output [\n" + ",\n".join(_tensor_block(t, batched) for t in outputs) + "\n]")
    if sig.is_kv_cache:
        lines.append(_sequence_batching(sig))
    elif batched:
        lines.append(f"dynamic_batching {{\n  max_queue_delay_microseconds: {QUEUE_DELAY_US}\n}}")
    lines.append(f"instance_group [\n  {{\n    count: {options.instances}\n    kind: {KINDS[options.kind]}\n  }}\n]")
    return "\n".join(lines) + "\n"


def _sequence_batching(sig: Signature) -> str:
    states = []
    for past, present in sig.cache:
        p = sig.tensor(past)
        if len(p.shape) != 4:
            raise ModelFileError(f"{past} has shape {list(p.shape)}; the KV-cache convention is [batch, kv_heads, past, "
                                 "head_dim]")
        heads, head_dim = p.shape[1], p.shape[3]
        if not isinstance(heads, int) or not isinstance(head_dim, int):
            raise ModelFileError(f"{past} has dynamic kv_heads or head_dim ({list(p.shape)}); Triton's initial state "
                                 "needs them fixed: export with static head dims")
        states.append(
            "    {\n"
            f'      input_name: "{past}"\n'
            f'      output_name: "{present}"\n'
            f"      data_type: {p.triton_type}\n"
            f"      dims: {_dims([heads, -1, head_dim])}\n"
            "      initial_state {\n"
            f"        data_type: {p.triton_type}\n"
            f"        dims: {_dims([heads, 0, head_dim])}\n"
            "        zero_data: true\n"
            f'        name: "empty cache"\n'
            "      }\n"
            "    }"
        )
    return ("sequence_batching {\n"
            f"  max_sequence_idle_microseconds: {SEQUENCE_IDLE_US}\n"
            "  direct { }\n"
            "  state [\n" + ",\n".join(states) + "\n  ]\n}")


def parse_config(text: str) -> Any:
    """Parse ``text`` into Triton's ``ModelConfig`` message; a one-line error naming the problem."""

    pb2 = require("tritonclient.grpc.model_config_pb2", "checking a Triton model config")
    text_format = require("google.protobuf.text_format", "checking a Triton model config")
    message = pb2.ModelConfig()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as exc:
        raise UserError(f"the generated config.pbtxt does not parse as Triton's ModelConfig: {one_line(exc)}") from None
    return message


def check_config(message: Any, source: ModelSource) -> None:
    """What Triton checks at load time that a parse does not: every model tensor accounted for once."""
    sig = source.signature
    named = [i.name for i in message.input] + [o.name for o in message.output]
    states = [(s.input_name, s.output_name) for s in message.sequence_batching.state]
    used = named + [n for pair in states for n in pair]
    if len(set(used)) != len(used):
        raise UserError(f"config names a tensor twice: {sorted(n for n in used if used.count(n) > 1)}")
    expected = {t.name for t in sig.inputs + sig.outputs}
    if set(used) != expected:
        raise UserError(f"config does not match the model: missing {sorted(expected - set(used))}, unknown "
                        f"{sorted(set(used) - expected)}")
    if states and message.dynamic_batching.ByteSize():
        raise UserError("a stateful (KV-cache) model cannot use the dynamic batcher")


def model_source(path: str | os.PathLike, options: RepoOptions) -> ModelSource:
    """The ONNX model (file or export folder) or TensorRT engine at ``path``, with its signature."""
    p = Path(path)
    if p.is_file() and p.suffix in (".engine", ".plan"):
        return _engine_source(p, options)

    onnx_path = model_path(p)
    signature = read_signature(onnx_path, max_batch=options.max_batch)
    model = load_onnx(onnx_path, load_external=False)  # checks external data stays inside its folder
    extra = tuple((onnx_path.parent / loc, loc) for loc in sorted(_external_locations(model)))
    for src, _ in extra:
        if not src.is_file():
            raise ModelFileError(f"{onnx_path}: its external data {src.name} is missing; keep it beside the model")
    return ModelSource(onnx_path, "onnxruntime", "model.onnx", extra, signature)


def _external_locations(model: Any) -> set[str]:
    from onnx import external_data_helper

    found = set()
    for tensor in external_data_helper._get_all_tensors(model):
        if external_data_helper.uses_external_data(tensor):
            found.update(e.value for e in tensor.external_data if e.key == "location")
    return found


def _engine_source(engine: Path, options: RepoOptions) -> ModelSource:

    sidecar = read_sidecar(engine)
    check_engine_hash(sidecar, engine)
    source = Path(str(sidecar.source_model.get("path", "")))
    if not source.is_file():
        raise ModelFileError(f"{engine}: its source model {source} (from the sidecar) is gone; the repository needs it "
                             "for the engine's inputs and outputs: keep it, or rebuild the engine")
    profile_max = _profile_batch_max(sidecar.profiles)
    signature = read_signature(source, max_batch=options.max_batch if options.max_batch is not None else profile_max)
    if signature.batched and profile_max and signature.max_batch > profile_max:
        raise UserError(f"--max-batch {signature.max_batch} exceeds the engine's profile ({signature.batch_dim} up to "
                        f"{profile_max}); rebuild the engine with a larger profile")
    return ModelSource(engine, "tensorrt", "model.plan", ((sidecar_path(engine), "model.plan.json"),), signature)


def _profile_batch_max(profiles: dict[str, Any]) -> int | None:
    dims = profiles.get("dims", {}) if isinstance(profiles, dict) else {}
    entry = dims.get("batch") if isinstance(dims, dict) else None
    try:
        return int(entry["max"]) if entry else None
    except (KeyError, TypeError, ValueError):
        return None


def write_repository(model: str | os.PathLike, out: str | os.PathLike, options: RepoOptions, *,
                     force: bool = False) -> Path:
    """Write ``out/<name>/`` (config and ``1/``) in one rename; an existing one (or a link of that
    name: the link is replaced, not what it points to) only with ``force``."""

    check_model_name(options.model_name)
    source = model_source(model, options)
    text = config_text(source, options)
    check_config(parse_config(text), source)
    repo = Path(out)
    check_folder_writable(repo)
    target = repo / options.model_name
    if (target.exists() or target.is_symlink()) and not force:
        raise OutputExistsError(f"{target} exists; pass --force to replace it or choose another -o/--model-name")
    try:
        repo.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{options.model_name}.", dir=repo))
    except OSError as exc:
        raise OutputExistsError(f"cannot create the repository folder {repo}: {exc.strerror or one_line(exc)}; "
                                "choose another -o") from None
    old: Path | None = None
    try:
        os.chmod(staging, DIR_MODE)  # the user's umask, as any folder of theirs (mkdtemp makes it 0700)
        version = staging / "1"
        version.mkdir()
        shutil.copyfile(source.path, version / source.filename)
        for src, name in source.extra:
            (version / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, version / name)
        (staging / "config.pbtxt").write_text(text)
        if target.exists() or target.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{options.model_name}.old.", dir=repo))
            os.rmdir(old)
            os.replace(target, old)
        try:
            os.replace(staging, target)
        except OSError:
            if old is not None:
                os.replace(old, target)  # put the previous model back
            raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        if old is not None:
            _remove(old)
    return target


def _remove(path: Path) -> None:
    """Remove a replaced model: a link itself (never what it points to), or a folder tree."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)
