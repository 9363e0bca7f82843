"""The TensorRT plugin without TensorRT: its fields, their parsing into the kernel's
parameters, the graph that reaches it, and the kernel compiled ahead of time to PTX.

The ahead-of-time compilation runs in a subprocess: this test process imported Triton for
its interpreter (conftest.py), and an interpreting Triton cannot compile. The PTX is then
assembled by the CUDA toolkit's ``ptxas`` when it is installed, as the driver would.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import pytest

from rmsnorm_deploy import RMSNormSpec, rmsnorm_model
from rmsnorm_deploy.contract.inputs import activations, gain_weights
from rmsnorm_deploy.contract.spec import named_specs
from rmsnorm_deploy.errors import LoweringError, SpecError, UserError
from rmsnorm_deploy.graph.function import is_rmsnorm_node, rmsnorm_node
from rmsnorm_deploy.graph.function import PLUGIN_VERSION
from rmsnorm_deploy.tensorrt import plugin, plugin_loader

REPO = Path(__file__).resolve().parents[2]
SPECS = {
    **named_specs(),
    "offset-cast_then_scale": RMSNormSpec(1e-5, gain="offset", order="cast_then_scale"),
    "qk-norm-2d": RMSNormSpec(1e-6, normalized_dims=2, order="cast_then_scale"),
    "eps-outside-sqrt": RMSNormSpec(3e-5, gain="none", epsilon_placement="outside_sqrt"),
    "acc-float64": RMSNormSpec(1e-6, accumulation="float64"),
}


def _qdp_annotations() -> dict:
    """Each plugin field's annotation in ``_qdp.py`` (read, not imported: it imports tensorrt),
    evaluated to the object ``tensorrt.plugin`` sees."""
    tree = ast.parse((REPO / "rmsnorm_deploy" / "tensorrt" / "_qdp.py").read_text())
    fn = next(f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "rmsnorm_desc")
    names = {"np": np, "npt": npt, "float": float, "int": int, "str": str}
    return {a.arg: eval(ast.unparse(a.annotation), names) for a in fn.args.args if a.arg in plugin.PLUGIN_FIELDS}


def _parser_fields(node: onnx.NodeProto) -> dict:
    """The ``PluginField`` data TensorRT's ONNX parser builds from the node attributes the plugin
    declares (onnx-tensorrt's plugin importer): FLOAT as a 1-element float32 field, INTS as
    int32, STRING as characters. ``trt.PluginField.data`` reads them back as numpy arrays."""
    out = {}
    for attr in node.attribute:
        if attr.name not in plugin.PLUGIN_FIELDS:
            continue
        if attr.type == onnx.AttributeProto.FLOAT:
            out[attr.name] = np.array([attr.f], dtype=np.float32)
        elif attr.type == onnx.AttributeProto.INTS:
            out[attr.name] = np.asarray(attr.ints, dtype=np.int32)
        elif attr.type == onnx.AttributeProto.STRING:
            out[attr.name] = np.frombuffer(attr.s, dtype=np.int8)
    return out


def _creator_converts(annotation, data: np.ndarray):
    """What ``tensorrt.plugin``'s creator makes of one field for an argument annotated
    ``annotation``: the logic of ``_TemplatePluginCreator.create_plugin`` in NVIDIA/TensorRT
    ``python/packaging/bindings_wheel/tensorrt/plugin/_lib.py`` (``_is_numpy_array`` and
    ``_infer_numpy_type`` in ``_utils.py`` beside it): an ``npt.NDArray[dtype]`` field is
    ``data.astype(dtype)``, a ``str`` is the bytes decoded, any other type is ``type(data)``."""
    if annotation is np.ndarray or typing.get_origin(annotation) is np.ndarray:
        np_type = typing.get_args(typing.get_args(annotation)[1])[0]
        return data.astype(np_type)
    if issubclass(annotation, str):
        return data.tobytes().decode("utf-8")
    return annotation(data)


def _fields_as_tensorrt_passes_them(node: onnx.NodeProto) -> dict:
    """The arguments ``_qdp.py``'s functions receive: the parser's fields, converted by the
    creator according to ``_qdp.py``'s annotations."""
    annotations = _qdp_annotations()
    return {name: _creator_converts(annotations[name], data) for name, data in _parser_fields(node).items()}


def test_tensorrt_plugins_creator_takes_every_field_as_the_parser_passes_it():
    """A FLOAT attribute reaches the creator as a 1-element float32 array; an annotation ``float``
    would call ``float()`` on it, which numpy >= 2.4 refuses, and every ``build --plugin`` failed."""
    node = rmsnorm_node(SPECS["llama"], "float16", ["x", "w"], ["y"], plugin=True)
    annotations = _qdp_annotations()
    fields = _parser_fields(node)
    assert fields["epsilon"].shape == (1,) and fields["epsilon"].dtype == np.float32
    converted = {name: _creator_converts(annotations[name], data) for name, data in fields.items()}
    assert converted["epsilon"].shape == (1,)
    assert plugin.spec_from_fields(converted).epsilon_float32 == SPECS["llama"].epsilon_float32


@pytest.mark.parametrize("epsilon", [np.array([1e-5, 1e-6], dtype=np.float32), np.array([], dtype=np.float32)],
                         ids=["two", "none"])
def test_an_epsilon_field_without_exactly_one_value_is_refused(epsilon):
    fields = _fields_as_tensorrt_passes_them(rmsnorm_node(SPECS["llama"], "float16", ["x", "w"], ["y"], plugin=True))
    fields["epsilon"] = epsilon
    with pytest.raises(UserError, match=f"field 'epsilon' has {epsilon.size} values"):
        plugin.spec_from_fields(fields)


def test_plugin_fields_are_the_spec_attributes_of_our_nodes():
    node = rmsnorm_node(SPECS["llama"], "float16", ["x", "w"], ["y"], plugin=True)
    attrs = {a.name for a in node.attribute}
    assert set(plugin.PLUGIN_FIELDS) == attrs - {"plugin_namespace", "plugin_version"}
    assert plugin.PLUGIN_FIELDS == {
        "accumulation": "STRING", "axes": "INTS", "epsilon": "FLOAT", "epsilon_placement": "STRING", "gain": "STRING",
        "order": "STRING",
    }


@pytest.mark.parametrize("name", list(SPECS))
def test_fields_parse_back_to_the_same_kernel_parameters(name):
    """Node attributes -> TensorRT plugin fields -> spec -> the kernel's constexprs: nothing lost."""
    from rmsnorm_deploy.kernels.triton_rmsnorm import kernel_constants

    spec = SPECS[name]
    inputs = ["x", "w"] if spec.has_gain else ["x"]
    node = rmsnorm_node(spec, "bfloat16", inputs, ["y"], plugin=True)
    parsed = plugin.spec_from_fields(_fields_as_tensorrt_passes_them(node))
    assert parsed.normalized_dims == spec.normalized_dims
    assert parsed.epsilon_float32 == spec.epsilon_float32
    for dtype in ("float32", "float16", "bfloat16"):
        assert kernel_constants(parsed, dtype) == kernel_constants(spec, dtype)


@pytest.mark.parametrize(
    "change, error, message",
    [
        ({"axes": np.array([0], dtype=np.int32)}, LoweringError, "axes \\[0\\] are not the trailing dims"),
        ({"gain": "scale"}, SpecError, "unknown gain 'scale'"),
        ({"epsilon": np.array([0.0], dtype=np.float32)}, SpecError, "epsilon must be finite and > 0"),
        ({"order": None}, UserError, "fields \\['order'\\] are missing"),
    ],
    ids=["axes", "gain", "epsilon", "missing"],
)
def test_bad_fields_are_refused_by_name(change, error, message):
    fields = _fields_as_tensorrt_passes_them(rmsnorm_node(SPECS["llama"], "float16", ["x", "w"], ["y"], plugin=True))
    fields.update(change)
    fields = {k: v for k, v in fields.items() if v is not None}
    with pytest.raises(error, match=message):
        plugin.spec_from_fields(fields)


def test_a_string_field_with_a_trailing_nul_still_parses():
    fields = _fields_as_tensorrt_passes_them(rmsnorm_node(SPECS["gemma"], "float16", ["x", "w"], ["y"], plugin=True))
    fields["gain"] += "\x00"
    assert plugin.spec_from_fields(fields).gain == "offset"


@pytest.mark.parametrize(
    "spec, dtype, weight_dtype, message",
    [
        (SPECS["llama"], "float16", "bfloat16", "weight is bfloat16; the kernel takes x's dtype \\(float16\\) or float32"),
        (SPECS["llama"], "int8", "int8", "input x is int8"),
        (SPECS["llama"], "float16", None, "gain 'weight' needs a weight input; use namespace 'rmsnorm_deploy'"),
        (SPECS["nogain"], "float16", "float16", "gain 'none' takes no weight; use namespace 'rmsnorm_deploy_noweight'"),
    ],
)
def test_inputs_the_kernel_does_not_take_are_refused(spec, dtype, weight_dtype, message):
    with pytest.raises(ValueError, match=message):
        plugin.check_io(spec, dtype, weight_dtype)
    plugin.check_io(spec, dtype if dtype != "int8" else "float16", "float32" if spec.has_gain else None)


def test_normalized_dims_must_be_static():
    spec = SPECS["qk-norm-2d"]
    assert plugin.normalized_size(spec, [None, 8, 128]) == 1024
    with pytest.raises(ValueError, match="normalized dims must be static.*\\['\\?', 128\\]"):
        plugin.normalized_size(spec, [4, None, 128])
    with pytest.raises(ValueError, match="rank 1; the spec normalizes the last 2"):
        plugin.normalized_size(spec, [128])


@pytest.mark.parametrize("name", ["llama", "nogain"])
def test_the_plugin_graph_addresses_the_registration_with_the_right_inputs(name):
    """Nodes with a weight go to rmsnorm_deploy::RMSNorm, nodes without to rmsnorm_deploy_noweight::RMSNorm,
    version 1; the local function stays, so ONNX Runtime and plugin-less TensorRT still run the graph."""
    spec = SPECS[name]
    model = rmsnorm_model(spec, dtype="float16", shape=(3, 64), lowering="plugin")
    onnx.checker.check_model(model, full_check=True)
    (node,) = [n for n in model.graph.node if is_rmsnorm_node(n)]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    namespace = attrs["plugin_namespace"].decode()
    assert (namespace, attrs["plugin_version"].decode()) == (plugin.plugin_namespace(spec), PLUGIN_VERSION)
    assert len(node.input) == len(plugin.REGISTRATIONS[namespace])
    assert node.op_type == plugin.PLUGIN_NAME
    assert any(f.name == node.op_type and f.domain == node.domain for f in model.functions)


@pytest.mark.parametrize("name", ["gemma", "nogain"])
def test_the_plugin_graph_runs_in_onnxruntime_like_the_function_graph(name):
    pytest.importorskip("onnxruntime", reason="needs onnxruntime")
    from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner

    spec = SPECS[name]
    feed = {"x": activations((5, 96), "float16", seed=1)}
    if spec.has_gain:
        feed["weight"] = gain_weights((96,), "float16", spec.gain)
    outputs = {}
    for lowering in ("plugin", "function"):
        with OnnxRuntimeRunner(rmsnorm_model(spec, dtype="float16", shape=(5, 96), lowering=lowering)) as runner:
            outputs[lowering] = runner.infer(feed)["y"]
    assert np.array_equal(outputs["plugin"], outputs["function"])


def test_the_qdp_definitions_declare_exactly_the_plugin_fields():
    """_qdp.py imports tensorrt, so it is read, not imported: every decorated function takes the
    plugin's fields, typed as the ONNX parser converts them."""
    annotation = {"FLOAT": "npt.NDArray[np.float32]", "INTS": "npt.NDArray[np.int32]", "STRING": "str"}
    tree = ast.parse((REPO / "rmsnorm_deploy" / "tensorrt" / "_qdp.py").read_text())
    decorated = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.decorator_list:
            decorator = ast.unparse(fn.decorator_list[0])
            decorated[fn.name] = decorator
            args = {a.arg: ast.unparse(a.annotation) for a in fn.args.args}
            inputs = ["x", "weight"] if "WEIGHTED" in decorator and "UNWEIGHTED" not in decorator else ["x"]
            assert list(args)[: len(inputs)] == inputs, fn.name
            fields = {k: v for k, v in args.items() if k not in (*inputs, "outputs", "stream", "tactic")}
            assert fields == {k: annotation[t] for k, t in plugin.PLUGIN_FIELDS.items()}, fn.name
    kinds = sorted(d for d in decorated.values())
    assert kinds == sorted(f"trtp.{k}({r})" for k in ("register", "impl", "aot_impl") for r in ("WEIGHTED", "UNWEIGHTED"))


def test_load_plugin_refuses_a_missing_library(tmp_path):
    with pytest.raises(UserError, match="plugin library .*nope.so does not exist"):
        plugin_loader.load_plugin(tmp_path / "nope.so")


def test_load_plugin_refuses_an_unknown_implementation():
    with pytest.raises(UserError, match="unknown plugin implementation 'cpp'; choose one of aot, jit"):
        plugin_loader.load_plugin(implementation="cpp")


def test_load_plugin_without_tensorrt_names_the_install():
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("tensorrt is installed here; the missing-dependency message cannot be observed")
    with pytest.raises(UserError, match="the TensorRT RMSNorm plugin needs tensorrt, which is not installed"):
        plugin_loader.load_plugin()


def test_plugin_info_for_the_builder():
    info = plugin.PluginInfo("RMSNorm", "1", tuple(plugin.REGISTRATIONS), "aot", ("PREFER_AOT_PYTHON_PLUGINS",),
                             None, "10.13", "3.6.0")

    class FakeFlags:  # the enum's members are ints; only their positions matter here
        PREFER_AOT_PYTHON_PLUGINS = 5

    class FakeTrt:
        NetworkDefinitionCreationFlag = FakeFlags

    assert info.network_flag_bits(FakeTrt) == 1 << 5
    assert info.plugin_ids == ("rmsnorm_deploy::RMSNorm", "rmsnorm_deploy_noweight::RMSNorm")
    assert "compiled ahead of time into the engine" in info.describe()
    assert json.loads(json.dumps(info.to_dict()))["implementation"] == "aot"


# -- ahead-of-time compilation ------------------------------------------------------------------
#: (spec, dtype, weight dtype, row length): gains, dtypes, a float32 weight, odd and packed rows
AOT_CASES = [
    ("llama", "bfloat16", "bfloat16", 4096),
    ("gemma", "float16", "float32", 760),
    ("nogain", "float16", None, 128),
    ("acc-float64", "float32", "float32", 7),
]
_COMPILE = """
import json, sys
from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.kernels.triton_rmsnorm import compile_aot
out = []
for spec, dtype, weight_dtype, n_cols, ptx_version, max_ptx_version in json.loads(sys.argv[1]):
    k = compile_aot(RMSNormSpec(**spec), dtype=dtype, weight_dtype=weight_dtype, n_cols=n_cols, arch=90,
                    ptx_version=ptx_version, max_ptx_version=max_ptx_version)
    out.append(dict(name=k.name, ptx=k.ptx, num_warps=k.num_warps, shared_mem=k.shared_mem, block_x=k.block_x,
                    rows_per_program=k.rows_per_program, block_n=k.block_n, target=k.target, ptx_version=k.ptx_version))
print(json.dumps(out))
"""


def _system_ptxas() -> tuple[str, int] | None:
    """The CUDA toolkit's ptxas and the PTX ISA it assembles (Triton's ``ptx_version`` form)."""
    exe = shutil.which("ptxas")
    if not exe:
        return None
    version = re.search(r"release (\d+)\.(\d+)", subprocess.run([exe, "--version"], capture_output=True, text=True).stdout)
    if not version:
        return None
    major, minor = int(version.group(1)), int(version.group(2))
    isa = 90 + (major - 13) * 10 + minor if major >= 13 else 80 + minor - (1 if minor >= 6 else 0)
    return exe, isa


@pytest.fixture(scope="module")
def compiled():
    """The AOT_CASES compiled for sm_90 in a process whose Triton compiles, at most at the PTX ISA of
    the CUDA toolkit's ptxas (as for a driver); plus one at ISA 8.0."""
    ptxas = _system_ptxas()
    cases = [[SPECS[s].to_dict(), d, w, n, None, ptxas[1] if ptxas else None] for s, d, w, n in AOT_CASES]
    cases.append([SPECS["llama"].to_dict(), "float16", "float16", 64, 80, None])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cases)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), ptxas


def _entry_params(ptx: str, name: str) -> list[str]:
    entry = re.search(rf"\.entry\s+{name}\s*\((.*?)\)", ptx, re.S)
    assert entry, f"no .entry {name} in the PTX"
    return [re.sub(r"\s+", " ", p.strip()).split(" ")[1] for p in entry.group(1).split(",")]


@pytest.mark.parametrize("index", range(len(AOT_CASES)), ids=[f"{s}-{d}-w{w}-{n}" for s, d, w, n in AOT_CASES])
def test_aot_kernel_has_the_argument_layout_tensorrt_launches(compiled, index):
    """TensorRT launches AOT kernels with (inputs..., int32 extra args..., outputs...): here
    (x, [weight,] n_rows, n_cols, x_row_stride, y_row_stride, y), then Triton's scratch
    pointers, which TensorRT leaves null and the kernel must not use."""
    kernels, _ = compiled
    spec_name, dtype, weight_dtype, n_cols = AOT_CASES[index]
    k = kernels[index]
    params = _entry_params(k["ptx"], k["name"])
    inputs = [".u64"] * (2 if weight_dtype else 1)
    assert params[: len(inputs) + 5] == inputs + [".u32"] * 4 + [".u64"]
    assert all(p == ".u64" for p in params[len(inputs) + 5:]), params  # scratch pointers only
    assert re.search(r"^\.target sm_90a?$", k["ptx"], re.M)
    assert k["block_x"] == 32 * k["num_warps"]
    assert k["block_n"] >= n_cols and k["block_n"] & (k["block_n"] - 1) == 0
    assert (k["rows_per_program"] > 1) == (n_cols <= 1024)


def test_aot_kernel_loads_and_stores_whole_vectors(compiled):
    """Rows whose byte length divides by 16 are read and written 16 bytes at a time."""
    kernels, _ = compiled
    for k, (_, dtype, _, n_cols) in zip(kernels, AOT_CASES):
        if (n_cols * {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]) % 16 == 0:
            assert "ld.global.v4" in k["ptx"] and "st.global.v4" in k["ptx"], (dtype, n_cols)


def test_aot_kernel_rounds_like_the_reference(compiled):
    """Correctly rounded division and square root, no fused multiply-add (the reference rounds x*x)."""
    kernels, _ = compiled
    for k in kernels:
        assert "div.rn.f32" in k["ptx"] or "div.rn.f64" in k["ptx"]
        assert not re.search(r"\b(sqrt|div|rcp)\.approx", k["ptx"])
        assert not re.search(r"\bfma\.", k["ptx"])


def test_ptx_isa_can_be_held_to_what_the_driver_loads(compiled):
    kernels, ptxas = compiled
    capped = kernels[-1]
    assert capped["ptx_version"] == 80 and re.search(r"^\.version 8\.0$", capped["ptx"], re.M)
    if ptxas is not None:
        assert all(k["ptx_version"] <= ptxas[1] for k in kernels)


def test_aot_kernel_assembles_with_the_cuda_toolkit(compiled, tmp_path):
    """The CUDA toolkit's ptxas accepts the PTX for sm_90a, as the driver's JIT will."""
    kernels, ptxas = compiled
    if ptxas is None:
        pytest.skip("needs the CUDA toolkit's ptxas on PATH to assemble the PTX")
    for i, k in enumerate(kernels):
        path = tmp_path / f"k{i}.ptx"
        path.write_text(k["ptx"])
        done = subprocess.run([ptxas[0], "-arch=sm_90a", "-v", str(path), "-o", str(tmp_path / f"k{i}.cubin")],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "0 bytes spill stores" in done.stderr, done.stderr


def test_compiling_ahead_of_time_is_refused_in_an_interpreting_process():
    from rmsnorm_deploy.kernels.triton_rmsnorm import compile_aot, triton_interprets

    if not triton_interprets():
        pytest.skip("Triton compiles in this process (a GPU machine): nothing to refuse")
    with pytest.raises(RuntimeError, match="compile ahead of time in a process without it"):
        compile_aot(SPECS["llama"], dtype="float16", weight_dtype="float16", n_cols=64, arch=90)


def test_the_tensorrt_extra_asks_for_the_first_release_with_ahead_of_time_python_plugins():
    """Python plugins compile ahead of time from TensorRT 10.9 (not 10.8): the extra, the
    compatibility table's oldest release and the plugin's gate say the same."""
    from packaging.requirements import Requirement

    from rmsnorm_deploy.tensorrt.compat import OLDEST

    text = (REPO / "pyproject.toml").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("tensorrt = ")]
    (requirement,) = [Requirement(r) for r in json.loads(line.split("=", 1)[1])]
    assert plugin.AOT_SINCE == (10, 9) and OLDEST == plugin.AOT_SINCE
    assert requirement.specifier.contains("10.9.0") and not requirement.specifier.contains("10.8.0")


def _fake_tensorrt(monkeypatch, version: str, *, aot: bool):
    """A ``tensorrt`` module of ``version`` whose ``tensorrt.plugin`` has ``aot_impl`` when ``aot``."""
    import types

    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.get_plugin_registry = lambda: types.SimpleNamespace(get_creator=lambda *a: object())
    trtp = types.ModuleType("tensorrt.plugin")
    if aot:
        trt.QuickPluginCreationRequest = object()
        trtp.aot_impl = lambda *a: None
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    return trt, trtp


@pytest.mark.parametrize("version, aot, supported", [
    ("10.8.0.43", False, False),
    ("10.8.0.43", True, False),  # whatever the module holds, 10.8 has no AOT Python plugins
    ("10.9.0.34", True, True),
    ("11.1.0.106", True, True),
    ("11.1.0.106", False, False),
])
def test_aot_is_supported_from_tensorrt_10_9(monkeypatch, version, aot, supported):
    trt, trtp = _fake_tensorrt(monkeypatch, version, aot=aot)
    assert plugin.aot_supported(trt, trtp) is supported


def test_an_ahead_of_time_plugin_on_tensorrt_10_8_names_10_9_and_the_jit_choice(monkeypatch):
    _fake_tensorrt(monkeypatch, "10.8.0.43", aot=False)
    with pytest.raises(UserError, match=r"TensorRT 10.8.0.43 cannot compile Python plugins ahead of time \(they exist "
                       r"from TensorRT 10.9\); use TensorRT >= 10.9, or --plugin-impl jit"):
        plugin_loader.load_plugin(implementation="aot")
