"""`import rmsnorm_deploy`, building models and `--help` need only torch, onnx and onnxscript.

Each check runs in a fresh interpreter where onnxruntime, tensorrt, triton and transformers
cannot be imported, as on a machine that has only the core dependencies.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("onnxruntime", "tensorrt", "triton", "transformers", "safetensors")

_PRELUDE = textwrap.dedent(
    f"""
    import sys

    class _Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {BLOCKED!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked for this test)")
            return None

    sys.meta_path.insert(0, _Blocker())
    """
)


def _run(code: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=120)


def test_import_build_and_help_work_without_optional_dependencies():
    proc = _run(
        """
        import rmsnorm_deploy
        from rmsnorm_deploy import RMSNormSpec
        from rmsnorm_deploy import rmsnorm_model
        model = rmsnorm_model(RMSNormSpec.llama(), dtype="bfloat16", shape=(2, 8))
        from rmsnorm_deploy.graph.audit import audit_model
        assert audit_model(model)[0].accumulation == "float32"
        from rmsnorm_deploy.cli import main
        try:
            main(["--help"])
        except SystemExit as exc:
            assert exc.code == 0
        for name in ("onnxruntime", "tensorrt", "triton", "transformers"):
            assert name not in sys.modules, name
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_missing_onnxruntime_is_a_one_line_error_with_the_fix():
    proc = _run(
        """
        from rmsnorm_deploy.cli import main
        sys.exit(main(["sweep", "--spec", "llama", "--dtype", "float32", "--lowering", "function"]))
        """
    )
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "needs onnxruntime, which is not installed" in err and "pip install 'rmsnorm-deploy[onnxruntime]'" in err
