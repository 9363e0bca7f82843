"""The export's own verdict on a real checkpoint catches every planted defect, and names it.

``export`` holds the graph it wrote to its source twice: the static contract of every norm (spec
field by field, precision, gains, the set of norms: ``exporter.norm_contract``) and the logits
against the source's float64 run (``exporter.parity``). Here that same check, with the same
expectations a real export of SmolLM2-135M-Instruct computes, runs on copies of the export with one
defect planted in each (``tests/real_mutations.py``): each must fail with a line naming it, and each
defect that changes numbers must also fail the float64 comparison on its own, by a wide margin
(the tolerance table's ``model_vs_float64`` ratio is 4; correct graphs measure 0.8-2.7).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rmsnorm_deploy.exporter.detect import detect_norms
from rmsnorm_deploy.exporter.parity import compare_with_onnxruntime, torch_expectations
from rmsnorm_deploy.exporter.plan import load_torch_model
from tests.real_mutations import STATIC_DEFECTS, Base, plant_swapped_layers

#: defects that move the logits: each must fail the float64 comparison by itself, by at least this factor.
#: Not the others: a gain applied before the cast back is the same float32 number, and ONNX Runtime's
#: optimizer removes the float32 -> float16 -> float32 Casts around the planted half-precision sum (what
#: it ran accumulates in float32, the parity's audit of the optimized graph shows), so only the static
#: contract, which reads the graph as written, sees those two.
NUMERIC_DEFECTS = ("epsilon", "offset gain", "dropped norm", "swapped layers")
NUMERIC_MARGIN = 10.0


@dataclasses.dataclass
class Source:
    expected: list
    detection: object


@pytest.fixture(scope="module")
def base(real_plain_base) -> Base:
    return real_plain_base


@pytest.fixture(scope="module")
def source(base) -> Source:
    """What the export computes on the PyTorch side: the source's norms and its runs in float32 and float64."""
    loaded = load_torch_model(str(base.hf), "float32")
    detection = detect_norms(loaded.module, dtype="float32")
    feed = {"input_ids": torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1552]], dtype=torch.int64)}
    return Source(torch_expectations(loaded.module, detection.norms, [feed], dtype="float32"), detection)


def _worst_ratio(parity) -> float:
    """The graph's distance from float64 over what the bound allows, the worst output."""
    return max(c.result.max_abs / max(c.result.tolerance.atol, 1e-30) for c in parity.comparisons if c.checked)


def test_the_real_export_passes_its_own_check_with_room(base, source):
    parity = compare_with_onnxruntime(base.folder / "model.onnx", source.expected, dtype="float32",
                                      detection=source.detection)
    assert parity.status == "pass", parity.table()
    assert parity.contract_compared == 61 and not parity.contract_mismatches
    assert _worst_ratio(parity) < 0.5, parity.table()


@pytest.mark.parametrize("defect", [*STATIC_DEFECTS, "swapped layers"])
def test_each_planted_defect_fails_the_export_check_naming_it(base, source, defect):
    model = base.graph()
    if defect == "swapped layers":
        plant_swapped_layers(model)
    else:
        STATIC_DEFECTS[defect][0](model)
    path = base.mutant(model, "export-check-" + defect.replace(" ", "-"))
    parity = compare_with_onnxruntime(path, source.expected, dtype="float32", detection=source.detection)
    assert parity.failed, parity.table()
    if defect == "swapped layers":  # every norm intact: the logits name it
        assert not parity.contract_mismatches
        assert parity.reason.startswith("onnxruntime[cpu] vs float64: logits"), parity.reason
    else:
        assert STATIC_DEFECTS[defect][1] in parity.contract_mismatches, parity.contract_mismatches
        assert parity.reason.startswith("norm contract: "), parity.reason
    if defect in NUMERIC_DEFECTS:
        assert _worst_ratio(parity) > NUMERIC_MARGIN, parity.table()
