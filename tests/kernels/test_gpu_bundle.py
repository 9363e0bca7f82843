"""benchmarks/gpu_bundle.py (``make gpu-wheels`` here, ``stage``/``install`` on the GPU host): the whole
trip on small synthetic wheels with tiny parts, and every way a transfer or a manifest can go wrong.
The real download is not run here (it fetches ~450 MB); its pins are checked against the repo's."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import random
import re
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_bundle.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_bundle", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_bundle = _load()
PART = 2048  # bytes: the synthetic bundle spans several parts


def _wheel(folder: Path, name: str, version: str, payload: bytes) -> Path:
    """A minimal valid wheel (pip installs it) with a RECORD, its module holding ``payload``."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b"VALUE = " + repr(payload).encode() + b"\n",
        f"{name}/blob.bin": payload,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for path, data in files.items()) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for member, data in [*files.items(), (f"{dist}/RECORD", record.encode())]:
            z.writestr(member, data)
    return path


@pytest.fixture
def bundle(tmp_path):
    """Two synthetic wheels packed into parts of PART bytes in ``out``; the host's folders beside it."""
    src = tmp_path / "download"
    src.mkdir()
    payload = bytes(range(256)) + random.Random(0).randbytes(5000)  # mostly incompressible: several parts
    wheels = [("ort", gpu_bundle.Pin("alpha", "1.0", ""), _wheel(src, "alpha", "1.0", payload)),
              ("serve", gpu_bundle.Pin("beta", "2.0", ""), _wheel(src, "beta", "2.0", hashlib.sha256(payload).digest() * 200))]
    out = tmp_path / "out"
    manifest = gpu_bundle.pack(wheels, out, part_bytes=PART, tags={"python": "3.12"}, pinned=False,
                               preset=1)
    return {"out": out, "stage": tmp_path / "stage", "manifest": manifest, "tmp": tmp_path}


def _main(bundle, command, *extra):
    return gpu_bundle.main([command, "--parts-dir", str(bundle["out"]), "--stage-dir", str(bundle["stage"]), *extra])


def _rewrite_manifest(bundle, change):
    path = bundle["out"] / gpu_bundle.MANIFEST
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_the_bundle_is_split_into_parts_no_larger_than_asked(bundle):
    m = bundle["manifest"]
    parts = sorted(p.name for p in bundle["out"].glob("gpu-wheels.part*"))
    assert parts == [p["name"] for p in m["parts"]] and len(parts) >= 3
    assert all(p["bytes"] <= PART for p in m["parts"]) and sum(p["bytes"] for p in m["parts"]) == m["whole"]["bytes"]
    assert [w["name"] for w in m["wheels"]] == ["alpha", "beta"] and not m["pinned"]
    joined = b"".join((bundle["out"] / p).read_bytes() for p in parts)
    assert hashlib.sha256(joined).hexdigest() == m["whole"]["sha256"]


def test_stored_wheels_keep_every_member_and_the_tar_is_reproducible(bundle, tmp_path):
    alpha = next((bundle["tmp"] / "download").glob("alpha-*.whl"))
    stored = tmp_path / "stored.whl"
    gpu_bundle.stored_wheel(alpha, stored)
    with zipfile.ZipFile(alpha) as a, zipfile.ZipFile(stored) as b:
        assert [i.filename for i in a.infolist()] == [i.filename for i in b.infolist()]
        assert all(a.read(n) == b.read(n) for n in a.namelist())
        assert {i.compress_type for i in b.infolist()} == {zipfile.ZIP_STORED}
    again = gpu_bundle.pack([("ort", gpu_bundle.Pin("alpha", "1.0", ""), alpha)], tmp_path / "a", part_bytes=PART,
                            tags={}, pinned=False, preset=1)
    twice = gpu_bundle.pack([("ort", gpu_bundle.Pin("alpha", "1.0", ""), alpha)], tmp_path / "b", part_bytes=PART,
                            tags={}, pinned=False, preset=1)
    assert again["tar"] == twice["tar"]


def test_a_wheel_whose_member_does_not_match_its_record_is_refused(tmp_path):
    wheel = _wheel(tmp_path, "gamma", "1.0", b"payload")
    with zipfile.ZipFile(wheel) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members["gamma/blob.bin"] = b"tampered"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    with pytest.raises(gpu_bundle.BundleError, match="gamma/blob.bin does not match the wheel's RECORD"):
        gpu_bundle.stored_wheel(wheel, tmp_path / "out.whl")


@pytest.mark.slow
def test_parts_arriving_one_by_one_are_staged_then_installed(bundle, capsys, monkeypatch):
    """The host's sequence: one part per transfer (the others not yet there), then install: the one
    real ``pip install --target`` (~3-20 s: a pip subprocess), which the GPU host runs the same way."""
    arrivals = bundle["tmp"] / "arrivals"
    arrivals.mkdir()
    names = [p["name"] for p in bundle["manifest"]["parts"]]
    (arrivals / gpu_bundle.MANIFEST).write_bytes((bundle["out"] / gpu_bundle.MANIFEST).read_bytes())
    for i, name in enumerate(names):
        for old in arrivals.glob("gpu-wheels.part*"):
            old.unlink()  # a transfer that carries only the next part
        (arrivals / name).write_bytes((bundle["out"] / name).read_bytes())
        assert gpu_bundle.main(["stage", "--parts-dir", str(arrivals), "--stage-dir", str(bundle["stage"])]) == 0
        text = capsys.readouterr().out
        assert f"{i + 1} of {len(names)} part(s) staged" in text
        if i + 1 < len(names):
            assert f"still missing: {', '.join(names[i + 1:])}" in text
    monkeypatch.setattr(gpu_bundle, "nvidia_library_dirs", lambda: ([Path("/opt/nv/cu13/lib")], []))
    assert gpu_bundle.main(["install", "--parts-dir", str(arrivals), "--stage-dir", str(bundle["stage"])]) == 0
    site = bundle["stage"] / "site"
    assert (site / "alpha" / "blob.bin").read_bytes().startswith(bytes(range(256)))
    assert (site / "beta" / "__init__.py").is_file() and (site / "alpha-1.0.dist-info").is_dir()
    env = (bundle["stage"] / "env.sh").read_text()
    assert f"export PYTHONPATH={site}\"${{PYTHONPATH:+:$PYTHONPATH}}\"" in env
    assert "export LD_LIBRARY_PATH=/opt/nv/cu13/lib\"${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}\"" in env
    assert "installed 2 wheel(s)" in capsys.readouterr().out
    assert gpu_bundle.main(["install", "--parts-dir", str(arrivals), "--stage-dir", str(bundle["stage"])]) == 0
    assert "already holds this bundle" in capsys.readouterr().out


def test_a_missing_part_is_named_and_install_refuses(bundle, capsys):
    missing = bundle["manifest"]["parts"][1]["name"]
    (bundle["out"] / missing).unlink()
    assert _main(bundle, "stage") == 0
    assert f"still missing: {missing}" in capsys.readouterr().out
    assert _main(bundle, "install") == 1
    assert f"missing part(s): {missing}; transfer them" in capsys.readouterr().err
    assert not (bundle["stage"] / "site").exists()


def test_a_corrupt_part_is_named_and_not_staged(bundle, capsys):
    bad = bundle["manifest"]["parts"][0]["name"]
    data = bytearray((bundle["out"] / bad).read_bytes())
    data[100] ^= 0xFF
    (bundle["out"] / bad).write_bytes(bytes(data))
    assert _main(bundle, "stage") == 1
    err = capsys.readouterr().err
    assert re.search(rf"corrupt part\(s\), send them again: {re.escape(bad)} \(sha256 \w+\.\.\., the manifest says", err)
    assert not (bundle["stage"] / bad).exists()
    (bundle["out"] / bad).write_bytes(b"short")
    assert _main(bundle, "install") == 1
    assert f"{bad} (5 bytes, the manifest says" in capsys.readouterr().err


def test_a_manifest_whose_whole_lies_is_caught_after_the_join(bundle, capsys):
    _rewrite_manifest(bundle, lambda m: m["whole"].update(sha256="0" * 64))
    assert _main(bundle, "install") == 1
    assert "is not the whole the manifest describes although every part matched" in capsys.readouterr().err


def test_a_manifest_that_lies_about_a_wheel_or_the_tar_is_caught(bundle, capsys):
    _rewrite_manifest(bundle, lambda m: m["wheels"][0].update(stored_sha256="1" * 64))
    assert _main(bundle, "install") == 1
    assert "alpha-1.0-py3-none-any.whl: sha256 differs from the manifest's stored_sha256" in capsys.readouterr().err
    _rewrite_manifest(bundle, lambda m: m["wheels"][0].update(file="other-1.0-py3-none-any.whl"))
    assert _main(bundle, "install", "--force") == 1
    assert "holds 'alpha-1.0-py3-none-any.whl', which the manifest does not list" in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    (lambda m: m["parts"][0].update(name="../../etc/evil"), "'../../etc/evil' is not a plain file name"),
    (lambda m: m["parts"][0].update(name="/tmp/evil"), "'/tmp/evil' is not a plain file name"),
    (lambda m: m["whole"].update(name="sub/whole.tar.xz"), "'sub/whole.tar.xz' is not a plain file name"),
    (lambda m: m["wheels"][0].update(file="../x.whl"), "a wheel entry is not a plain .whl name"),
    (lambda m: m["parts"][0].update(bytes=m["parts"][0]["bytes"] + 1), "the parts add up to"),
    (lambda m: m["parts"][0].update(bytes=2**30), "is not from 1 to 67108864 bytes"),
    (lambda m: m["parts"][1].update(name=m["parts"][0]["name"]), "part names repeat or collide"),
    (lambda m: m["parts"][0].update(sha256="abc"), "'abc' is not a sha256"),
    (lambda m: m.update(format=99), "not a format-1 bundle manifest"),
])
def test_a_manifest_that_cannot_be_right_is_refused_before_anything_is_written(bundle, capsys, change, message):
    _rewrite_manifest(bundle, change)
    assert _main(bundle, "stage") == 2
    assert message in capsys.readouterr().err
    assert not bundle["stage"].exists()


def test_no_manifest_says_to_carry_it(tmp_path, capsys):
    assert gpu_bundle.main(["stage", "--parts-dir", str(tmp_path), "--stage-dir", str(tmp_path / "s")]) == 2
    assert f"carry {gpu_bundle.MANIFEST} with the parts" in capsys.readouterr().err


def test_a_new_bundle_replaces_the_parts_of_an_old_one(bundle, tmp_path, capsys):
    assert _main(bundle, "stage") == 0
    alpha = next((bundle["tmp"] / "download").glob("alpha-*.whl"))
    gpu_bundle.pack([("ort", gpu_bundle.Pin("alpha", "1.0", ""), alpha)], bundle["out"], part_bytes=PART * 64,
                    tags={}, pinned=False, preset=1)
    capsys.readouterr()
    assert _main(bundle, "stage") == 0
    out = capsys.readouterr().out
    assert "held the parts of another bundle: starting over" in out and "1 of 1 part(s) staged" in out
    assert sorted(p.name for p in bundle["stage"].glob("gpu-wheels.part*")) == ["gpu-wheels.part01"]


def test_the_nvidia_library_folders_are_found_in_site_packages(tmp_path):
    site = tmp_path / "site-packages"
    for lib in ("nvidia/cu13/lib/libcublas.so.13", "nvidia/cu13/lib/libcudart.so.13", "nvidia/cudnn/lib/libcudnn.so.9",
                "nvidia/nccl/lib/libnccl.so.2"):
        (site / lib).parent.mkdir(parents=True, exist_ok=True)
        (site / lib).write_bytes(b"")
    dirs, missing = gpu_bundle.nvidia_library_dirs([str(site), str(tmp_path / "absent")])
    assert dirs == [site / "nvidia/cu13/lib", site / "nvidia/cudnn/lib"]
    assert "libcublasLt.so.13" in missing and "libcudnn.so.9" not in missing and "libcublas.so.13" not in missing


def test_each_transfer_fits_with_the_working_tree(bundle):
    tree = gpu_bundle.working_tree_bytes()
    assert 0 < tree < 32 * gpu_bundle.MIB
    plan = gpu_bundle.transfer_plan(bundle["manifest"], bundle["out"], tree)
    assert len(plan) == len(bundle["manifest"]["parts"])
    assert all("python3 benchmarks/gpu_bundle.py stage" in line for line in plan[:-1])
    assert plan[-1].endswith("python3 benchmarks/gpu_bundle.py install && . /tmp/rmsnorm-deploy-gpu-wheels/env.sh && "
                             "make gpu-check PYTHON=python3")
    assert gpu_bundle.PART_MIB * gpu_bundle.MIB + tree < gpu_bundle.TRANSFER_BYTES


def test_pack_refuses_other_tags_without_unpinned_and_parts_too_large(capsys):
    assert gpu_bundle.main(["pack", "--python-version", "3.11"]) == 2
    assert "for other tags add --unpinned" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_bundle.parse_args(["pack", "--part-mib", "64"])
    assert gpu_bundle.main(["pack", "--groups", "ort,cuda"]) == 2
    assert "unknown group(s) ['cuda']" in capsys.readouterr().err


def test_platform_tags_cover_every_manylinux_the_host_runs():
    tags = gpu_bundle.platform_tags("2.39", "x86_64")
    assert tags[0] == "manylinux_2_39_x86_64" and "manylinux_2_35_x86_64" in tags and "manylinux_2_5_x86_64" in tags
    assert tags[-4:] == ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "any"]


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9._-]+)==([^\s#;]+)", line.strip())
        if m:
            pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


def test_the_bundle_pins_the_versions_the_repo_pins():
    """One version per package: constraints.txt (the CPU CI) and the GPU image's requirements win;
    onnxruntime-genai-cuda is the CUDA build of the pinned onnxruntime-genai."""
    repo = {**_pins(REPO / "constraints.txt"), **_pins(REPO / "docker" / "requirements-gpu.txt")}
    repo["onnxruntime-genai-cuda"] = repo["onnxruntime-genai"]
    pins = [p for group in gpu_bundle.GROUPS.values() for p in group]
    differ = [f"{p.name} {p.version} vs {repo[p.name.replace('.', '-').lower()]}" for p in pins
              if p.name.replace(".", "-").lower() in repo and repo[p.name.replace(".", "-").lower()] != p.version]
    assert differ == []
    assert {p.name for p in gpu_bundle.GROUPS["ort"]} == {"onnxruntime-gpu", "onnxruntime-genai-cuda"}
    assert all(re.fullmatch(r"[0-9a-f]{64}", p.sha256) for p in pins)


def test_make_gpu_wheels_packs_into_the_ignored_folder():
    text = (REPO / "Makefile").read_text()
    assert re.search(r"^gpu-wheels:\n\t\$\(PYTHON\) benchmarks/gpu_bundle.py pack \$\(GPU_WHEELS_ARGS\)", text, re.M)
    assert "/.gpu-wheels/" in (REPO / ".gitignore").read_text().splitlines()
