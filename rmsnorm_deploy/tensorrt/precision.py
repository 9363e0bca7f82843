"""Which TensorRT layers implement each norm, and in which dtype its reduction runs.

Two views, both traced back to the norm through the ONNX node names the parser stamps on
every layer (``ILayer.metadata`` = ``[ONNX Layer: <node> | ...]``, and the layer name itself):

* the **network** (before building): in a strongly typed network a layer computes in the
  dtype of its inputs, so the input dtype of the norm's ``REDUCE`` (or ``NORMALIZATION``)
  layer *is* the precision of its reduction; a plugin layer runs our kernel, which
  accumulates in float32 by contract;
* the **engine** (after building, ``IEngineInspector`` at ``DETAILED`` verbosity): the
  layers TensorRT actually runs, fused or not, with their input/output formats. A norm may
  be fused into one kernel (a ``Myelin``/``kgen`` layer) whose internal precision the
  inspector does not show; then the network view stands, and the report says so.

A reduction in float16 or bfloat16 (or an 8-bit type) fails the build.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Sequence

from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.graph.function import OP_TYPE, PLUGIN_NAMESPACE, PLUGIN_VERSION
from rmsnorm_deploy.tensorrt.prepare import EngineNorm

LOW_PRECISION = ("float16", "bfloat16", "fp8", "int8", "fp4", "int4")
#: ``trt.DataType`` member names -> our dtype names.
TRT_DTYPE_NAMES = {
    "FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT8": "int8", "INT32": "int32", "INT64": "int64",
    "BOOL": "bool", "UINT8": "uint8", "FP8": "fp8", "INT4": "int4", "FP4": "fp4", "E8M0": "e8m0",
}
_NETWORK_REDUCTIONS = ("REDUCE", "NORMALIZATION")
_PLUGIN_TYPES = ("PLUGIN", "PLUGIN_V2", "PLUGIN_V3")
_METADATA_RE = re.compile(r"\[ONNX Layer:\s*([^|\]]+?)\s*(?:\||\])")


class PrecisionError(UserError):
    """A norm whose reduction TensorRT would run below float32: the check failed (exit code 1)."""

    exit_code = 1


@dataclasses.dataclass(frozen=True)
class LayerRecord:
    """One TensorRT layer as the network definition or the engine inspector describes it."""

    name: str
    type: str
    metadata: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def onnx_nodes(self) -> tuple[str, ...]:
        """The ONNX node names in the layer's metadata (several for a fused engine layer)."""
        return tuple(_METADATA_RE.findall(self.metadata or ""))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "inputs": list(self.inputs), "outputs": list(self.outputs)}


def dtype_from_format(text: str) -> str:
    """The dtype in an engine inspector ``Format/Datatype`` string, e.g. ``Row major linear FP16 format``."""
    upper = (text or "").upper()
    for token, name in (("BF16", "bfloat16"), ("BFLOAT16", "bfloat16"), ("FP16", "float16"), ("HALF", "float16"),
                        ("FP32", "float32"), ("FLOAT", "float32"), ("FP8", "fp8"), ("INT64", "int64"),
                        ("INT32", "int32"), ("UINT8", "uint8"), ("INT8", "int8"), ("BOOL", "bool"), ("FP4", "fp4"),
                        ("INT4", "int4")):
        if token in upper:
            return name
    return "unknown"


def engine_record(info: Any) -> LayerRecord:
    """A :class:`LayerRecord` from one ``IEngineInspector.get_layer_information(i, JSON)`` object."""
    if not isinstance(info, dict):  # below DETAILED verbosity the inspector gives only the name
        return LayerRecord(str(info), "unknown", "", (), ())

    def formats(key: str) -> tuple[str, ...]:
        return tuple(dtype_from_format(t.get("Format/Datatype", "")) for t in info.get(key, []) if isinstance(t, dict))

    return LayerRecord(str(info.get("Name", "")), str(info.get("LayerType", "unknown")), str(info.get("Metadata", "")),
                       formats("Inputs"), formats("Outputs"))


@dataclasses.dataclass
class NormPrecision:
    """How TensorRT implements one norm and in which dtype its reduction runs."""

    norm: str
    implementation: str
    reduction: str
    network_layers: list[LayerRecord]
    engine_layers: list[LayerRecord] = dataclasses.field(default_factory=list)
    engine_note: str = ""
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem

    def to_dict(self) -> dict[str, Any]:
        return {
            "norm": self.norm, "implementation": self.implementation, "reduction": self.reduction, "ok": self.ok,
            "problem": self.problem, "engine_note": self.engine_note,
            "network_layers": [r.to_dict() for r in self.network_layers],
            "engine_layers": [r.to_dict() for r in self.engine_layers],
        }


def _name_pattern(names: Iterable[str]) -> re.Pattern[str] | None:
    names = sorted(set(names), key=len, reverse=True)
    if not names:
        return None
    # A node name, optionally with the parser's uniqueness suffix "_<n>", not inside a longer
    # name; "..." may touch it, as in a fused layer named "{ForeignNode[first...last]}".
    alternatives = "|".join(re.escape(n) for n in names)
    return re.compile(rf"(?<![\w/:-])(?<!\w\.)(?:{alternatives})(?:_\d+)?(?![\w/:-]|\.\w)")


def layers_of(site: EngineNorm, records: Sequence[LayerRecord]) -> list[LayerRecord]:
    """The layers whose metadata or name names one of ``site``'s ONNX nodes."""
    pattern = _name_pattern(site.nodes)
    if pattern is None:
        return []
    found = []
    for record in records:
        if any(node in site.nodes for node in record.onnx_nodes) or pattern.search(record.name or ""):
            found.append(record)
    return found


def check_network(sites: Sequence[EngineNorm], records: Sequence[LayerRecord]) -> list[NormPrecision]:
    """The precision of each norm in the (strongly typed) network."""
    results = []
    for site in sites:
        layers = layers_of(site, records)
        if site.kind == "plugin":
            plugins = [r for r in layers if r.type.upper() in _PLUGIN_TYPES]
            if not plugins:
                got = ", ".join(sorted({r.type for r in layers})) or "no layer"
                results.append(NormPrecision(site.label, "plugin requested", "?", layers, problem=(
                    f"TensorRT did not import it as the plugin ({got}): no plugin {OP_TYPE!r} of namespace "
                    f"{PLUGIN_NAMESPACE!r}, version {PLUGIN_VERSION} is registered")))
                continue
            inputs = ", ".join(sorted({d for r in plugins for d in r.inputs[:1]}))
            results.append(NormPrecision(site.label, f"plugin ({plugins[0].type}, {inputs} in)",
                                         "float32 (the plugin kernel accumulates in float32)", layers))
            continue
        reductions = [r for r in layers if r.type.upper() in _NETWORK_REDUCTIONS]
        preferred = [r for r in reductions if any(n in site.reduction_nodes for n in r.onnx_nodes)]
        reductions = preferred or reductions
        implementation = "TensorRT layers" + (f" from {site.kind}" if site.kind != "function" else " (inlined function)")
        if not reductions:
            results.append(NormPrecision(site.label, implementation, "?", layers, problem=(
                "no REDUCE or NORMALIZATION layer of this norm was found in TensorRT's network, so the precision of "
                "its reduction cannot be verified")))
            continue
        dtypes = sorted({r.inputs[0] if r.inputs else "unknown" for r in reductions})
        low = [d for d in dtypes if d in LOW_PRECISION]
        problem = ""
        if low:
            worst = next(r for r in reductions if r.inputs and r.inputs[0] in low)
            problem = (f"its reduction runs in {', '.join(low)} (TensorRT {worst.type} layer {worst.name!r}); export "
                       "the norm with a float32 upcast (the function, inline or native lowering of an RMSNormSpec)")
            if worst.type.upper() == "NORMALIZATION":
                # TensorRT 11 computes a normalization layer in its input type; 10.x documents a float32
                # default but forbids setting it in strongly typed networks: not provable, so refused.
                problem += "; a NORMALIZATION layer computes in its input type in strongly typed TensorRT 11"
        results.append(NormPrecision(site.label, implementation, ", ".join(dtypes), layers, problem=problem))
    return results


def check_engine(norms: Sequence[NormPrecision], sites: Sequence[EngineNorm], records: Sequence[LayerRecord]) -> None:
    """Attach the engine's layers to each norm (``norms`` in the order of ``sites``, as
    :func:`check_network` returns them); an unfused reduction below float32 is a problem."""
    for norm, site in zip(norms, sites, strict=True):
        layers = layers_of(site, records)
        norm.engine_layers = layers
        if not layers:
            norm.engine_note = "not named by any engine layer (fused under another layer's name)"
            continue
        low_reduce = [r for r in layers if "REDUCE" in r.type.upper() and r.inputs and r.inputs[0] in LOW_PRECISION]
        if low_reduce and not norm.problem:
            norm.problem = (f"the engine's reduction layer {low_reduce[0].name!r} reads {low_reduce[0].inputs[0]}; "
                            "export the norm with a float32 upcast")
        fused = [r for r in layers if r.type.upper() not in ("REDUCE", "NORMALIZATION") and
                 not r.type.upper().startswith("PLUGIN")]
        if fused and not any("REDUCE" in r.type.upper() for r in layers):
            norm.engine_note = (f"fused into {', '.join(sorted({r.type for r in fused}))} layer(s); their internal "
                                "precision is not shown by the inspector, the strongly typed network fixes it")


def failures(norms: Iterable[NormPrecision]) -> list[NormPrecision]:
    return [n for n in norms if not n.ok]


def raise_on_failures(norms: Sequence[NormPrecision], stage: str) -> None:
    bad = failures(norms)
    if bad:
        first = bad[0]
        more = f" (and {len(bad) - 1} more norm(s))" if len(bad) > 1 else ""
        raise PrecisionError(f"{stage}: norm {first.norm!r}: {first.problem}{more}")
