"""The last tracebacks of the command line, and outputs that must not clobber or linger.

Damaged graphs, paths the file system refuses, terminals that cannot show a path, sizes past
the memory budget, Ctrl-C and SIGTERM at any moment, closed pipes, and hostile ``generate``
options are one line each (exit 2, or 130/141/143 for a signal); ``--output`` never replaces
the model it reads; a repository is published with the user's umask and leaves no link behind.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

from rmsnorm_deploy import RMSNormSpec, rmsnorm_model
from rmsnorm_deploy.cli import Terminated, main
from rmsnorm_deploy.graph.onnx_file import save_onnx

pytest.importorskip("onnxruntime", reason="the commands run ONNX Runtime")
ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "rmsnorm_deploy"]
H = 8


def _one_line(capsys, code, expected_code=2):
    err = capsys.readouterr().err
    assert code == expected_code, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def _run(argv, **kwargs):
    """The CLI in its own process (what a terminal sees), from the repository root."""
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, cwd=kwargs.pop("cwd", ROOT), timeout=120,
                          **kwargs)


def _model(tmp_path, name="m.onnx"):
    return save_onnx(rmsnorm_model(RMSNormSpec.llama(), dtype="float32", shape=(2, H)), tmp_path / name)


# -- 7. graphs whose nodes lack inputs ---------------------------------------------------------------
def _graph_without_inputs(op, opset):
    """A graph with no inputs and one ``op`` node that has none either (readers take ``input[0]``)."""
    g = helper.make_graph([helper.make_node(op, [], ["y"])], "g", [],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [2, H])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


@pytest.mark.parametrize("op, opset, takes", [
    ("SimplifiedLayerNormalization", 18, "takes at least 2"), ("LayerNormalization", 18, "takes 2 to 3"),
    ("RMSNormalization", 23, "takes 2"), ("ReduceMean", 18, "takes 1 to 2"),
])
@pytest.mark.parametrize("command", ["validate", "audit", "build", "check-trt"])
def test_a_node_without_its_inputs_is_one_line(tmp_path, capsys, op, opset, takes, command):
    path = tmp_path / "g.onnx"
    onnx.save_model(_graph_without_inputs(op, opset), str(path))
    line = _one_line(capsys, main([command, str(path)]))
    assert f"node 'y' ({op}) has 0 inputs but {op} {takes}; the model is damaged" in line


def test_a_node_without_outputs_is_one_line(tmp_path, capsys):
    g = helper.make_graph([helper.make_node("Relu", ["x"], [])], "g",
                          [helper.make_tensor_value_info("x", TP.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / "g.onnx"
    onnx.save_model(model, str(path))
    assert "node '?' (Relu) has no output" in _one_line(capsys, main(["audit", str(path)]))


# -- 7. paths ------------------------------------------------------------------------------------------
def test_a_non_ascii_path_in_an_ascii_terminal(tmp_path):
    path = _model(tmp_path, "modèle.onnx")
    result = _run(["validate", str(path)], env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert f"model: {tmp_path}/mod\\xe8le.onnx\n" in result.stdout and "2 passed, 0 failed" in result.stdout


LONG = "a" * 300


@pytest.mark.parametrize("argv", [
    lambda tmp: ["validate", str(tmp / f"{LONG}.onnx")],
    lambda tmp: ["audit", str(tmp / f"{LONG}.onnx")],
    lambda tmp: ["export", "tiny", "-o", str(tmp / f"{LONG}.onnx")],
    lambda tmp: ["generate", str(tmp / LONG), "--input-ids", "1"],
    lambda tmp: ["validate", str(_model(tmp)), "--output", str(tmp / f"{LONG}.json")],
    lambda tmp: ["triton-repo", str(_model(tmp)), "-o", str(tmp / LONG)],
], ids=["validate", "audit", "export", "generate", "validate --output", "triton-repo -o"])
def test_a_file_name_too_long_is_one_line(tmp_path, capsys, argv):
    args = argv(tmp_path)
    capsys.readouterr()
    line = _one_line(capsys, main(args))
    assert LONG in line and "File name too long; shorten the path (a file name holds at most 255 bytes)" in line


@pytest.mark.parametrize("where, message", [
    (lambda tmp: tmp / "file.txt" / "repo", "file.txt is a file, not a folder; choose another output"),
    (lambda tmp: Path("/proc/repo"), "cannot create the repository folder /proc/repo: "),
], ids=["under a file", "under /proc"])
def test_triton_repo_output_that_cannot_be_a_folder(tmp_path, capsys, where, message):
    pytest.importorskip("tritonclient", reason="triton-repo checks its config with tritonclient")
    (tmp_path / "file.txt").write_text("not a folder")
    model = _model(tmp_path)
    capsys.readouterr()
    assert message in _one_line(capsys, main(["triton-repo", str(model), "-o", str(where(tmp_path))]))


def test_sweep_checks_the_memory_of_a_shape_before_allocating(capsys):
    line = _one_line(capsys, main(["sweep", "--spec", "llama", "--dtype", "float32", "--lowering", "function",
                                   "--shape", "1099511627776x8"]))
    assert "--shape 1099511627776x8 (8,796,093,022,208 elements) needs about" in line and "give a smaller shape" in line


# -- 7. signals and pipes ------------------------------------------------------------------------------
def test_ctrl_c_anywhere_in_main_is_one_line(monkeypatch, capsys):
    import rmsnorm_deploy.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert _one_line(capsys, main(["sweep"]), 130) == "rmsnorm-deploy: interrupted"


def test_ctrl_c_during_start_up(tmp_path):
    """SIGINT while the commands' modules are still importing: torch is loaded only by ``main``
    (building the parser), so once its library is mapped the signal lands inside ``main``."""
    proc = subprocess.Popen([*CLI, "validate", str(_model(tmp_path))], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline and "libtorch" not in maps.read_text():
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines() == ["rmsnorm-deploy: interrupted"]


def test_sigterm_during_export_cleans_up_like_ctrl_c(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([*CLI, "export", "tiny", "-o", str(out / "model.onnx")], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not list(out.glob(".model.onnx.staging-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(out.glob(".model.onnx.staging-*")), "the export never staged"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "rmsnorm-deploy export: terminated"
    assert sorted(p.name for p in out.iterdir()) == []


@pytest.mark.parametrize("kind, code, word", [(Terminated, 143, "terminated"), (KeyboardInterrupt, 130, "interrupted")])
@pytest.mark.parametrize("swallowed_as", ["an error", "nothing"])
def test_an_interrupt_swallowed_on_its_way_up_still_stops_the_command(tmp_path, monkeypatch, capsys, kind, code,
                                                                      word, swallowed_as):
    """A library that turns a Ctrl-C or SIGTERM into its own error (as the signal's exception crossed
    its native code), or a finalizer where Python dropped it: the command must not go on to report a
    model error (exit 2), a failed check (exit 1) or a result (exit 0); the recorded signal wins."""
    from rmsnorm_deploy.errors import UserError, note_interrupt
    from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner

    activate = OnnxRuntimeRunner._activate

    def swallowing_activate(self):
        activate(self)
        note_interrupt(kind)  # what the CLI's signal handler records as it raises
        if swallowed_as == "an error":
            raise UserError("ONNX Runtime cannot load the model: RuntimeError: interrupted")

    monkeypatch.setattr(OnnxRuntimeRunner, "_activate", swallowing_activate)
    path = _model(tmp_path)
    capsys.readouterr()
    assert main(["validate", str(path)]) == code
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"rmsnorm-deploy validate: {word}"
    monkeypatch.undo()
    assert main(["validate", str(path)]) == 0  # nothing is left recorded for the next command


def test_a_stage_stops_at_an_interrupt_its_body_swallowed():
    from rmsnorm_deploy.errors import note_interrupt
    from rmsnorm_deploy.progress import Progress

    done = []
    with pytest.raises(KeyboardInterrupt):
        with Progress(enabled=False).stage("work"):
            try:
                note_interrupt(KeyboardInterrupt)
                raise KeyboardInterrupt()
            except KeyboardInterrupt:
                pass  # swallowed by a library
        done.append("the next stage")
    assert done == []


def test_a_stage_whose_exit_a_signal_cut_short_says_nothing_when_collected_later():
    """A SIGTERM that lands in the with statement's exit, before the stage's generator is resumed,
    leaves it suspended; collected after the command has printed ``terminated``, it must not print a
    stage line after that last line."""
    import gc
    import io

    from rmsnorm_deploy.progress import Progress

    out = io.StringIO()
    progress = Progress(stream=out)
    entered = progress.stage("writing")
    entered.__enter__().note("5 norm nodes")
    del entered  # as when Terminated left contextlib's __exit__ before it called next(generator)
    gc.collect()
    assert out.getvalue().splitlines() == [progress.prefix + "[1] writing ..."]
    with progress.stage("parity") as st:  # a stage run through is reported as always
        st.note("pass")
    assert out.getvalue().splitlines()[-1] == progress.prefix + "[2] parity: done in 0.0s (pass)"


def test_a_closed_pipe_ends_quietly(tmp_path):
    """``rmsnorm-deploy ... | head -c 1``: the reader is gone before the output is written."""
    proc = subprocess.Popen([*CLI, "validate", str(_model(tmp_path))], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == "", err


def _kv_folder(tmp_path):
    """A tiny Llama's --target onnxruntime folder (the graph, its genai_config.json, config.json)."""
    from rmsnorm_deploy.decoder.convention import KVCacheLayout
    from rmsnorm_deploy.decoder.genai_config import write_serving_files
    from rmsnorm_deploy.decoder.ort_export import write_ort_decoder
    from rmsnorm_deploy.exporter import hf
    from rmsnorm_deploy.graph.metadata import ModelMetadata

    loaded = hf.from_config(hf.TINY_CONFIGS["llama"], "float32", seed=0)
    path = tmp_path / "kv" / "model.onnx"
    written = write_ort_decoder(loaded, path, force=False, max_length=32)
    write_serving_files(path, KVCacheLayout.from_dict(ModelMetadata.read(written.model).kv_cache), loaded.source,
                        force=False)
    return path.parent


@pytest.mark.parametrize("command", ["validate", "generate"])
def test_a_closed_stdout_is_no_output_not_a_traceback(tmp_path, command):
    """``rmsnorm-deploy ... >&-``: the command runs, its verdict is the exit code, stderr stays clean."""
    pytest.importorskip("transformers", reason="the generate case builds a tiny transformers model")
    argv = [str(_model(tmp_path))] if command == "validate" else [str(_kv_folder(tmp_path)), "--input-ids", "5,6,7",
                                                                   "--max-new-tokens", "4"]
    proc = subprocess.run(["bash", "-c", 'exec "$@" >&-', "bash", *CLI, command, *argv], cwd=ROOT,
                          capture_output=False, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


# -- 7. generate options ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--threads", "2147483648"], "--threads 2147483648: give an integer from 1 to"),
    (["--threads", "0"], "--threads 0: give an integer from 1 to"),
])
def test_generate_options_are_checked_before_the_model_is_read(tmp_path, capsys, argv, message):
    (tmp_path / "model.onnx").write_bytes(b"not read")
    assert message in _one_line(capsys, main(["generate", str(tmp_path), "--input-ids", "1", *argv]))


def test_sampling_at_a_vanishing_temperature_is_greedy():
    """``--temperature 1e-310``: logits / temperature overflow; the probabilities stay finite."""
    import numpy as np

    from rmsnorm_deploy.decoder.loop import Sampling, greedy, token_picker

    logits = np.random.default_rng(0).normal(0, 3, (3, 256)).astype(np.float32)
    for top_k in (0, 5):
        pick = token_picker(Sampling(do_sample=True, temperature=1e-310, top_k=top_k))
        assert pick(logits).tolist() == greedy(logits).tolist()


# -- 8. outputs that clobber or linger -------------------------------------------------------------
@pytest.mark.parametrize("command", ["validate", "audit"])
@pytest.mark.parametrize("output", [lambda m: m, lambda m: m.parent / ".." / m.parent.name / m.name,
                                    lambda m: Path(str(m) + ".data")], ids=["the model", "the model by another path",
                                                                            "its data file"])
def test_output_never_replaces_the_model(tmp_path, capsys, command, output):
    model = _model(tmp_path)
    Path(str(model) + ".data").write_bytes(b"weights")
    before = model.read_bytes()
    line = _one_line(capsys, main([command, str(model), "--output", str(output(model)), "--force"]))
    assert "is the command's input" in line and "write the results to another file" in line
    assert model.read_bytes() == before and Path(str(model) + ".data").read_bytes() == b"weights"


def test_force_over_a_linked_repository_model_leaves_no_link(tmp_path, capsys):
    pytest.importorskip("tritonclient", reason="triton-repo checks its config with tritonclient")
    model = _model(tmp_path)
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not ours")
    repo.mkdir()
    (repo / "model").symlink_to(elsewhere)
    assert main(["triton-repo", str(model), "-o", str(repo), "--force"]) == 0
    assert sorted(p.name for p in repo.iterdir()) == ["model"]
    assert not (repo / "model").is_symlink() and (repo / "model" / "config.pbtxt").is_file()
    assert (elsewhere / "keep.txt").read_text() == "not ours"


def test_repository_folders_follow_the_umask(tmp_path, capsys):
    pytest.importorskip("tritonclient", reason="triton-repo checks its config with tritonclient")
    mask = os.umask(0o022)
    os.umask(mask)
    assert main(["triton-repo", str(_model(tmp_path)), "-o", str(tmp_path / "repo")]) == 0
    for folder in (tmp_path / "repo" / "model", tmp_path / "repo" / "model" / "1"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~mask, folder
