"""The command line: help, the parity command, exit codes and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rmsnorm_deploy.cli import COMMANDS, main
from rmsnorm_deploy.contract import tolerances

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_unknown_command_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'frobnicate'" in err and len(err.strip().splitlines()) == 1


pytest.importorskip("onnxruntime", reason="the sweep command runs ONNX Runtime")


def test_sweep_prints_a_table_and_passes(capsys, tmp_path):
    out_json = tmp_path / "rows.json"
    code = main(["sweep", "--spec", "llama", "--spec", "gemma", "--dtype", "float16", "--lowering", "function",
                 "--lowering", "ort", "--optimization", "all", "--inputs", "stress", "--shape", "3x5x64",
                 "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0
    assert "ulp vs f64" in out and "SimplifiedLayerNormalization" in out
    assert "refused [1]" in out and "[1] refused: SimplifiedLayerNormalization applies the gain" in out
    rows = json.loads(out_json.read_text())
    assert {(r["spec"], r["lowering"], r["status"]) for r in rows} == {
        ("llama", "function", "pass"), ("llama", "ort", "refused"), ("gemma", "function", "pass"), ("gemma", "ort", "pass")
    }


def test_sweep_failure_exits_1(capsys, monkeypatch):
    # An impossible tolerance makes every row fail: the command must say so with exit code 1.
    strict = tolerances.Tolerance(max_ulp=0, reason="test: no error allowed at all")
    monkeypatch.setitem(tolerances.TOLERANCES, ("norm", "onnxruntime", "float16"), strict)
    code = main(["sweep", "--spec", "llama", "--dtype", "float16", "--lowering", "function", "--optimization", "all",
                 "--inputs", "normal"])
    out = capsys.readouterr().out
    assert code == 1 and "FAIL [1]" in out and "would pass with max_ulp>=" in out


def test_the_old_name_parity_still_runs_the_sweep_with_a_note(capsys):
    code = main(["parity", "--spec", "llama", "--dtype", "float32", "--lowering", "function", "--optimization",
                 "disable", "--shape", "2x8"])
    captured = capsys.readouterr()
    assert code == 0 and "ulp vs f64" in captured.out
    assert captured.err.strip() == ("rmsnorm-deploy: note: `parity` is now `sweep`; the old name still works but will "
                                    "be removed")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sweep", "--shape", "199xabc"], "error: --shape '199xabc' is not a shape; write it like 199x760"),
        (["sweep", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_module_entry_point_runs():
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "rmsnorm_deploy", "--version"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("rmsnorm-deploy ")
