"""A model and its report are published together: an export killed before the end leaves no
model that looks finished, two exports into one folder leave one consistent pair, and the
leftovers of a killed save are removed by the next export.

Each test exports the tiny preset (a few seconds each: torch.onnx.export dominates), four
exports in all."""

from __future__ import annotations

import json
import threading

import onnx
import pytest

from rmsnorm_deploy.cli import main
from rmsnorm_deploy.exporter import pipeline as pipeline_mod
from rmsnorm_deploy.exporter.pipeline import export_model
from rmsnorm_deploy.exporter.plan import ExportOptions, load_torch_model
from rmsnorm_deploy.graph.metadata import ModelMetadata

pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'rmsnorm-deploy[onnxruntime]'")
SMALL = ["--batch", "1", "--seq", "1"]


def _visible(folder):
    return sorted(p.name for p in folder.iterdir())


def test_an_export_killed_during_parity_leaves_no_model(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline_mod, "compare_with_onnxruntime", killed)
    assert main(["export", "tiny", "-o", str(out), *SMALL]) == 130
    assert _visible(out) == [], "an unverified model must not look finished"


def test_leftovers_of_a_killed_save_are_removed_and_a_missing_report_is_noted(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".model.onnx.k3j2l1.tmp").write_bytes(b"half a model")
    (out / ".model.onnx.staging-x8y7").mkdir()
    (out / ".model.onnx.staging-x8y7" / "model.onnx").write_bytes(b"unverified")
    (out / "notes.txt").write_text("the user's own file")
    assert main(["export", "tiny", "-o", str(out), *SMALL]) == 0
    assert _visible(out) == ["model.onnx", "notes.txt", "report.json"]
    assert "left by an interrupted export" in capsys.readouterr().err
    (out / "report.json").unlink()
    capsys.readouterr()
    assert main(["validate", str(out / "model.onnx"), "--no-norms"]) == 0
    assert "warning: no report.json beside the model" in capsys.readouterr().out


def test_two_concurrent_exports_leave_a_consistent_pair(tmp_path, monkeypatch):
    """The float32 export (thread a) is held in its parity step until the float16 one (thread b)
    has either finished (without a lock, a's report then lands beside b's model) or reached the
    lock on the target (with it, b waits for a to publish, then publishes its own pair)."""
    target = tmp_path / "out" / "model.onnx"
    a_in_parity, b_at_lock = threading.Event(), threading.Event()
    real_compare = pipeline_mod.compare_with_onnxruntime
    real_lock = getattr(pipeline_mod, "output_lock", None)
    threads: dict[str, threading.Thread] = {}

    def compare(path, expected, *, dtype, detection=None):
        result = real_compare(path, expected, dtype=dtype, detection=detection)
        if dtype == "float32":
            a_in_parity.set()
            for _ in range(1200):  # at most 60 s
                if b_at_lock.is_set() or ("b" in threads and not threads["b"].is_alive()):
                    break
                b_at_lock.wait(0.05)
        return result

    def lock(path):
        if threading.current_thread().name == "b":
            b_at_lock.set()
        return real_lock(path)

    monkeypatch.setattr(pipeline_mod, "compare_with_onnxruntime", compare)
    monkeypatch.setattr(pipeline_mod, "output_lock", lock, raising=False)
    models = {dtype: load_torch_model("tiny", dtype) for dtype in ("float32", "float16")}
    errors = []

    def run(dtype):
        try:
            export_model(models[dtype], target, ExportOptions(dtype=dtype, force=True, batch=1, seq=1))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads["a"] = threading.Thread(target=run, args=("float32",), name="a")
    threads["a"].start()
    assert a_in_parity.wait(120)
    threads["b"] = threading.Thread(target=run, args=("float16",), name="b")
    threads["b"].start()
    for t in threads.values():
        t.join(240)
    assert not errors, errors
    report = json.loads((target.parent / "report.json").read_text())
    meta = ModelMetadata.read(onnx.load(str(target)))
    assert report["dtype"] == meta.dtype, "model.onnx and report.json describe different exports"
    assert _visible(target.parent) == ["model.onnx", "report.json"]
