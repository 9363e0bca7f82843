"""Shared test settings: the Hypothesis profile, Triton's interpreter where there is no GPU, and
which tests share one pytest-xdist worker.

Hypothesis is a test extra; the GPU check (``benchmarks/gpu_check.py``) runs the kernel tests on
machines that may lack it, so its profile is registered only where it is installed.
"""

from __future__ import annotations

import os

import pytest

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # only the tests that use it need it, and they import it themselves
    settings = None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# Triton chooses between compiling and interpreting when `triton` is first imported (its
# own tl.sum, tl.max... are @triton.jit functions decorated then), so the choice is made
# here, before any test module imports it: without a GPU, the Triton kernel tests run in
# the interpreter. Each pytest-xdist worker imports this file first, so each gets it.
if "TRITON_INTERPRET" not in os.environ and not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"

if settings is not None:
    settings.register_profile(
        "ci",
        deadline=None,
        max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "60")),
        suppress_health_check=[HealthCheck.too_slow],
        derandomize=True,
    )
    settings.load_profile("ci")


#: Fixtures whose work is made once per run under a file lock (``tests/real_weights.py``). Their tests
#: run in two groups, one per pytest-xdist worker (``make test`` passes ``--dist loadgroup``): the plain
#: export with the copies that plant defects in it, and the KV-cache exports. Neither worker waits on a
#: lock for an export the other is making, and both groups start first, so neither is the last to run.
REAL_WEIGHTS_FIXTURES = frozenset({"real_weights", "real_plain_base"})


def _real_weights_group(item) -> str:
    callspec = getattr(item, "callspec", None)
    plain = "real_plain_base" in item.fixturenames or (callspec is not None and callspec.params.get("kind") == "plain")
    return "real-weights-plain" if plain else "real-weights-kv-cache"


#: Module fixtures that export a model (seconds each): their tests share one worker, which exports once.
ONE_WORKER_FIXTURES = {"tiny_preset": "tiny-preset-exports"}
#: The modules that use ``tests.kv_models.exported_kv`` (each family exported once per process, 5-10 s
#: each) share one worker, which exports each once: spread over both, most families were exported twice.
KV_MODELS_GROUP = "tiny-kv-models"


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):  # one process: nothing to group (and no such marker)
        return
    for item in items:
        names = getattr(item, "fixturenames", ())
        if REAL_WEIGHTS_FIXTURES.intersection(names):
            item.add_marker(pytest.mark.xdist_group(_real_weights_group(item)))
        for name, group in ONE_WORKER_FIXTURES.items():
            if name in names:
                item.add_marker(pytest.mark.xdist_group(group))
        if getattr(getattr(item, "module", None), "exported_kv", None) is not None:
            item.add_marker(pytest.mark.xdist_group(KV_MODELS_GROUP))


@pytest.fixture(scope="session")
def real_weights(tmp_path_factory):
    """Real SmolLM2-135M-Instruct and its exports (``tests/real_weights.py``), shared by the xdist workers."""
    from tests.made_once import shared_root
    from tests.real_weights import RealWeights

    return RealWeights(shared_root(tmp_path_factory) / "real-weights")


@pytest.fixture(scope="session")
def real_plain_base(real_weights, tmp_path_factory):
    """The real plain export with its weights moved once into an external data file, which the graphs
    with planted defects beside it share (``tests/real_mutations.py``)."""
    from tests.real_mutations import external_base

    export = real_weights.export("plain")
    assert export.exit_code == 0, export.output
    return external_base(export.model, export.folder / "report.json", real_weights.hf_folder(),
                         tmp_path_factory.mktemp("real-plain-base"))
