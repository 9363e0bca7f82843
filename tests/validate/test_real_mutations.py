"""``validate`` on a real checkpoint with defects planted as a buggy exporter would write them.

Each defect is written consistently (the node, its function and the metadata agree with one
another), so that only a comparison with the source can find it: the source's norms (the
static contract: their specs, number and gains) or its outputs. With ``--source`` each defect
fails (exit 1) with a message naming it; without, the verdict is never "passed". The model is
the suite's real export of SmolLM2-135M-Instruct, its weights moved once into an external data
file that every mutated graph beside it refers to (only the graph is rewritten).

The defects themselves are planted by ``tests/real_mutations.py``, shared with the export's own
parity test (tests/exporter/test_real_export_defects.py). ``--reference float64`` is what ``auto``
means for a whole model; it is given to say so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.real_mutations import (
    ORDER_NORM,
    STATIC_DEFECTS,
    Base,
    plant_swapped_layers,
)
from tests.real_weights import run_cli


@pytest.fixture(scope="module")
def base(real_plain_base) -> Base:
    return real_plain_base


#: tokens per validation: a real model's float64 run is the slow part on a CPU
SIZES = ("--dim", "batch=1", "--dim", "seq=8")


def _validate(path: Path, source: Path | None = None) -> tuple[int, str]:
    """``validate PATH --source SOURCE --reference float64``, or ``validate PATH`` without a source."""
    return run_cli(["validate", str(path), *SIZES,
                    *(["--source", str(source), "--reference", "float64"] if source else [])])


def _fail_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "FAIL" in line]


def test_the_unmutated_real_export_passes_with_its_source(base):
    code, out = _validate(base.folder / "model.onnx", base.hf)
    assert code == 0, out
    assert "norm contract (61 norms)" in out and "float64 oracle (the checkpoint's spec)" in out, out


def test_each_static_defect_is_named_with_the_source_and_never_passes_without(base):
    """Five defects, each in norms of its own (the epsilon in all of them), planted in one model: each
    is its own failed row naming the norm and the field, so each alone fails the run (exit 1).
    Without the source the graph agrees with itself: never passed."""
    model = base.graph()
    for plant, _ in STATIC_DEFECTS.values():
        plant(model)
    path = base.mutant(model, "static-defects")
    code, out = _validate(path, base.hf)
    assert code == 1, out
    failed = "\n".join(_fail_lines(out))
    for defect, (_, message) in STATIC_DEFECTS.items():
        assert message in failed, (defect, out)
    # the order differs in no float32 number: only the static contract sees it
    assert f"FAIL onnxruntime[cpu] norm {ORDER_NORM}:" not in out
    code, out = _validate(path)
    assert code in (1, 3), out  # failed (the float16 sum) or not verified: never passed


def test_swapped_layer_weights_fail_the_outputs_with_the_source_and_are_not_verified_without(base):
    model = base.graph()
    plant_swapped_layers(model)
    path = base.mutant(model, "swapped-layers")
    code, out = _validate(path, base.hf)
    assert code == 1 and any("logits" in line for line in _fail_lines(out)), out
    assert "norm contract (61 norms)" in out  # the norms themselves are intact
    code, out = _validate(path)  # what the unmutated model says too: its norms agree with themselves
    assert code == 3, out
    assert "NOT VERIFIED" in out and "--source DIR" in out and "self-consistency (the graph's own spec)" in out, out
