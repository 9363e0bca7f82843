"""Will TensorRT's ONNX parser import this model? A static check that needs no TensorRT.

The facts come from onnx-tensorrt's ``docs/operators.md`` and ``docs/Changelog.md`` (also
NVIDIA/TensorRT's ``CHANGELOG.md``) and from how its ``ModelImporter.cpp`` dispatches a node:

1. a node with a ``plugin_namespace`` attribute goes to a registered plugin of its op type
   (plugins take precedence over local functions since 10.7, Changelog 10.7);
2. otherwise the built-in importer of its **op type** — the node's domain is not looked at;
3. otherwise a local function of that **name** (functions are keyed by name only, the first
   one wins: ``importLocalFunctions``), inlined;
4. otherwise a plugin of that name, and failing that the node is rejected.

Where a fact below is inferred rather than read in a versioned document, the table says so
(``source``). The check reports, per TensorRT version, every node the parser would reject
or import with different numbers, with the fix; ``blocking`` findings make the CLI exit 1.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Sequence

import onnx

from rmsnorm_deploy.decoder.convention import check_io, graph_io, layout_of
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.graph.function import DOMAIN, OP_TYPE, PLUGIN_NAMESPACE
from rmsnorm_deploy.graph.metadata import ModelMetadata

#: ONNX ops onnx-tensorrt's docs/operators.md marks "Y" in the TensorRT 10.15 release
#: (minus those added in 10.14/10.15, listed in _ADDED below). The list is the same in the
#: 10.0/10.1 operators.md for every op our lowerings emit (Add, Cast, CastLike, Constant,
#: ConstantOfShape, Div, Mul, Pow, ReduceMean, Shape, Sqrt: all FP32/FP16/BF16).
_BASE_OPS = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization BlackmanWindow Cast
CastLike Ceil Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DeformConv DepthToSpace
DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements GatherND
Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GridSample GroupNormalization GRU
HammingWindow HannWindow HardSigmoid HardSwish Hardmax Identity If ImageScaler InstanceNormalization IsInf IsNaN
LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax Loop LRN LSTM LpNormalization LpPool MatMul Max MaxPool
Mean MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad ParametricSoftplus
Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform RandomUniformLike Range Reciprocal ReduceL1
ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu
Reshape Resize ReverseSequence RNN RoiAlign Round STFT ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape
Shrink Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh
ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
""".split())

#: Ops operators.md (10.15) marks "N": listed so the message can say "not supported" rather than "unknown".
_UNSUPPORTED_OPS = frozenset("""
AffineGrid Bernoulli BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Col2Im CenterCropPad Compress
ConcatFromSequence ConvInteger DFT Det DynamicQuantizeLinear ImageDecoder MatMulInteger MaxRoiPool MaxUnpool
MelWeightMatrix Multinomial NegativeLogLikelihoodLoss Optional OptionalGetElement OptionalHasElement QLinearConv
QLinearMatMul RegexFullMatch SequenceAt SequenceConstruct SequenceEmpty SequenceErase SequenceInsert SequenceLength
SequenceMap SoftmaxCrossEntropyLoss SplitToSequence StringConcat StringNormalizer StringSplit TfIdfVectorizer Unique
""".split())


@dataclasses.dataclass(frozen=True)
class _Release:
    since: tuple[int, int]
    max_opset: int
    opset_source: str
    added: frozenset[str] = frozenset()
    added_source: str = ""


#: Parser releases from 10.9 (the oldest this project supports, pyproject ``tensorrt>=10.9``: the first
#: TensorRT with ahead-of-time Python plugins, ``plugin.AOT_SINCE``).
_RELEASES: tuple[_Release, ...] = (
    _Release((10, 9), 22, "inferred: the parser bundles ONNX 1.17 (opset 22) since 10.6 (onnx-tensorrt Changelog 10.6); "
             "the 10.9 operators.md header was not read"),
    _Release((10, 11), 23, "inferred: ONNX updated to 1.18 (opset 23) in 10.11 (onnx-tensorrt Changelog 10.11)"),
    _Release((10, 14), 23, "inferred as for 10.11", frozenset({"Attention"}), "onnx-tensorrt Changelog 10.14"),
    _Release((10, 15), 24, "onnx-tensorrt docs/operators.md, 10.15: 'opset 9 to opset 24'",
             frozenset({"RMSNormalization", "RotaryEmbedding", "TensorScatter"}), "onnx-tensorrt Changelog 10.15"),
    _Release((11, 0), 25, "NVIDIA TensorRT docs, ONNX Opset Guide (TensorRT 11.x: ONNX 1.20, maximum opset 25)",
             frozenset({"Swish"}), "NVIDIA/TensorRT CHANGELOG 11.0"),
)
OLDEST = _RELEASES[0].since
#: Versions the CLI checks when none is given: the oldest supported, the first with
#: RMSNormalization, the first always strongly typed.
DEFAULT_VERSIONS = ("10.9", "10.15", "11.0")
#: BF16 tensors are imported since TensorRT 9.0 (onnx-tensorrt Changelog 9.0: "Added support
#: for FP8 and BF16 datatypes"); every version here has it. Running them needs compute
#: capability 8.0 or newer, which only the build on the target GPU can tell.
BF16_SINCE = (9, 0)


@dataclasses.dataclass(frozen=True)
class ParserFacts:
    """What the ONNX parser of one TensorRT version imports."""

    version: tuple[int, int]
    max_opset: int
    opset_source: str
    ops: frozenset[str]
    sources: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"

    def first_with(self, op: str) -> str | None:
        for release in _RELEASES:
            if op in release.added:
                return f"{release.since[0]}.{release.since[1]}"
        return None


def parse_version(text: str) -> tuple[int, int]:
    """``"10.9"`` or ``"10.9.0.34"`` -> ``(10, 9)``; a one-line error outside the table."""
    match = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.\d+)*\s*", str(text))
    if not match:
        raise UserError(f"TensorRT version {text!r} is not MAJOR.MINOR (for example 10.9 or 11.0)")
    version = (int(match.group(1)), int(match.group(2)))
    if version < OLDEST:
        raise UserError(f"TensorRT {text} is older than {OLDEST[0]}.{OLDEST[1]}, the oldest this project supports; "
                        f"choose {', '.join(DEFAULT_VERSIONS)} or newer")
    if version[0] > _RELEASES[-1].since[0]:
        raise UserError(f"no compatibility table for TensorRT {text} yet (the newest known is "
                        f"{_RELEASES[-1].since[0]}.x); check with the real parser: rmsnorm-deploy build")
    return version


def parser_facts(version: str | tuple[int, int]) -> ParserFacts:
    v = parse_version(version) if isinstance(version, str) else version
    ops = set(_BASE_OPS)
    max_opset, opset_source, sources = 0, "", ["onnx-tensorrt docs/operators.md (10.15)"]
    for release in _RELEASES:
        if release.since <= v:
            ops |= release.added
            max_opset, opset_source = release.max_opset, release.opset_source
            if release.added_source:
                sources.append(release.added_source)
    return ParserFacts(v, max_opset, opset_source, frozenset(ops), tuple(sources))


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing the parser of ``version`` would reject (``blocking``) or handle specially."""

    version: str
    node: str
    op: str
    problem: str
    fix: str
    blocking: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class CompatReport:
    version: str
    findings: list[Finding]

    @property
    def imports(self) -> bool:
        return not any(f.blocking for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {"tensorrt": self.version, "imports": self.imports, "findings": [f.to_dict() for f in self.findings]}


_FIX_LOWERING = "re-export with --lowering function (TensorRT inlines it) or --lowering plugin"
#: Ops the export's ``--fuse-attention`` writes (``rmsnorm_deploy/exporter/fusions.py``).
_FUSED_ATTENTION_OPS = frozenset({"Attention", "RotaryEmbedding"})


def check_model(model: onnx.ModelProto, versions: Sequence[str] = DEFAULT_VERSIONS) -> list[CompatReport]:
    """Check ``model`` against the parser of each TensorRT version in ``versions``."""
    return [_check(model, parser_facts(v)) for v in versions]


def _check(model: onnx.ModelProto, facts: ParserFacts) -> CompatReport:
    findings: list[Finding] = []
    add = lambda node, op, problem, fix, blocking=True: findings.append(  # noqa: E731
        Finding(facts.name, node, op, problem, fix, blocking))
    opset = next((imp.version for imp in model.opset_import if imp.domain in ("", "ai.onnx")), None)
    if opset is not None and opset > facts.max_opset:
        add("(model)", f"opset {opset}", f"TensorRT {facts.name}'s parser supports ONNX opsets up to "
            f"{facts.max_opset} ({facts.opset_source})",
            f"re-export with --opset {min(facts.max_opset, 23)} or lower"
            + (" (and without --fuse-attention, which needs opset 23)"
               if facts.max_opset < 23 and _has_fused_attention(model) else ""))
    functions_by_name: dict[str, list[onnx.FunctionProto]] = {}
    for fn in model.functions:
        functions_by_name.setdefault(fn.name, []).append(fn)
    used_functions: set[str] = set()
    for where, node in _walk(model.graph, ""):
        _check_node(node, where, facts, functions_by_name, used_functions, add)
    for name in sorted(used_functions):
        fns = functions_by_name[name]
        if len(fns) > 1:
            kinds = ", ".join(f"{f.domain}::{f.name}" + (f"[{f.overload}]" if f.overload else "") for f in fns)
            add(f"function {name}", name,
                f"{len(fns)} local functions are named {name!r} ({kinds}); the parser keys functions by name only, "
                "so every such node would run the first one's body",
                "build with `rmsnorm-deploy build` (it inlines each overload before parsing), or re-export with "
                "--lowering inline")
        for fn in fns:
            for where, node in _walk_nodes(fn.node, f"{fn.name}/"):
                _check_node(node, where, facts, functions_by_name, set(), add)
    findings.extend(_dtype_findings(model, facts))
    findings.extend(_kv_cache_findings(model, facts))
    return CompatReport(facts.name, findings)


def _kv_cache_findings(model: onnx.ModelProto, facts: ParserFacts) -> list[Finding]:
    """A KV-cache graph (``export --kv-cache``): its I/O must follow the convention its metadata
    records, since ``build`` makes its prefill and decode profiles from them; an ``Attention``
    taking the cache as ``past_key``/``past_value`` (``--fuse-attention``) is flagged as unverified."""

    try:
        meta = ModelMetadata.read(model)
    except UserError:
        return []  # damaged metadata is reported by the commands that read it
    if meta is None or not meta.kv_cache:
        return []
    out = []
    try:
        layout = layout_of(meta)
        check_io(layout, *graph_io(model))
    except UserError as exc:
        return [Finding(facts.name, "(model)", "KV cache", str(exc), "export the model again with --kv-cache")]
    out.append(Finding(facts.name, "(model)", "KV cache",
                       f"a KV-cache graph ({layout.num_layers} layers, {layout.kv_heads} key/value heads, head_dim "
                       f"{layout.head_dim}): `rmsnorm-deploy build` makes two optimization profiles, prefill (past 0, "
                       "an empty tensor) and decode (sequence 1)",
                       "nothing to fix; give --profile batch:... / sequence:... to change their ranges", blocking=False))
    cached = [n.name or n.op_type for n in model.graph.node
              if n.op_type == "Attention" and n.domain in ("", "ai.onnx") and len(n.input) > 4 and n.input[4]]
    if cached and "Attention" in facts.ops:
        out.append(Finding(facts.name, _first(set(cached)), "Attention",
                           f"{len(cached)} Attention node(s) take the cache as past_key/past_value; whether TensorRT's "
                           "Attention importer accepts those inputs is not stated in the documents this check reads "
                           "(inferred, unverified)",
                           "if the parse fails, re-export with --kv-cache and without --fuse-attention", blocking=False))
    return out


def _check_node(node, where, facts, functions_by_name, used_functions, add) -> None:
    attrs = {a.name for a in node.attribute}
    op = node.op_type
    qualified = f"{node.domain}::{op}" if node.domain not in ("", "ai.onnx") else op
    if node.domain == DOMAIN and op == OP_TYPE:
        if op in functions_by_name:
            used_functions.add(op)
            if "plugin_namespace" in attrs:
                add(where, qualified, f"carries plugin_namespace={PLUGIN_NAMESPACE!r}: the {OP_TYPE} plugin runs it "
                    "when its library is loaded, otherwise the parser inlines the local function",
                    "nothing to fix (use `rmsnorm-deploy build --plugin` to run the plugin)", blocking=False)
        elif "plugin_namespace" in attrs:
            add(where, qualified, "no local function of this name: only the plugin can import it",
                "load the plugin (`rmsnorm-deploy build --plugin`) or re-export with --lowering function")
        else:
            add(where, qualified, "no local function of this name and no plugin fields", _FIX_LOWERING)
        return
    if node.domain not in ("", "ai.onnx"):
        if op in functions_by_name:
            used_functions.add(op)
            return
        problem = f"TensorRT has no importer for {node.domain!r} ops; the parser would look for a plugin named {op!r}"
        if op in facts.ops:
            problem = (f"the parser ignores the domain and would import it as the standard ONNX {op}, which need "
                       "not compute the same thing")
        fix = ("this op comes from ONNX Runtime's graph optimizer: give TensorRT the model before ORT optimization"
               if node.domain == "com.microsoft" else "provide a TensorRT plugin for it, or re-export without it")
        add(where, qualified, problem, fix)
        return
    if op in facts.ops:
        return
    if op in functions_by_name:
        used_functions.add(op)
        return
    if op == "RMSNormalization":
        add(where, op, f"RMSNormalization is imported from TensorRT {facts.first_with(op)} on "
            "(onnx-tensorrt Changelog 10.15)", _FIX_LOWERING + ", or use TensorRT 10.15 or newer")
    elif op == "SimplifiedLayerNormalization":
        add(where, op, "ONNX Runtime's op (the 'ort' lowering): no TensorRT version imports it",
            "the ort lowering is for ONNX Runtime only; " + _FIX_LOWERING)
    elif op == "SkipSimplifiedLayerNormalization" or op == "SkipLayerNormalization":
        add(where, op, "an ONNX Runtime fused op: no TensorRT version imports it",
            "give TensorRT the model before ONNX Runtime's optimizations")
    elif op in _FUSED_ATTENTION_OPS and facts.first_with(op):
        add(where, op, f"imported from TensorRT {facts.first_with(op)} on (`rmsnorm-deploy export` writes it at "
            "opset 23: --fuse-attention)", f"use TensorRT {facts.first_with(op)} or newer, or re-export without "
            "--fuse-attention at opset 22 or lower")
    elif facts.first_with(op):
        add(where, op, f"imported from TensorRT {facts.first_with(op)} on", f"use TensorRT {facts.first_with(op)} or newer")
    elif op in _UNSUPPORTED_OPS:
        add(where, op, "operators.md marks it unsupported in every TensorRT version", "rewrite the graph without it")
    else:
        add(where, op, f"not in TensorRT {facts.name}'s operators.md", "provide a TensorRT plugin for it")


def _has_fused_attention(model: onnx.ModelProto) -> bool:
    return any(n.op_type in _FUSED_ATTENTION_OPS and n.domain in ("", "ai.onnx") for n in model.graph.node)


def _walk(graph: onnx.GraphProto, prefix: str) -> Iterable[tuple[str, onnx.NodeProto]]:
    yield from _walk_nodes(graph.node, prefix)


def _walk_nodes(nodes, prefix: str) -> Iterable[tuple[str, onnx.NodeProto]]:
    for node in nodes:
        label = prefix + (node.name or f"<{node.op_type} -> {node.output[0] if node.output else '?'}>")
        yield label, node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _walk(attr.g, label + "/")
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _walk(g, label + "/")


def _dtype_findings(model: onnx.ModelProto, facts: ParserFacts) -> list[Finding]:
    double, strings, bf16 = set(), set(), set()
    T = onnx.TensorProto
    g = model.graph
    typed = [(vi.name, vi.type.tensor_type.elem_type) for vi in list(g.input) + list(g.output) + list(g.value_info)]
    typed += [(init.name, init.data_type) for init in g.initializer]
    for fn in [None, *model.functions]:
        nodes = g.node if fn is None else fn.node
        for _, node in _walk_nodes(nodes, "" if fn is None else f"{fn.name}/"):
            for attr in node.attribute:
                if node.op_type == "Cast" and attr.name == "to":
                    typed.append((node.output[0], attr.i))
                elif attr.type == onnx.AttributeProto.TENSOR:
                    typed.append((node.output[0] if node.output else node.name, attr.t.data_type))
    for name, elem in typed:
        if elem == T.DOUBLE:
            double.add(name)
        elif elem == T.STRING:
            strings.add(name)
        elif elem == T.BFLOAT16:
            bf16.add(name)
    found = []
    if double:
        found.append(Finding(facts.name, _first(double), "float64", f"{len(double)} float64 tensor(s): TensorRT casts "
                             "DOUBLE down to FLOAT (operators.md), so float64 arithmetic runs in float32",
                             "use a float32-accumulation spec for TensorRT, or run this model in ONNX Runtime"))
    if strings:
        found.append(Finding(facts.name, _first(strings), "string", "TensorRT has no string tensors",
                             "remove string processing from the graph"))
    if bf16 and facts.version < BF16_SINCE:  # pragma: no cover - no such version in the table
        found.append(Finding(facts.name, _first(bf16), "bfloat16", "bfloat16 is imported from TensorRT 9.0 on",
                             "use TensorRT 10.9 or newer"))
    return found


def _first(names: set[str]) -> str:
    ordered = sorted(names)
    return ordered[0] + (f" (+{len(ordered) - 1} more)" if len(ordered) > 1 else "")


def summarize(report: CompatReport) -> list[list[str]]:
    """Table rows, identical findings grouped: ``[version, op, nodes, problem, fix, blocking]``."""
    groups: dict[tuple[str, str, str, bool], list[str]] = {}
    for f in report.findings:
        groups.setdefault((f.op, f.problem, f.fix, f.blocking), []).append(f.node)
    rows = []
    for (op, problem, fix, blocking), nodes in groups.items():
        shown = ", ".join(nodes[:2]) + (f" (+{len(nodes) - 2} more)" if len(nodes) > 2 else "")
        rows.append([report.version, op, shown, problem, fix, "yes" if blocking else "no"])
    return rows
