"""What a KServe v2 inference request must be before Triton sees it: one check for HTTP and gRPC.

Triton 2.51 (the one in nvidia-pytriton 0.7) trusts the shape a request claims: a JSON request
claiming ``[4294967296]`` elements aborts its HTTP front end (``Signal (6)``, ``[2^62]``:
``Signal (11)``), and over gRPC a shape whose byte size wraps around 2^64 (``[2^61]`` INT64 with
no data) passes its size check and kills the Python-backend stub, after which every request to
that model fails. So the fronts (``serving.kserve.front``) check every request here, in Python integers
that cannot overflow, and forward only what passes:

- each input's name, datatype and rank against the served model, fixed dims exactly, the batch
  dim within ``max_batch``, named dims within the model's metadata range (``dims``: an empty
  sequence is below the minimum of 1);
- the elements the shape claims equal the elements (JSON ``data``, gRPC typed contents) or the
  bytes (binary extension, gRPC raw contents) the request carries;
- JSON values of the right kind and range for the datatype, nesting no deeper than a shape;
- no shared-memory parameters (this server registers no regions);
- the request parameters Triton reads itself (``sequence_id``, ``priority``, ...) of the kind
  Triton parses: Triton 2.51 answers ``"sequence_id": -1`` with a 500, as if the server failed.

A refusal is :class:`Refused`: an HTTP status and one line naming the problem and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable, Sequence

import numpy as np

from rmsnorm_deploy.serving.asgi.body import BodyRefused
from rmsnorm_deploy.serving.kserve.signature import numpy_dtype_of_kserve

#: the largest JSON part of a request: parsing it builds Python objects (about 50 bytes a number), so
#: a large tensor comes as binary data (``Inference-Header-Content-Length``) instead
MAX_JSON_BYTES = 8 << 20
#: JSON nesting allowed outside ``data`` (an object of inputs, each with ``parameters``)
MAX_JSON_DEPTH = 8
#: parameters that point at shared memory, which this server never registers
SHARED_MEMORY_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
#: the request-level parameters Triton parses itself, and what each must be
REQUEST_PARAMETERS = {"sequence_id": "an integer from 0 to 2^64-1 or a string",
                      "sequence_start": "true or false", "sequence_end": "true or false",
                      "priority": "an integer from 0 to 2^64-1",
                      "timeout": "an integer from 0 to 2^64-1 (microseconds)",
                      "binary_data_output": "true or false"}
_INT_RANGES = {"INT8": 8, "INT16": 16, "INT32": 32, "INT64": 64}
_UINT_RANGES = {"UINT8": 8, "UINT16": 16, "UINT32": 32, "UINT64": 64}


class Refused(BodyRefused):
    """A request that is the client's fault: ``status`` (4xx) and a one-line ``message``."""


@dataclasses.dataclass(frozen=True)
class ExpectedInput:
    """One input of a served model as a client sends it: the batch dim included when the model is
    batched; dims are sizes or names (dynamic)."""

    name: str
    datatype: str  # KServe: INT64, FP32, ...
    shape: tuple[int | str, ...]


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """A model name on the server and what its requests must look like."""

    name: str
    inputs: tuple[ExpectedInput, ...]
    #: largest batch (the leading dim) for a batched model; 0: unbatched
    max_batch: int = 0
    #: ``{dim name: (min, max)}`` from the model's metadata; other named dims are unbounded
    ranges: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    #: for a streaming twin (decoupled: answered over a gRPC stream only), the model of its whole answers
    stream_of: str = ""

    def describe(self) -> str:
        return ", ".join(f"{i.name} {i.datatype} [{', '.join(str(d) for d in i.shape)}]" for i in self.inputs)

    def expected(self, name: str) -> ExpectedInput:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise Refused(f"model {self.name!r} has no input {name!r}; it takes {self.describe()}")


def stream_only_refusal(model: ServedModel) -> str:
    """Why a streaming twin takes no unary ``infer`` (Triton answers one with HTTP 501 / UNIMPLEMENTED)."""
    whole = model.stream_of
    return (f"model {model.name!r} streams its tokens over a gRPC stream only (ModelStreamInfer); for the whole "
            f"answer in one response, infer with model {whole!r} (HTTP: POST /v2/models/{whole}/infer)")


@dataclasses.dataclass(frozen=True)
class ClaimedInput:
    """An input as a request states it, and what it carries: ``elements`` (JSON data, typed
    contents) or ``data_bytes`` (binary extension, raw contents); ``None`` where not given."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    elements: int | None = None
    data_bytes: int | None = None


def element_count(shape: Iterable[int]) -> int:
    """The elements a shape holds, exactly (Python integers: no overflow)."""
    return math.prod(shape)


def check_shape(model: ServedModel, spec: ExpectedInput, shape: Sequence[int]) -> None:
    """``shape`` against ``spec``: rank, fixed dims, the batch limit and the metadata's ranges."""
    want = "[" + ", ".join(str(d) for d in spec.shape) + "]"
    if len(shape) != len(spec.shape):
        raise Refused(f"input {spec.name!r} has shape {list(shape)} but model {model.name!r} takes {want} "
                      f"(rank {len(spec.shape)})")
    for index, (size, dim) in enumerate(zip(shape, spec.shape)):
        if index == 0 and model.max_batch:
            if not 1 <= size <= model.max_batch:
                raise Refused(f"input {spec.name!r} has a batch of {size} but model {model.name!r} takes 1 to "
                              f"{model.max_batch} rows; split the request")
        elif isinstance(dim, int):
            if size != dim:
                raise Refused(f"input {spec.name!r} has shape {list(shape)} but model {model.name!r} takes {want}")
        elif dim in model.ranges:
            low, high = model.ranges[dim]
            if not low <= size <= high:
                raise Refused(f"input {spec.name!r} has {dim} {size} but model {model.name!r} takes {dim} from "
                              f"{low} to {high}")


def check_inputs(model: ServedModel, inputs: Sequence[ClaimedInput]) -> None:
    """Every claimed input against the model and against the data it carries (see the module)."""
    if not inputs:
        raise Refused(f"the request has no inputs; model {model.name!r} takes {model.describe()}")
    seen: set[str] = set()
    for claimed in inputs:
        spec = model.expected(claimed.name)
        if claimed.name in seen:
            raise Refused(f"input {claimed.name!r} is given twice; give each input once")
        seen.add(claimed.name)
        if claimed.datatype != spec.datatype:
            raise Refused(f"input {claimed.name!r} has datatype {claimed.datatype!r} but model {model.name!r} "
                          f"takes {spec.datatype}")
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in claimed.shape):
            raise Refused(f"input {claimed.name!r} has shape {list(claimed.shape)}; a shape is a list of "
                          "non-negative integers")
        check_shape(model, spec, claimed.shape)
        _check_carried(claimed)
    # a missing input is left to Triton and the model, which name it; nothing is claimed for it
    if model.max_batch:
        batches = {c.name: c.shape[0] for c in inputs}
        if len(set(batches.values())) > 1:
            raise Refused(f"inputs have different batch sizes {batches}; give every input the same first dim")


def _check_carried(claimed: ClaimedInput) -> None:
    count = element_count(claimed.shape)
    if claimed.elements is not None and claimed.elements != count:
        raise Refused(f"input {claimed.name!r} claims shape {list(claimed.shape)} ({count} elements) but carries "
                      f"{claimed.elements}; give a shape that matches the data")
    if claimed.data_bytes is not None:
        size = count * numpy_dtype_of_kserve(claimed.datatype).itemsize
        if claimed.data_bytes != size:
            raise Refused(f"input {claimed.name!r} claims shape {list(claimed.shape)} ({size} bytes of "
                          f"{claimed.datatype}) but carries {claimed.data_bytes} bytes; give a shape that matches "
                          "the data")
    if claimed.elements is None and claimed.data_bytes is None:
        raise Refused(f"input {claimed.name!r} carries no data; give 'data' or binary data")


# -- KServe v2 over HTTP: the JSON request and the binary data extension ----------------------------

def parse_http_request(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    """The JSON request and the binary data after it (``Inference-Header-Content-Length``)."""
    size = len(body)
    if header_length is not None:
        if not header_length.strip().isdigit() or int(header_length) > size:
            raise Refused(f"Inference-Header-Content-Length {header_length[:40]!r} is not a byte count within the "
                          f"{size}-byte body")
        size = int(header_length)
    if size > MAX_JSON_BYTES:
        raise Refused(f"the request's JSON is {size} bytes, over {MAX_JSON_BYTES}; send large tensors as binary data "
                      "(the binary data extension: Inference-Header-Content-Length)", 413)
    try:
        request = json.loads(body[:size])
    except RecursionError:
        raise Refused("the request's JSON is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, a number beyond Python's digit limit
        raise Refused(f"the request is not valid JSON ({' '.join(str(exc).split())[:200]})") from None
    if not isinstance(request, dict):
        raise Refused("the request must be a JSON object with 'inputs'")
    return request, body[size:]


def claimed_http_inputs(request: dict[str, Any], binary: bytes) -> list[ClaimedInput]:
    """The inputs of a JSON request (checked for form, nesting and values on the way), binary
    sizes summed against the bytes after the JSON."""
    inputs, outputs = request.get("inputs"), request.get("outputs", [])
    if not isinstance(inputs, list) or not all(isinstance(i, dict) for i in inputs):
        raise Refused("'inputs' must be a list of objects with name, datatype, shape and data")
    if not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
        raise Refused("'outputs' must be a list of objects with a name")
    for key, value in request.items():
        if key not in ("inputs", "data"):
            _check_depth(value, MAX_JSON_DEPTH, key)
    _check_request_parameters(_check_parameters(request.get("parameters"), "the request"))
    for output in outputs:
        _check_parameters(output.get("parameters"), f"output {output.get('name')!r}")
    claimed, carried = [], 0
    for item in inputs:
        name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
        if not isinstance(name, str) or not isinstance(datatype, str) or not isinstance(shape, list):
            raise Refused("each input needs 'name' (a string), 'datatype' (a string) and 'shape' (a list)")
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise Refused(f"input {name!r} has shape {shape}; a shape is a list of non-negative integers")
        parameters = _check_parameters(item.get("parameters"), f"input {name!r}")
        for key, value in item.items():
            if key != "data":
                _check_depth(value, MAX_JSON_DEPTH, key)
        size = parameters.get("binary_data_size")
        if size is not None:
            if "data" in item or isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise Refused(f"input {name!r}: binary_data_size must be a byte count, with no 'data' beside it")
            claimed.append(ClaimedInput(name, datatype, tuple(shape), data_bytes=size))
            carried += size
        elif "data" in item:
            claimed.append(ClaimedInput(name, datatype, tuple(shape),
                                        elements=count_data(item["data"], datatype, len(shape), name)))
        else:
            claimed.append(ClaimedInput(name, datatype, tuple(shape)))
    if carried != len(binary):
        raise Refused(f"the inputs' binary_data_size add up to {carried} bytes but {len(binary)} bytes follow the "
                      "JSON header; give sizes that match the binary data")
    return claimed


def _check_parameters(parameters: Any, where: str) -> dict[str, Any]:
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise Refused(f"{where}: 'parameters' must be an object")
    shared = [k for k in SHARED_MEMORY_PARAMETERS if k in parameters]
    if shared:
        raise Refused(f"{where}: {shared[0]}: this server registers no shared memory; send the data in the request")
    return parameters


def _check_request_parameters(parameters: dict[str, Any]) -> None:
    """The parameters Triton parses itself hold what it can parse (:data:`REQUEST_PARAMETERS`)."""
    for name, wanted in REQUEST_PARAMETERS.items():
        if name not in parameters:
            continue
        value = parameters[name]
        if wanted.startswith("true"):
            good = isinstance(value, bool)
        else:
            good = (not isinstance(value, bool) and isinstance(value, int) and 0 <= value < 1 << 64) or (
                name == "sequence_id" and isinstance(value, str))
        if not good:
            raise Refused(f"the request's parameter {name} is {_short(value)}; give {wanted}")


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (bool, int, float, str, type(None))) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _check_depth(value: Any, limit: int, where: str) -> None:
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if depth > limit:
            raise Refused(f"{where!r} is nested deeper than {limit} levels")
        if isinstance(item, dict):
            todo.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            todo.extend((v, depth + 1) for v in item)


def count_data(data: Any, datatype: str, rank: int, name: str) -> int:
    """The elements of a JSON ``data`` field (flat or nested no deeper than the rank), each checked
    to be a value of ``datatype`` (integers in its range, numbers, booleans)."""
    accept = _value_check(datatype, name)
    count = 0
    todo = [(data, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, list):
            if depth >= max(rank, 1):
                raise Refused(f"input {name!r}: 'data' is nested deeper than its rank {rank}")
            todo.extend((v, depth + 1) for v in item)
        elif depth == 0:
            raise Refused(f"input {name!r}: 'data' must be a list")
        else:
            accept(item)
            count += 1
    return count


def _value_check(datatype: str, name: str):
    def refuse(value: Any, what: str) -> None:
        raise Refused(f"input {name!r} is {datatype} but holds {json.dumps(value)[:40]}, {what}")

    if datatype in _INT_RANGES or datatype in _UINT_RANGES:
        bits = _INT_RANGES.get(datatype) or _UINT_RANGES[datatype]
        low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if datatype in _INT_RANGES else (0, (1 << bits) - 1)

        def accept(value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, int):
                refuse(value, "not an integer")
            if not low <= value <= high:
                refuse(value, f"outside [{low}, {high}]")
    elif datatype in ("FP16", "FP32", "FP64", "BF16"):
        def accept(value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                refuse(value, "not a number")
    elif datatype == "BOOL":
        def accept(value: Any) -> None:
            if not isinstance(value, bool):
                refuse(value, "not true or false")
    else:
        raise Refused(f"input {name!r} has datatype {datatype!r}, which this server does not carry")
    return accept


# -- KServe v2 over gRPC ---------------------------------------------------------------------------

#: the typed-contents field of ``InferTensorContents`` each datatype uses (FP16/BF16: raw only)
GRPC_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                 "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                 "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                 "FP32": "fp32_contents", "FP64": "fp64_contents"}


def claimed_grpc_inputs(request: Any) -> list[ClaimedInput]:
    """The inputs of a ``ModelInferRequest`` (tritonclient's ``service_pb2``), raw or typed."""
    _check_grpc_parameters(request.parameters, "the request")
    _check_request_parameters({k: _grpc_value(v) for k, v in request.parameters.items() if k in REQUEST_PARAMETERS})
    for output in request.outputs:
        _check_grpc_parameters(output.parameters, f"output {output.name!r}")
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise Refused(f"the request has {len(request.inputs)} inputs but {len(raw)} raw_input_contents; give one "
                      "per input")
    claimed = []
    for index, tensor in enumerate(request.inputs):
        _check_grpc_parameters(tensor.parameters, f"input {tensor.name!r}")
        shape = tuple(int(d) for d in tensor.shape)
        if any(d < 0 for d in shape):
            raise Refused(f"input {tensor.name!r} has shape {list(shape)}; a shape is a list of non-negative "
                          "integers")
        if raw:
            if tensor.HasField("contents"):
                raise Refused(f"input {tensor.name!r} has both contents and raw_input_contents; give one")
            claimed.append(ClaimedInput(tensor.name, tensor.datatype, shape, data_bytes=len(raw[index])))
            continue
        field = GRPC_CONTENTS.get(tensor.datatype)
        if field is None:
            raise Refused(f"input {tensor.name!r} is {tensor.datatype!r}, which this server takes in "
                          "raw_input_contents only" if numpy_dtype_of_kserve(tensor.datatype) else
                          f"input {tensor.name!r} has datatype {tensor.datatype!r}, which this server does not carry")
        given = {f.name: len(v) for f, v in tensor.contents.ListFields()}
        if set(given) - {field}:
            raise Refused(f"input {tensor.name!r} is {tensor.datatype} but carries {', '.join(sorted(given))}; "
                          f"use {field}")
        claimed.append(ClaimedInput(tensor.name, tensor.datatype, shape, elements=given.get(field, 0)))
    return claimed


def _grpc_value(parameter: Any) -> Any:
    """An ``InferParameter``'s value (``None`` when none is set)."""
    which = parameter.WhichOneof("parameter_choice")
    return getattr(parameter, which) if which else None


def _check_grpc_parameters(parameters: Any, where: str) -> None:
    shared = [k for k in SHARED_MEMORY_PARAMETERS if k in parameters]
    if shared:
        raise Refused(f"{where}: {shared[0]}: this server registers no shared memory; send the data in the request")


def numpy_check(model: ServedModel, feed: dict[str, np.ndarray]) -> None:
    """The same shape checks on the arrays an inference callable receives (a second line of defence
    for a request that reached Triton another way)."""
    for name, array in feed.items():
        check_shape(model, model.expected(name), array.shape)
