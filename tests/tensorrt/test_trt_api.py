"""Every TensorRT name rmsnorm_deploy/tensorrt uses exists, checked without TensorRT.

TensorRT cannot run here, so a misspelt ``trt.BuilderFlag.X`` or a name TensorRT 11 removed would
first fail on a GPU. The code is read (its AST, not imported) for every ``trt.A.B`` chain (aliases
such as ``severity = trt.ILogger.Severity`` followed), every ``trtp.X`` (``tensorrt.plugin``), every
``getattr``/``hasattr`` of a literal name on them, and the network-creation flags the plugin names;
each is resolved against TensorRT 10.13's stubs (``tensorrt-stubs``) and the pure-Python
``tensorrt.plugin`` of the 10.13 bindings, as ``make typecheck-tensorrt`` installs them into
``.venv-lint/trt-stubs`` (docker/requirements-typecheck.txt). A name read through
``getattr(..., default)``/``hasattr`` is guarded (the code copes without it); every other name must
exist, and none may be one TensorRT 11 removed (:data:`REMOVED_IN_11`). mypy checks the calls on the
typed objects (``make typecheck-tensorrt``); this test checks the module-level names mypy sees as Any.
"""

from __future__ import annotations

import ast
import os
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "rmsnorm_deploy" / "tensorrt"
STUBS = Path(os.environ.get("RMSNORM_DEPLOY_TRT_STUBS", REPO / ".venv-lint" / "trt-stubs"))
BINDINGS = STUBS / "tensorrt_bindings" / "tensorrt.pyi"
PLUGIN = STUBS / "tensorrt_bindings" / "plugin"

#: Python APIs TensorRT 11.x removed ("Removed Python APIs and Replacements", TensorRT 11 migration guide):
#: weak typing's precision flags, implicit quantization (calibrators, dynamic ranges, quantization flags)
#: and the algorithm selector. Our networks are strongly typed and quantized, if at all, by Q/DQ nodes.
REMOVED_IN_11 = frozenset({
    "BuilderFlag.FP16", "BuilderFlag.BF16", "BuilderFlag.INT8", "BuilderFlag.FP8", "BuilderFlag.INT4",
    "BuilderFlag.FP4", "BuilderFlag.OBEY_PRECISION_CONSTRAINTS", "BuilderFlag.PREFER_PRECISION_CONSTRAINTS",
    "BuilderFlag.DIRECT_IO", "IBuilderConfig.int8_calibrator", "IBuilderConfig.set_calibration_profile",
    "IBuilderConfig.get_calibration_profile", "IBuilderConfig.set_quantization_flag",
    "IBuilderConfig.get_quantization_flag", "IBuilderConfig.quantization_flags",
    "IBuilderConfig.clear_quantization_flag", "IBuilderConfig.algorithm_selector", "IInt8Calibrator",
    "IInt8EntropyCalibrator", "IInt8EntropyCalibrator2", "IInt8MinMaxCalibrator", "IInt8LegacyCalibrator",
    "CalibrationAlgoType", "QuantizationFlag", "IAlgorithm", "IAlgorithmContext", "IAlgorithmIOInfo",
    "IAlgorithmSelector", "IAlgorithmVariant", "Builder.platform_has_fast_fp16", "Builder.platform_has_fast_int8",
    "ITensor.set_dynamic_range", "ITensor.dynamic_range", "ICudaEngine.device_memory_size",
})
#: Names that exist in 10.13 and that the code may use only behind a version check: deprecated in 11.x
#: (``STRONGLY_TYPED``: every network is strongly typed, the flag is ignored).
VERSION_GUARDED = frozenset({"NetworkDefinitionCreationFlag.STRONGLY_TYPED"})

if not BINDINGS.is_file():
    pytest.skip(f"TensorRT's stubs are not installed ({BINDINGS} is missing): run `make typecheck-tensorrt`, "
                "which installs them (CI does)", allow_module_level=True)


# -- what the stubs define ---------------------------------------------------------------------
def _class_members(tree: ast.Module) -> dict[str, tuple[set[str], list[str], dict[str, ast.ClassDef]]]:
    """Class name -> (member names, base names, nested classes), for the top-level classes of a stub."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = _members_of(node)
    return out


def _members_of(node: ast.ClassDef) -> tuple[set[str], list[str], dict[str, ast.ClassDef]]:
    names, nested = set(), {}
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(item.name)
        elif isinstance(item, ast.ClassDef):
            names.add(item.name)
            nested[item.name] = item
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
        elif isinstance(item, ast.Assign):
            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
    bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
    return names, bases, nested


def _top_level(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _parse(path: Path) -> ast.Module:
    """A third-party source's AST (its invalid string escapes warn on 3.12: not ours to fix)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
        return ast.parse(path.read_text())


def _public_plugin_api() -> set[str]:
    """What ``tensorrt.plugin`` exports: its modules mark each name with ``@public_api()`` (or
    ``public_api(symbol=...)``), which adds it to the package when the module is imported."""
    names = set()
    for path in PLUGIN.glob("*.py"):
        for node in ast.walk(_parse(path)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                for deco in node.decorator_list:
                    if isinstance(deco, ast.Call) and getattr(deco.func, "id", "") == "public_api":
                        names.add(_symbol(deco) or node.name)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Call) \
                    and getattr(node.func.func, "id", "") == "public_api" and _symbol(node.func):
                names.add(_symbol(node.func))
    return names


def _symbol(call: ast.Call) -> str | None:
    return next((k.value.value for k in call.keywords if k.arg == "symbol" and isinstance(k.value, ast.Constant)), None)


class Api:
    """TensorRT 10.13's public names as the stubs declare them."""

    def __init__(self) -> None:
        bindings = _parse(BINDINGS)
        self.classes = _class_members(bindings)
        self.top = _top_level(_parse(STUBS / "tensorrt" / "__init__.pyi")) | _top_level(bindings)
        self.plugin = _public_plugin_api()

    def has(self, path: str) -> bool:
        """Whether ``A.B.C`` resolves: A at the top, B a member of class A (or its bases), C of nested B."""
        first, *rest = path.split(".")
        if first not in self.top:
            return False
        members = self._members(first)
        for name in rest:
            if members is None:  # a member that is not a class (a method, a value): no further check possible
                return True
            if name.startswith("__") and name.endswith("__"):
                return True  # object's own (__init__, __version__ handled at the top)
            if name not in members[0]:
                return False
            members = _members_of(members[2][name]) if name in members[2] else None
        return True

    def _members(self, cls: str) -> tuple[set[str], list[str], dict[str, ast.ClassDef]] | None:
        if cls not in self.classes:
            return None
        names, bases, nested = self.classes[cls]
        names, nested = set(names), dict(nested)
        for base in bases:
            inherited = self._members(base)
            if inherited:
                names |= inherited[0]
                nested.update(inherited[2])
        return names, bases, nested


# -- what the code uses ------------------------------------------------------------------------
def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def used_names(source: str) -> tuple[set[str], set[str], set[str]]:
    """(``trt`` names used directly, ``trt`` names read guarded, ``trtp`` names) of one module's code."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):  # severity = trt.ILogger.Severity; enum = trt.NetworkDefinitionCreationFlag
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            chain = _chain(node.value)
            if chain and chain[0] == "trt" and len(chain) > 1:
                aliases[node.targets[0].id] = ".".join(chain[1:])
    direct, guarded, plugin = set(), set(), set()

    def resolve(chain: list[str]) -> tuple[str, list[str]] | None:
        if chain[0] in ("trt", "trtp"):
            return chain[0], chain[1:]
        if chain[0] in aliases:
            return "trt", [*aliases[chain[0]].split("."), *chain[1:]]
        return None

    guarded_nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            chain = _chain(node.args[0])
            found = resolve(chain) if chain else None
            if found is None:
                continue
            root, path = found
            name = ".".join([*path, node.args[1].value])
            safe = node.func.id == "hasattr" or len(node.args) == 3
            (plugin if root == "trtp" else guarded if safe else direct).add(name)
            guarded_nodes.add(id(node.args[0]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in guarded_nodes:
            chain = _chain(node)
            found = resolve(chain) if chain else None
            if found and found[1]:
                (plugin if found[0] == "trtp" else direct).add(".".join(found[1]))
    # drop prefixes: trt.ILogger.Severity counts once, as its longest use
    direct = {n for n in direct if not any(o.startswith(n + ".") for o in direct)}
    return direct, guarded, plugin


def _code_usage() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, set[str]]]:
    direct, guarded, plugin = {}, {}, {}
    for path in sorted(PACKAGE.glob("*.py")):
        d, g, p = used_names(path.read_text())
        for name in d:
            direct.setdefault(name, set()).add(path.name)
        for name in g:
            guarded.setdefault(name, set()).add(path.name)
        for name in p:
            plugin.setdefault(name, set()).add(path.name)
    from rmsnorm_deploy.tensorrt.plugin import _NETWORK_FLAGS

    for flags in _NETWORK_FLAGS.values():  # set by plugin.PluginInfo.network_flag_bits without a default
        for flag in flags:
            direct.setdefault(f"NetworkDefinitionCreationFlag.{flag}", set()).add("plugin.py (_NETWORK_FLAGS)")
    return direct, guarded, plugin


API = Api()
DIRECT, GUARDED, PLUGIN_USED = _code_usage()


def test_the_scan_sees_the_names_the_builder_and_runner_use():
    """A scan that finds nothing proves nothing: the well-known names are among those found."""
    for name in ("Builder", "OnnxParser", "Runtime", "MemoryPoolType.WORKSPACE", "ProfilingVerbosity.DETAILED",
                 "LayerInformationFormat.JSON", "TensorIOMode.INPUT", "ILogger.Severity.ERROR", "bfloat16",
                 "NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS"):
        assert name in DIRECT, sorted(DIRECT)
    assert "NetworkDefinitionCreationFlag.STRONGLY_TYPED" in GUARDED and "init_libnvinfer_plugins" in GUARDED
    assert {"register", "impl", "aot_impl", "TensorDesc", "KernelLaunchParams"} <= set(PLUGIN_USED)


@pytest.mark.parametrize("name", sorted(DIRECT))
def test_every_trt_name_used_exists_in_tensorrt_10_13(name):
    assert API.has(name), f"trt.{name} (used in {', '.join(sorted(DIRECT[name]))}) is not in TensorRT 10.13's stubs"


@pytest.mark.parametrize("name", sorted(PLUGIN_USED))
def test_every_tensorrt_plugin_name_used_exists_in_10_13(name):
    assert name.split(".")[0] in API.plugin, (f"trtp.{name} (used in {', '.join(sorted(PLUGIN_USED[name]))}) is not "
                                              "in TensorRT 10.13's tensorrt.plugin")


def test_no_name_tensorrt_11_removed_is_used_and_deprecated_ones_only_behind_a_version_check():
    used = set(DIRECT) | set(GUARDED)
    assert sorted(used & REMOVED_IN_11) == []
    assert sorted((set(DIRECT) & VERSION_GUARDED)) == []  # read with getattr(..., None) and TensorRT's major version
    from rmsnorm_deploy.tensorrt.build import network_flags

    source = ast.get_source_segment(PACKAGE.joinpath("build.py").read_text(),
                                    next(n for n in ast.walk(ast.parse(PACKAGE.joinpath("build.py").read_text()))
                                         if isinstance(n, ast.FunctionDef) and n.name == network_flags.__name__))
    assert '"STRONGLY_TYPED"' in source and "< 11" in source


def test_the_removed_names_are_real_10_13_names():
    """The table names what 10.13 has (else it would guard nothing): each resolves in the stubs."""
    assert [n for n in sorted(REMOVED_IN_11 | VERSION_GUARDED) if not API.has(n)] == []
    assert not API.has("BuilderFlag.NO_SUCH_FLAG") and not API.has("NoSuchClass")


def test_the_scan_catches_a_misspelt_or_removed_name():
    direct, guarded, _ = used_names("def f(trt):\n    c = trt.BuilderFlag\n    return c.FP16, trt.Buildr, "
                                    "getattr(trt.BuilderFlag, 'BF16', None)\n")
    assert direct == {"BuilderFlag.FP16", "Buildr"} and guarded == {"BuilderFlag.BF16"}
    assert not API.has("Buildr") and "BuilderFlag.FP16" in REMOVED_IN_11
