"""Defects planted in a real export as a buggy exporter would write them, shared by the tests that
must catch them (``validate`` in tests/validate, the export's own parity in tests/exporter).

Each defect is written consistently (the node, its function and the metadata agree with one
another), so that only a comparison with the source finds it: the source's norms (the static
contract: their specs, number and gains) or its outputs. The model is the suite's real export of
SmolLM2-135M-Instruct, its weights moved once into an external data file that every mutated graph
beside it refers to as it is (only the graph is rewritten; a copy of the 540 MB file per defect
filled the disk of a CI machine).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from rmsnorm_deploy.graph.function import DOMAIN, function_proto, is_rmsnorm_node, spec_from_node
from rmsnorm_deploy.graph.metadata import ModelMetadata

DATA = "model.onnx.data"
#: the norms the single-norm defects are planted in (module paths of the export)
GAIN_NORM = "model.model.layers.3.input_layernorm"
ORDER_NORM = "model.model.layers.5.post_attention_layernorm"
HALF_NORM = "model.model.layers.7.input_layernorm"
DROPPED_NORM = "model.model.layers.4.post_attention_layernorm"
#: the layers whose down_proj weights trade places
SWAPPED_LAYERS = (3, 7)


def external_base(export_model: Path, report: Path, hf: Path, folder: Path) -> "Base":
    """The export at ``export_model`` with its weights moved once into an external data file in ``folder``."""
    model = onnx.load(str(export_model))
    onnx.save(model, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location=DATA, size_threshold=1024)
    shutil.copyfile(report, folder / "report.json")
    return Base(folder, hf)


@dataclasses.dataclass
class Base:
    folder: Path  # model.onnx (graph only) + model.onnx.data + report.json
    hf: Path

    def graph(self) -> onnx.ModelProto:
        return onnx.load(str(self.folder / "model.onnx"), load_external_data=False)

    def mutant(self, model: onnx.ModelProto, name: str) -> Path:
        """``model`` (its weights still in the base's data file) saved as ``NAME.onnx`` in the base's
        folder, beside that file and the report (onnx refuses a linked data file, as a possible attack)."""
        path = self.folder / f"{name}.onnx"
        if path.exists():
            raise FileExistsError(f"{path}: each mutant needs a name of its own")
        onnx.save(model, str(path))
        return path


def _norm_nodes(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {n.name: n for n in model.graph.node if is_rmsnorm_node(n)}


def _set_attribute(node: onnx.NodeProto, name: str, value: object) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend([*kept, helper.make_attribute(name, value)])


def _respec(model: onnx.ModelProto, names: list[str], **changes: object) -> None:
    """Give the nodes ``names`` a changed spec, as an exporter that detected it would write them:
    the node's attributes, its function overload (added if new) and the metadata's spec."""
    meta = ModelMetadata.read(model)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    have = {(f.domain, f.name, f.overload) for f in model.functions}
    nodes = _norm_nodes(model)
    for name in names:
        node = nodes[name]
        spec = dataclasses.replace(spec_from_node(node), **changes)
        for key, value in changes.items():
            _set_attribute(node, key, value)
        node.overload = spec.variant(False)  # a float32 graph: no conversion around the norm
        if (DOMAIN, node.op_type, node.overload) not in have:
            model.functions.append(function_proto(spec, False, opset))
            have.add((DOMAIN, node.op_type, node.overload))
        meta.specs[name] = dataclasses.replace(meta.specs[name], **changes)
    meta.write(model)


def plant_epsilon(model: onnx.ModelProto) -> None:
    _respec(model, list(_norm_nodes(model)), epsilon=1e-2)


def plant_offset_gain(model: onnx.ModelProto) -> None:
    _respec(model, [GAIN_NORM], gain="offset")


def plant_order(model: onnx.ModelProto) -> None:
    _respec(model, [ORDER_NORM], order="scale_then_cast")


def plant_half_reduction(model: onnx.ModelProto) -> None:
    """One norm's function body sums its squares in float16: a Cast before its ReduceMean (and back
    after it), in an overload of its own; its attributes and the metadata still say float32."""
    node = _norm_nodes(model)[HALF_NORM]
    (body,) = [f for f in model.functions if f.domain == DOMAIN and f.overload == node.overload]
    half = onnx.FunctionProto()
    half.CopyFrom(body)
    half.overload = body.overload.replace(".same_dtype", ".float16_sum.same_dtype")
    nodes = list(half.node)
    (i,) = [k for k, n in enumerate(nodes) if n.op_type == "ReduceMean"]
    reduce = nodes[i]
    squares, mean = reduce.input[0], reduce.output[0]
    reduce.input[0], reduce.output[0] = "squares_f16", "mean_f16"
    nodes[i:i + 1] = [helper.make_node("Cast", [squares], ["squares_f16"], to=TensorProto.FLOAT16), reduce,
                      helper.make_node("Cast", ["mean_f16"], [mean], to=TensorProto.FLOAT)]
    del half.node[:]
    half.node.extend(nodes)
    model.functions.append(half)
    node.overload = half.overload


def plant_swapped_layers(model: onnx.ModelProto) -> None:
    """Two layers' down_proj weights trade places (their external data references swap)."""
    inits = {i.name: i for i in model.graph.initializer}
    down = [inits[x] for n in model.graph.node if n.op_type == "MatMul" for x in n.input
            if x in inits and list(inits[x].dims) == [1536, 576]]
    assert len(down) == 30, [d.name for d in down]
    a, b = (down[k] for k in SWAPPED_LAYERS)
    refs_a, refs_b = list(a.external_data), list(b.external_data)
    del a.external_data[:], b.external_data[:]
    a.external_data.extend(refs_b)
    b.external_data.extend(refs_a)


def plant_dropped_norm(model: onnx.ModelProto) -> None:
    """One norm's node becomes an Identity of its input, and the metadata forgets it."""
    node = _norm_nodes(model)[DROPPED_NORM]
    identity = helper.make_node("Identity", [node.input[0]], list(node.output), name=node.name)
    node.CopyFrom(identity)
    meta = ModelMetadata.read(model)
    del meta.specs[DROPPED_NORM], meta.placements[DROPPED_NORM]
    meta.write(model)


#: defect -> (how it is planted, what the failure with --source says)
STATIC_DEFECTS = {
    "epsilon": (plant_epsilon, "norm model.model.layers.0.input_layernorm: epsilon 0.01 in the graph, 1e-05 in the "
                "checkpoint"),
    "offset gain": (plant_offset_gain, f"norm {GAIN_NORM}: gain offset in the graph, weight in the checkpoint"),
    "order": (plant_order, f"norm {ORDER_NORM}: order scale_then_cast in the graph, cast_then_scale in the "
              "checkpoint"),
    "half-precision reduction": (plant_half_reduction, f"norm {HALF_NORM}: squares and sum in float16 in the graph, "
                                 "accumulation float32 in the checkpoint"),
    "dropped norm": (plant_dropped_norm, f"norm {DROPPED_NORM}: in the checkpoint, not in the graph (a dropped "
                     "norm)"),
}
