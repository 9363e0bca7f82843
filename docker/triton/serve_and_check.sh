#!/usr/bin/env bash
# Serve a model repository written by `rmsnorm-deploy triton-repo` with the standalone Triton
# Inference Server (the NGC tritonserver image, native onnxruntime/tensorrt backends), then run
# the parity client against it over HTTP and gRPC. Needs Docker (and, for --gpus, the NVIDIA
# container toolkit); it cannot run on a machine without a Docker engine.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: serve_and_check.sh REPO [MODEL_NAME] [OPTIONS]

  REPO         the model repository folder (rmsnorm-deploy triton-repo MODEL -o REPO)
  MODEL_NAME   the model in it to load and check (default: model)

Options:
  --source PATH  the ONNX model to compare with (default: REPO/MODEL_NAME/1/model.onnx; give the
                 engine's source model for a TensorRT repository)
  --gpus         run the server with every GPU (docker run --gpus all)
  --keep         leave the server running after the check (stop it with: docker stop NAME)
  -h, --help     print this help

Environment: TRITON_IMAGE (default nvcr.io/nvidia/tritonserver:24.10-py3, Triton 2.51 as in
PyTriton 0.7), PYTHON (runs the parity client; default python3, with rmsnorm-deploy[serve]),
HTTP_PORT/GRPC_PORT/METRICS_PORT (default 8000/8001/8002, published on 127.0.0.1 only),
READY_TIMEOUT (seconds, default 120).

Exit codes: 0 parity passed; 1 parity failed; 2 bad input, or the server did not become ready.
USAGE
}

repo=""
model="model"
source=""
gpus=()
keep=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --source) source="${2:?--source needs a path}"; shift 2 ;;
        --gpus) gpus=(--gpus all); shift ;;
        --keep) keep=1; shift ;;
        -*) echo "serve_and_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *)
            if [[ -z "$repo" ]]; then repo="$1"; else model="$1"; fi
            shift ;;
    esac
done
if [[ -z "$repo" || ! -d "$repo" ]]; then
    echo "serve_and_check.sh: give the repository folder written by rmsnorm-deploy triton-repo (see --help)" >&2
    exit 2
fi
repo="$(cd "$repo" && pwd)"
if [[ ! -f "$repo/$model/config.pbtxt" ]]; then
    echo "serve_and_check.sh: $repo/$model/config.pbtxt not found; write it with rmsnorm-deploy triton-repo" >&2
    exit 2
fi
source="${source:-$repo/$model/1/model.onnx}"
backend="onnxruntime"
if grep -q 'backend: "tensorrt"' "$repo/$model/config.pbtxt"; then
    backend="tensorrt"
fi
if [[ ! -f "$source" ]]; then
    echo "serve_and_check.sh: no ONNX model to compare with at $source; pass --source" >&2
    exit 2
fi

image="${TRITON_IMAGE:-nvcr.io/nvidia/tritonserver:24.10-py3}"
python="${PYTHON:-python3}"
http_port="${HTTP_PORT:-8000}"
grpc_port="${GRPC_PORT:-8001}"
metrics_port="${METRICS_PORT:-8002}"
timeout_s="${READY_TIMEOUT:-120}"
name="rmsnorm-deploy-triton-$$"

stop_server() {
    if [[ "$keep" -eq 0 ]]; then
        docker stop "$name" >/dev/null 2>&1 || true
    fi
}
trap stop_server EXIT

# Ports are published on 127.0.0.1 only: a model server is not exposed by accident.
docker run -d --rm --name "$name" "${gpus[@]}" --shm-size 1g \
    -p "127.0.0.1:${http_port}:8000" -p "127.0.0.1:${grpc_port}:8001" -p "127.0.0.1:${metrics_port}:8002" \
    -v "$repo:/models:ro" "$image" \
    tritonserver --model-repository=/models --model-control-mode=explicit --load-model="$model" \
    --exit-on-error=true --strict-readiness=true >/dev/null

echo "waiting for Triton ($image) to load $model ..."
deadline=$((SECONDS + timeout_s))
until curl -sf "http://127.0.0.1:${http_port}/v2/models/${model}/ready" >/dev/null; do
    if ! docker inspect "$name" >/dev/null 2>&1; then
        echo "serve_and_check.sh: the server exited; its log is gone with the container (rerun with --keep)" >&2
        exit 2
    fi
    if (( SECONDS > deadline )); then
        echo "serve_and_check.sh: $model not ready within ${timeout_s} s; the server's log:" >&2
        docker logs "$name" 2>&1 | tail -n 30 >&2
        exit 2
    fi
    sleep 1
done
echo "ready: http://127.0.0.1:${http_port}/v2/models/${model}, grpc 127.0.0.1:${grpc_port}"

"$python" -m rmsnorm_deploy.serving.kserve.served_answers "$source" --model-name "$model" --backend "$backend" \
    --http "127.0.0.1:${http_port}" --grpc "127.0.0.1:${grpc_port}"
