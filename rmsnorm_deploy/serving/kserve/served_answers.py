"""Served answers checked: a served model's answers over KServe v2 (HTTP and gRPC) against the same ONNX
model run here in ONNX Runtime.

For any Triton serving our export: the embedded server (``serve``) or the standalone one with a
repository from ``triton-repo`` (``docker/triton/serve_and_check.sh`` runs it against the NGC
image). Inputs are made from the model's own metadata (token ids below the vocabulary size) and
a few shapes (batch 1 and 3, odd sequence lengths). The tolerance is the table's ``backends``
entry for the serving backend and dtype (``contract/tolerances.py``); ``--exact`` demands equal
bits (the embedded server runs the very session this client compares with).

    python -m rmsnorm_deploy.serving.kserve.served_answers MODEL.onnx --http 127.0.0.1:8000 --grpc 127.0.0.1:8001
        [--model-name model] [--backend onnxruntime|tensorrt] [--exact]

Exit 0 when every answer passes, 1 when one does not, 2 on bad input or an unreachable server.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.tolerances import tolerance_for
from rmsnorm_deploy.errors import UserError, one_line
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner
from rmsnorm_deploy.serving.kserve.signature import Signature, model_path, read_signature
from rmsnorm_deploy.table import format_table

#: (rows, sequence) of each request; odd sizes on purpose
SHAPES = ((1, 1), (1, 7), (3, 19))


def feeds(signature: Signature, token_high: dict[str, int], *, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """One feed per shape in :data:`SHAPES`: token ids in ``[0, high)``, activations in [-2, 2]."""
    if signature.is_kv_cache:
        raise UserError("the parity client checks stateless models; a KV-cache model needs a sequence client")
    rng = np.random.default_rng(seed)
    out = []
    for rows, seq in SHAPES:
        feed = {}
        for t in signature.inputs:
            shape = []
            for i, d in enumerate(t.shape):
                if isinstance(d, int):
                    shape.append(d)
                elif i == 0 and signature.batched:
                    shape.append(rows)
                else:
                    shape.append(seq)
            if t.dtype.startswith("int"):
                feed[t.name] = rng.integers(0, token_high.get(t.name, 2), shape).astype(t.dtype)
            else:
                feed[t.name] = rng.uniform(-2, 2, shape).astype(t.dtype)
        out.append(feed)
    return out


def _client_call(protocol: str, url: str, model_name: str, signature: Signature):

    module = require(f"tritonclient.{protocol}", "the parity client")
    client = module.InferenceServerClient(url)

    def call(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = []
        for t in signature.inputs:
            inp = module.InferInput(t.name, list(feed[t.name].shape), t.kserve_type)
            inp.set_data_from_numpy(feed[t.name])
            inputs.append(inp)
        result = client.infer(model_name, inputs)
        return {t.name: result.as_numpy(t.name) for t in signature.outputs}
    return call


def check(model: str | Path, *, http: str | None, grpc: str | None, model_name: str = "model",
          backend: str = "onnxruntime", exact: bool = False, say=print) -> bool:
    """Compare every output of every feed over each given protocol; print a table; True if all pass."""
    import onnx


    path = model_path(model)
    signature = read_signature(path)
    meta = ModelMetadata.read(onnx.load(str(path), load_external_data=False))
    highs = {k: int(v["high"]) for k, v in (meta.inputs if meta else {}).items() if isinstance(v, dict) and "high" in v}
    protocols = [(p, u) for p, u in (("http", http), ("grpc", grpc)) if u]
    if not protocols:
        raise UserError("give --http and/or --grpc: where the server listens")
    rows, ok = [], True
    with OnnxRuntimeRunner(path) as runner:
        for feed in feeds(signature, highs):
            want = runner.infer(feed)
            for protocol, url in protocols:
                try:
                    got = _client_call(protocol, url, model_name, signature)(feed)
                except Exception as exc:  # noqa: BLE001 - a client error is a result to report
                    raise UserError(f"{protocol} {url}: request failed: {one_line(exc)}") from None
                for t in signature.outputs:
                    tol = tolerance_for("backends", backend, t.dtype)
                    result = compare(got[t.name], want[t.name], tol, name=t.name)
                    same_shape = got[t.name].shape == want[t.name].shape
                    passed = same_shape and (np.array_equal(got[t.name], want[t.name]) if exact else bool(result))
                    ok &= passed
                    shape = "x".join(str(d) for d in feed[signature.inputs[0].name].shape)
                    rows.append([protocol, t.name, shape, f"{result.max_abs:.3g}", "equal bits" if exact else
                                 f"atol={tol.atol:g} rtol={tol.rtol:g}", "pass" if passed else "FAIL"])
    say(format_table(["protocol", "output", "input shape", "max abs", "tolerance", "result"], rows))
    say(f"parity over KServe v2: {'PASS' if ok else 'FAIL'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rmsnorm_deploy.serving.kserve.served_answers",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the ONNX model the server serves (or the engine's source model)")
    parser.add_argument("--http", metavar="HOST:PORT")
    parser.add_argument("--grpc", metavar="HOST:PORT")
    parser.add_argument("--model-name", default="model")
    parser.add_argument("--backend", choices=("onnxruntime", "tensorrt"), default="onnxruntime",
                        help="what runs the model on the server: its row of the tolerance table")
    parser.add_argument("--exact", action="store_true", help="demand equal bits")
    args = parser.parse_args(argv)
    try:
        return 0 if check(args.model, http=args.http, grpc=args.grpc, model_name=args.model_name,
                          backend=args.backend, exact=args.exact) else 1
    except UserError as exc:
        print(f"served_answers: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
