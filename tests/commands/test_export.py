"""``rmsnorm-deploy export``: the main job, bad input (exit 2, nothing written), parity failure (exit 1)."""

from __future__ import annotations

import json
import os
import re

import onnx
import pytest
import torch

from rmsnorm_deploy.cli import main
from rmsnorm_deploy.commands import export as export_command
from rmsnorm_deploy.exporter.loaded_model import LoadedModel, TokenLogits
from rmsnorm_deploy.exporter.presets import REPO_PRESETS

pytest.importorskip("onnxruntime", reason="the export-time parity check runs ONNX Runtime CPU")

DEFAULT_OUT = os.path.join("export", "tiny", "float32-function", "model.onnx")


def test_main_job_exports_tiny_and_prints_its_parity(tmp_path, monkeypatch, capsys):
    # Traced at batch 1, seq 1: the parity check's second shape (2 x 6) proves the axes stay dynamic.
    monkeypatch.chdir(tmp_path)
    stale = tmp_path / DEFAULT_OUT
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an older export")
    assert main(["export", "tiny", "--force", "--batch", "1", "--seq", "1"]) == 0
    out, err = capsys.readouterr()
    assert f"exported {DEFAULT_OUT}" in out
    assert re.search(r"5\s+SpecRMSNorm\s+SpecRMSNorm\s+x / sqrt\(mean\(x\^2\) \+ 1e-05\) \* w over the last dim", out)
    assert "onnxruntime[cpu] vs torch float32  logits float32[1, 1, 512]" in out
    assert "logits float32[2, 6, 512]" in out and "parity: PASS" in out
    assert "export [1] loading tiny in float32" in err and "torch.onnx.export (dynamo, opset 18): done" in err
    assert "[torch.onnx]" not in out + err  # the exporter's own chatter stays off the terminal
    model = onnx.load(DEFAULT_OUT)
    assert sum(n.op_type == "RMSNorm" for n in model.graph.node) == 5
    report = json.loads((tmp_path / "export" / "tiny" / "float32-function" / "report.json").read_text())
    assert report["parity"]["status"] == "pass" and report["parity"]["inputs"] == {"input_ids": [[1, 1], [2, 6]]}

    before = stale.read_bytes()
    assert main(["export", "tiny"]) == 2  # exists, no --force: refused before any work
    _, err = capsys.readouterr()
    assert err.strip().splitlines() == [f"rmsnorm-deploy export: error: {DEFAULT_OUT} exists; pass --force to replace "
                                        "it or choose another output"]
    assert stale.read_bytes() == before


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


BAD_INPUT = {
    "unknown preset": (lambda d: ["tinyy"], r"unknown model 'tinyy': not a preset name"),
    "missing preset file": (lambda d: [str(d / "nope.toml")], r"preset file .*nope.toml does not exist"),
    "malformed preset": (lambda d: [_write(d / "in" / "bad.toml", "[model\n")], "not valid TOML"),
    "preset without norm": (lambda d: [_write(d / "in" / "bad.toml", (REPO_PRESETS / "tiny.toml").read_text()
                                              .split("[norm]")[0])], r"missing the \[norm\] table"),
    "folder without config": (lambda d: [str((d / "in" / "hf").resolve())] if (d / "in" / "hf").mkdir(parents=True) is None
                              else [], "no config.json"),
    "folder without safetensors": (lambda d: [os.path.dirname(_write(d / "in" / "hf" / "config.json",
                                                                    '{"model_type": "llama"}'))],
                                   r"no \*.safetensors weights"),
    "unsupported architecture": (lambda d: [os.path.dirname(_write(d / "in" / "hf" / "config.json", '{"model_type": "vit"}'))
                                            if _write(d / "in" / "hf" / "model.safetensors", "") else ""],
                                 "unsupported architecture 'vit': transformers has no causal-LM class for it"),
    "opset out of range": (lambda d: ["tiny", "--opset", "17"], "opset 17 is not supported; choose an ONNX opset from 18 to 23"),
    "native below opset 23": (lambda d: ["tiny", "--lowering", "native", "--opset", "18"],
                              "RMSNormalization exists from opset 23; this model is opset 18"),
    "lowering that cannot hold the spec": (lambda d: ["tiny", "--dtype", "float16", "--lowering", "ort"],
                                           r"cannot lower norm 'layers.0.attention_norm' .* to 'ort'"),
    "sequence too long": (lambda d: ["tiny", "--seq", "300"], "--seq 300 is longer than the model's 256 positions"),
    "zero batch": (lambda d: ["tiny", "--batch", "0"], "--batch must be an integer >= 1"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    make_args, message = BAD_INPUT[case]
    argv = ["export"] + make_args(tmp_path) + ["-o", str(tmp_path / "out")]
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if not line.startswith("export [")]
    assert len(lines) == 1 and lines[0].startswith("rmsnorm-deploy export: error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in err and out == ""
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written


def test_bad_dtype_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["export", "tiny", "--dtype", "float64"])
    assert info.value.code == 2
    assert "argument --dtype: invalid choice: 'float64'" in capsys.readouterr().err


class _EmbedNormHead(torch.nn.Module):
    """An embedding, one RMS norm and a head: what the models below mix differently."""

    def __init__(self, vocab: int = 32, dim: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.RMSNorm(dim, eps=1e-6)
        self.head = torch.nn.Linear(dim, vocab, bias=False)


class FourierMixer(_EmbedNormHead):
    """A pre-norm model whose token mixing is an FFT (FNet): torch has no float16 FFT on CPU."""

    def forward(self, input_ids):
        h = self.embed(input_ids)
        h = h + torch.fft.rfft(self.norm(h), dim=1).real[:, : h.shape[1]].to(h.dtype)
        return self.head(h)


class ExportSensitive(_EmbedNormHead):
    """A model whose code takes another branch while being exported, as export workarounds do."""

    def forward(self, input_ids):
        h = self.norm(self.embed(input_ids))
        if torch.compiler.is_exporting():
            h = h * 1.01
        return self.head(h)


def _user_model(cls, dtype):
    torch.manual_seed(0)
    module = TokenLogits(cls().to(getattr(torch, dtype))).eval()
    return LoadedModel(name="user", module=module, dtype=dtype, source={"kind": "user"}, vocab_size=32, max_seq_len=64)


def test_a_dtype_the_model_cannot_run_in_is_exit_2_with_nothing_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(export_command, "load_torch_model", lambda ref, dtype: _user_model(FourierMixer, dtype))
    assert main(["export", "tiny", "--dtype", "float16", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "rmsnorm-deploy export: error: user cannot run in float16 on this machine's torch: Unsupported dtype Half" in err
    assert not (tmp_path / "out").exists()


def test_parity_failure_is_exit_1_with_the_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(export_command, "load_torch_model", lambda ref, dtype: _user_model(ExportSensitive, dtype))
    out_dir = tmp_path / "out"
    assert main(["export", "tiny", "-o", str(out_dir)]) == 1
    out = capsys.readouterr().out
    assert "parity: FAIL: onnxruntime[cpu] vs float64: logits" in out
    report = json.loads((out_dir / "report.json").read_text())
    assert report["parity"]["status"] == "FAIL" and (out_dir / "model.onnx").is_file()


# -- --norm-spec ----------------------------------------------------------------------------
def test_norm_spec_declaration_is_confirmed_and_shown(tmp_path, monkeypatch, capsys):
    # A full export of the tiny preset (several seconds): the declaration travels through the plan
    # into detection and is shown as how each norm was found.
    monkeypatch.chdir(tmp_path)
    assert main(["export", "tiny", "--batch", "1", "--seq", "1",
                 "--norm-spec", "SpecRMSNorm=eps=1e-5,gain=weight,order=scale_then_cast"]) == 0
    out, _ = capsys.readouterr()
    assert re.search(r"5\s+SpecRMSNorm\s+declared --norm-spec\s+x / sqrt\(mean\(x\^2\) \+ 1e-05\) \* w", out)


@pytest.mark.parametrize("args, message", [
    (["--norm-spec", "SpecRMSNorm"], r"--norm-spec 'SpecRMSNorm': give CLASS_OR_PATH=SPEC"),
    (["--norm-spec", "SpecRMSNorm=gain=sideways"], r"unknown gain 'sideways'"),
    (["--norm-spec", "A=llama", "--norm-spec", "A=gemma"], r"--norm-spec declares 'A' more than once"),
    (["--norm-spec", "SpecRMSNorm=gemma,eps=1e-5"], r"norm 'layers.0.attention_norm' \(.*SpecRMSNorm\) differs from its spec .* ULP\)"),
    (["--norm-spec", "NoSuchNorm=llama"], r"--norm-spec NoSuchNorm=llama: no module of the model has the class"),
])
def test_norm_spec_errors_are_one_line_exit_2_with_nothing_written(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["export", "tiny", *args]) == 2
    _, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert last.startswith("rmsnorm-deploy export: error: ") and re.search(message, last), last
    assert not (tmp_path / "export").exists() or not any((tmp_path / "export").rglob("*.onnx"))
