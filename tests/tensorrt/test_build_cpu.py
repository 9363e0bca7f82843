"""`rmsnorm-deploy build`: everything checked before TensorRT is needed, and the pure pieces
of the build (sizes, progress bar, parser-error lines, precision rules). The builds themselves
are in test_tensorrt.py."""

from __future__ import annotations

import importlib.util
import io

import pytest

from rmsnorm_deploy import RMSNormSpec, rmsnorm_model
from rmsnorm_deploy.cli import main
from rmsnorm_deploy.errors import (
    MissingDependencyError,
    ModelFileError,
    OutputExistsError,
    UserError,
)
from rmsnorm_deploy.graph.onnx_file import save_onnx
from rmsnorm_deploy.tensorrt.build import (
    ParserErrorInfo,
    build_engine,
    default_engine_path,
    format_parse_errors,
    parse_size,
)
from rmsnorm_deploy.tensorrt.precision import (
    LayerRecord,
    PrecisionError,
    check_network,
    dtype_from_format,
    engine_record,
    raise_on_failures,
)
from rmsnorm_deploy.tensorrt.prepare import EngineNorm
from rmsnorm_deploy.tensorrt.progress import BuildProgress

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "model.onnx"
    save_onnx(rmsnorm_model(RMSNormSpec.llama(), dtype="float16", shape=(199, 760)), path)
    return path


def test_bad_input_is_refused_before_tensorrt_and_writes_nothing(model_path, tmp_path):
    with pytest.raises(UserError, match=r"--profile batch: the model has no dynamic dim 'batch'"):
        build_engine(model_path, profiles=["batch:1,2,3"])
    with pytest.raises(UserError, match=r"is not NAME:MIN,OPT,MAX"):
        build_engine(model_path, profiles=["d0=1,2,3"])
    with pytest.raises(UserError, match=r"--workspace '4 parsecs' is not a size"):
        build_engine(model_path, workspace="4 parsecs")
    with pytest.raises(ModelFileError, match=r"no such file"):
        build_engine(tmp_path / "absent.onnx")
    native = tmp_path / "native.onnx"
    save_onnx(rmsnorm_model(RMSNormSpec.llama(), dtype="float16", shape=(4, 8), lowering="native"), native)
    with pytest.raises(UserError, match=r"the plugin replaces rmsnorm_deploy::RMSNorm nodes and this model has none"):
        build_engine(native, plugin=True)
    (tmp_path / "cache").mkdir()
    with pytest.raises(UserError, match=r"--timing-cache .*cache is a folder"):
        build_engine(model_path, timing_cache=tmp_path / "cache")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "model.onnx", "native.onnx"]


def test_existing_outputs_need_force(model_path):
    engine = default_engine_path(model_path, plugin=False)
    assert engine.name == "model.engine" and default_engine_path(model_path, plugin=True).name == "model.plugin.engine"
    engine.write_bytes(b"old")
    with pytest.raises(OutputExistsError, match=r"model.engine exists; pass --force"):
        build_engine(model_path)
    engine.unlink()
    engine.with_name("model.engine.json").write_text("{}")
    with pytest.raises(OutputExistsError, match=r"model.engine.json exists; pass --force"):
        build_engine(model_path)


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed here: the missing-dependency message cannot show")
def test_without_tensorrt_the_cli_says_how_to_get_it(model_path, capsys):
    assert main(["build", str(model_path), "--profile", "d0:1,64,256"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "building a TensorRT engine needs tensorrt, which is not installed" in err
    assert "use the Docker image" in err
    with pytest.raises(MissingDependencyError):
        build_engine(model_path)
    assert not default_engine_path(model_path, plugin=False).exists()


def test_cli_bad_profile_is_exit_code_2(model_path, capsys):
    assert main(["build", str(model_path), "--profile", "d0:9,2,1"]) == 2
    assert "need 1 <= min <= opt <= max, got 9,2,1" in capsys.readouterr().err


@pytest.mark.parametrize("text, size", [(1024, 1024), ("1073741824", 2**30), ("512M", 512 * 2**20), ("4G", 4 * 2**30),
                                        ("4GiB", 4 * 2**30), ("1.5g", 3 * 2**29), ("64kb", 64 * 1024)])
def test_workspace_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "-1G", "0", "4 parsecs"])
def test_bad_workspace_sizes(text):
    with pytest.raises(UserError, match=r"--workspace"):
        parse_size(text)


def test_progress_bar_follows_nested_phases():
    out = io.StringIO()
    bar = BuildProgress(out, interactive=True, min_interval=0.0)
    bar.phase_start("Building engine", None, 4)
    bar.phase_start("Tactic selection", "Building engine", 40)
    assert bar.step_complete("Tactic selection", 12)
    assert bar.step_complete("Building engine", 2)
    assert bar.line() == "[##########----------]  50% Building engine > Tactic selection 12/40"
    bar.phase_finish("Tactic selection")
    assert bar.line() == "[##########----------]  50% Building engine 2/4"
    bar.cancelled = True
    assert bar.step_complete("Building engine", 3) is False
    bar.phase_finish("Building engine")
    assert bar.line() == ""
    bar.close()
    assert "\r\x1b[2K[##########----------]  50% Building engine > Tactic selection 12/40" in out.getvalue()
    logged = io.StringIO()
    quiet = BuildProgress(logged, interactive=False)
    quiet.phase_start("Building engine", None, 2)
    quiet.phase_start("Tactic selection", "Building engine", 5)
    quiet.step_complete("Tactic selection", 1)
    assert logged.getvalue() == "building: Building engine\n"


def test_parser_errors_name_every_node_and_op(tmp_path):
    errors = [ParserErrorInfo("rmsnorm", "RMSNormalization", "No importer registered for op: RMSNormalization", "8"),
              ParserErrorInfo("norm_b/Pow_node_3__2", "Pow", "Invalid Node", "8", ("RMSNorm",))]
    line = format_parse_errors("10.8.0.43", tmp_path / "m.onnx", errors, "ignored")
    assert "\n" not in line
    assert line.startswith("TensorRT 10.8.0.43's ONNX parser rejected ")
    assert "(2 error(s)): node 'rmsnorm' (RMSNormalization): No importer registered for op: RMSNormalization; " in line
    assert "node 'norm_b/Pow_node_3__2' (Pow) in function RMSNorm: Invalid Node" in line
    assert line.endswith("--trt-version 10.8` for the fix")


@pytest.mark.parametrize("text, dtype", [("Row major linear FP32", "float32"), ("Row major linear FP16 format", "float16"),
                                         ("Channel major BF16 format where channel % 8 == 0", "bfloat16"),
                                         ("Row major linear BFloat16", "bfloat16"), ("Row major linear Int64", "int64"),
                                         ("N/A", "unknown")])
def test_engine_formats(text, dtype):
    assert dtype_from_format(text) == dtype


def test_engine_layer_records_read_the_inspector_fields():
    record = engine_record({"Name": "norm_a/Pow_node_3__1 + norm_a/ReduceMean_node_4__1", "LayerType": "Reduce",
                            "Metadata": "[ONNX Layer: norm_a/Pow_node_3__1]\x1e[ONNX Layer: norm_a/ReduceMean_node_4__1]",
                            "Inputs": [{"Name": "t", "Format/Datatype": "Row major linear FP32"}],
                            "Outputs": [{"Name": "u", "Format/Datatype": "Row major linear FP32"}]})
    assert record.onnx_nodes == ("norm_a/Pow_node_3__1", "norm_a/ReduceMean_node_4__1")
    assert record.inputs == ("float32",) and record.type == "Reduce"
    assert engine_record("layer 7").name == "layer 7"


SITE = EngineNorm("norm_a", "function", frozenset({"norm_a/Cast", "norm_a/ReduceMean"}), frozenset({"norm_a/ReduceMean"}))


def reduce_layer(dtype: str, *, name="norm_a/ReduceMean", metadata="[ONNX Layer: norm_a/ReduceMean]") -> LayerRecord:
    return LayerRecord(name, "REDUCE", metadata, (dtype,), (dtype,))


def test_the_reduction_dtype_decides():
    cast = LayerRecord("norm_a/Cast", "CAST", "[ONNX Layer: norm_a/Cast]", ("float16",), ("float32",))
    (ok,) = check_network([SITE], [cast, reduce_layer("float32")])
    assert ok.ok and ok.reduction == "float32" and len(ok.network_layers) == 2
    (bad,) = check_network([SITE], [reduce_layer("float16")])
    assert not bad.ok and bad.problem.startswith("its reduction runs in float16")
    with pytest.raises(PrecisionError, match=r"TensorRT's network: norm 'norm_a': its reduction runs in float16") as info:
        raise_on_failures([bad], "TensorRT's network")
    assert info.value.exit_code == 1
    # Located by the layer name (with the parser's uniqueness suffix) when metadata is absent.
    (by_name,) = check_network([SITE], [reduce_layer("bfloat16", name="norm_a/ReduceMean_3", metadata="")])
    assert "bfloat16" in by_name.problem
    # Named inside a fused layer, the way TensorRT names them.
    fused = reduce_layer("float32", name="{ForeignNode[norm_a/Cast...norm_a/ReduceMean]}", metadata="")
    assert check_network([SITE], [fused])[0].ok
    other = reduce_layer("float16", name="norm_a/ReduceMean.b + norm_ab/ReduceMean", metadata="")
    assert "cannot be verified" in check_network([SITE], [other])[0].problem
    # A norm none of whose layers can be found cannot pass.
    (lost,) = check_network([SITE], [reduce_layer("float32", name="norm_b/ReduceMean", metadata="")])
    assert "cannot be verified" in lost.problem


def test_a_plugin_norm_must_be_a_plugin_layer():
    site = EngineNorm("norm_a", "plugin", frozenset({"norm_a"}), frozenset())
    plugin = LayerRecord("norm_a", "PLUGIN_V3", "[ONNX Layer: norm_a]", ("float16", "float16"), ("float16",))
    (ok,) = check_network([site], [plugin])
    assert ok.ok and ok.implementation == "plugin (PLUGIN_V3, float16 in)"
    inlined = LayerRecord("RMSNorm/ReduceMean", "REDUCE", "[ONNX Layer: norm_a | Local Function: RMSNorm]",
                          ("float32",), ("float32",))
    (bad,) = check_network([site], [inlined])
    assert "did not import it as the plugin (REDUCE)" in bad.problem
    assert "no plugin 'RMSNorm' of namespace 'rmsnorm_deploy', version 1 is registered" in bad.problem


@pytest.mark.skipif(importlib.util.find_spec("rmsnorm_deploy.tensorrt.plugin") is not None,
                    reason="the plugin module is installed here: its absence cannot show")
def test_a_missing_plugin_module_is_a_one_line_error(model_path):
    from rmsnorm_deploy.tensorrt.runtime import PluginError, register_plugin

    with pytest.raises(PluginError, match=r"the RMSNorm TensorRT plugin is not part of this installation "
                                          r"\(rmsnorm_deploy.tensorrt.plugin is missing\); build without --plugin"):
        register_plugin()


def test_the_plugin_description_keeps_its_identity():
    import dataclasses

    from rmsnorm_deploy.tensorrt.runtime import describe_plugin

    @dataclasses.dataclass
    class Info:
        library: object
        aot: bool

    described = describe_plugin(Info(library=io.StringIO, aot=True))
    assert described["aot"] is True and described["library"].startswith("<class")
    assert (described["name"], described["namespace"], described["version"]) == ("RMSNorm", "rmsnorm_deploy", "1")
    assert describe_plugin({"name": "RMSNorm", "version": "1"})["namespace"] == "rmsnorm_deploy"
