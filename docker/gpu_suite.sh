#!/usr/bin/env bash
# rmsnorm-deploy's GPU parity suite: the default command of the Docker image (docker/README.md).
# Every step runs even when an earlier one failed, so one run reports everything; the summary at
# the end says which steps passed. Only a missing GPU stops the suite at once.
set -uo pipefail

usage() {
    cat <<'EOF'
Usage: gpu_suite.sh [OPTIONS] [-- PYTEST_ARGS...]

rmsnorm-deploy's GPU parity suite, the default command of the Docker image:
  1. env    print the environment (GPU, driver, CUDA, TensorRT, ONNX Runtime providers and
            whether the CUDA one loads, Triton, the TensorRT plugin) and save it as env.json;
            without a usable GPU the suite stops here with exit code 2
  2. tests  pytest -m "cuda or trt": every GPU and TensorRT test, with the reason of each skip;
            inside the image nothing may be skipped, so a skipped test fails this step
  3. e2e    export the tiny preset in float16 and bfloat16 with the function and the plugin
            lowerings; validate each on ONNX Runtime CPU and CUDA and on TensorRT (the plugin
            lowering also with our TensorRT plugin loaded), with normal and stress inputs,
            and print the parity tables
  4. bench  (only with --bench) the GPU kernel benchmark, benchmarks/gpu_kernel.py

Options:
  --results DIR    where logs, env.json, the JUnit report, exported models and parity tables
                   go (default: $RESULTS_DIR, else /results)
  --bench          also run the GPU kernel benchmark (step 4)
  --ort-tensorrt   also validate on ONNX Runtime's TensorRT execution provider
  --allow-skips    list skipped GPU tests without failing on them
  --skip-tests     leave out step 2
  --skip-e2e       leave out step 3
  --dry-run        print the command of every step and run none of them
  -h, --help       print this help
  -- ARGS          pass ARGS on to pytest (for example: -- -x -k plugin)

Environment: PYTHON, the interpreter that runs rmsnorm-deploy as "$PYTHON -m rmsnorm_deploy"
and pytest (default: python3).

Exit codes: 0 every step passed; 1 a step failed (a parity failure, a failed or skipped test,
an error); 2 no usable GPU, or a bad option.
EOF
}

die_usage() {
    echo "gpu_suite: $1 (see --help)" >&2
    exit 2
}

PYTHON="${PYTHON:-python3}"
SRC_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS="${RESULTS_DIR:-/results}"
BENCH=0
ORT_TENSORRT=0
ALLOW_SKIPS=0
RUN_TESTS=1
RUN_E2E=1
DRY_RUN=0
PYTEST_ARGS=()

while (($#)); do
    case "$1" in
        --results)
            (($# >= 2)) || die_usage "--results needs a folder"
            RESULTS="$2"
            shift 2
            ;;
        --results=*) RESULTS="${1#--results=}"; shift ;;
        --bench) BENCH=1; shift ;;
        --ort-tensorrt) ORT_TENSORRT=1; shift ;;
        --allow-skips) ALLOW_SKIPS=1; shift ;;
        --skip-tests) RUN_TESTS=0; shift ;;
        --skip-e2e) RUN_E2E=0; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; PYTEST_ARGS=("$@"); break ;;
        *) die_usage "unknown option '$1'" ;;
    esac
done

case "$RESULTS" in
    /*) ;;
    *) RESULTS="$PWD/$RESULTS" ;;  # absolute: the test step runs from the source folder
esac
LOGS="$RESULTS/logs"
STEPS=()
STATUSES=()
SECONDS_TAKEN=()
FAILED=0

# rmsnorm-deploy itself, run by $PYTHON (not the console script, so that PYTHON decides which install runs).
RMSNORM_DEPLOY=("$PYTHON" -m rmsnorm_deploy)

# Print a command as it would be typed, prefixed by "+": arguments with characters a shell would
# read differently are single-quoted.
show() {
    local arg line="+"
    for arg in "$@"; do
        if [[ "$arg" =~ ^[A-Za-z0-9_./,:=+@%-]+$ ]]; then
            line+=" $arg"
        else
            line+=" '${arg//\'/\'\\\'\'}'"
        fi
    done
    printf '%s\n' "$line"
}

# run DIR LOG CMD...: print CMD, run it in DIR with its output on the terminal and appended to LOG;
# returns CMD's exit code. With --dry-run, only prints.
run() {
    local dir="$1" log="$2"
    shift 2
    if [[ "$dir" != . ]]; then
        show cd "$dir"
    fi
    show "$@"
    if ((DRY_RUN)); then
        return 0
    fi
    (cd "$dir" && "$@") 2>&1 | tee -a "$log"
    return "${PIPESTATUS[0]}"
}

record() {  # record NAME STATUS START_SECONDS
    STEPS+=("$1")
    STATUSES+=("$2")
    SECONDS_TAKEN+=("$((SECONDS - $3))")
    if [[ "$2" != pass && "$2" != "dry run" ]]; then
        FAILED=1
    fi
}

banner() {
    printf '\n=== %s ===\n' "$1"
}

step_env() {
    banner "1. environment"
    local start=$SECONDS rc=0
    run . "$LOGS/env.log" "${RMSNORM_DEPLOY[@]}" env --require-gpu --output "$RESULTS/env.json" --force || rc=$?
    if ((DRY_RUN)); then
        record env "dry run" "$start"
        return
    fi
    if [[ -f /opt/rmsnorm-deploy/pip-freeze.txt ]]; then
        cp /opt/rmsnorm-deploy/pip-freeze.txt "$RESULTS/pip-freeze.txt"
    fi
    if ((rc != 0)); then
        {
            echo
            if ((rc == 2)); then
                echo "gpu_suite: no usable GPU in this container (rmsnorm-deploy env --require-gpu exited 2; its table above says why)."
            else
                echo "gpu_suite: rmsnorm-deploy env failed with exit code $rc (see $LOGS/env.log)."
            fi
            echo "gpu_suite: run the image with 'docker run --gpus all ...' on a host with an NVIDIA GPU, the NVIDIA"
            echo "gpu_suite: driver (R580 or newer for CUDA 13) and the NVIDIA Container Toolkit. Nothing was tested."
        } >&2
        exit 2
    fi
    record env pass "$start"
}

step_tests() {
    banner "2. GPU and TensorRT tests"
    local start=$SECONDS rc=0 junit="$RESULTS/pytest-gpu.xml" skipped
    run "$SRC_DIR" "$LOGS/tests.log" "$PYTHON" -m pytest -m "cuda or trt" -rfEs -p no:cacheprovider \
        --basetemp "$RESULTS/pytest-tmp" --junitxml "$junit" "${PYTEST_ARGS[@]}" || rc=$?
    if ((DRY_RUN)); then
        record tests "dry run" "$start"
        return
    fi
    if ((rc == 5)); then
        echo "gpu_suite: no test marked cuda or trt was collected; the GPU suite tested nothing" >&2
        record tests "FAIL (no GPU test collected)" "$start"
        return
    fi
    skipped="$("$PYTHON" "$SRC_DIR/docker/skipped_tests.py" "$junit" 2>/dev/null || true)"
    if [[ -n "$skipped" ]]; then
        local count
        count="$(wc -l <<<"$skipped")"
        echo "gpu_suite: $count GPU/TensorRT test(s) skipped inside the image, where all of them must run:" >&2
        printf '  %s\n' "${skipped//$'\n'/$'\n  '}" >&2
        if ((rc == 0 && !ALLOW_SKIPS)); then
            record tests "FAIL ($count skipped)" "$start"
            return
        fi
    fi
    if ((rc != 0)); then
        record tests "FAIL (pytest exit $rc)" "$start"
    else
        record tests pass "$start"
    fi
}

step_e2e() {
    banner "3. end to end: export the tiny preset, validate it on every backend"
    local start=$SECONDS failures=0 dtype lowering inputs providers model folder rc
    for dtype in float16 bfloat16; do
        for lowering in function plugin; do
            folder="$RESULTS/export/tiny/$dtype-$lowering"
            model="$folder/model.onnx"
            rc=0
            run . "$LOGS/e2e.log" "${RMSNORM_DEPLOY[@]}" export tiny -o "$model" --dtype "$dtype" --lowering "$lowering" \
                --force || rc=$?
            if ((rc != 0)); then
                echo "gpu_suite: export of tiny ($dtype, $lowering) failed with exit code $rc" >&2
                failures=$((failures + 1))
                continue
            fi
            # The plugin lowering is one graph for three runtimes: ONNX Runtime runs its function,
            # TensorRT without the plugin inlines it, TensorRT with the plugin runs the plugin.
            providers="cpu,cuda,trt"
            if [[ "$lowering" == plugin ]]; then
                providers="$providers,trt-plugin"
            fi
            if ((ORT_TENSORRT)); then
                providers="$providers,tensorrt"
            fi
            for inputs in normal stress; do
                rc=0
                if ((!DRY_RUN)); then
                    mkdir -p "$folder"
                fi
                run . "$folder/validate-$inputs.txt" "${RMSNORM_DEPLOY[@]}" validate "$model" --providers "$providers" \
                    --inputs "$inputs" || rc=$?
                if ((rc != 0)); then
                    echo "gpu_suite: validate of tiny ($dtype, $lowering, $inputs inputs) failed with exit code $rc" >&2
                    failures=$((failures + 1))
                fi
            done
        done
    done
    if ((DRY_RUN)); then
        record e2e "dry run" "$start"
    elif ((failures)); then
        record e2e "FAIL ($failures command(s))" "$start"
    else
        record e2e pass "$start"
    fi
}

step_bench() {
    banner "4. GPU kernel benchmark"
    local start=$SECONDS rc=0
    # The source in the image is read-only: the benchmark runs from a copy in the results folder,
    # so whatever it writes under benchmarks/ lands there.
    if ((!DRY_RUN)); then
        if [[ ! -f "$SRC_DIR/benchmarks/gpu_kernel.py" ]]; then
            echo "gpu_suite: $SRC_DIR/benchmarks/gpu_kernel.py is not in this image" >&2
            record bench "FAIL (no benchmarks/gpu_kernel.py)" "$start"
            return
        fi
        mkdir -p "$RESULTS/benchmarks"
        cp "$SRC_DIR"/benchmarks/*.py "$RESULTS/benchmarks/"
    fi
    run "$RESULTS" "$LOGS/bench.log" "$PYTHON" benchmarks/gpu_kernel.py || rc=$?
    if ((DRY_RUN)); then
        record bench "dry run" "$start"
    elif ((rc != 0)); then
        record bench "FAIL (exit $rc)" "$start"
    else
        record bench pass "$start"
    fi
}

summary() {
    banner "summary"
    local i
    printf '%-6s  %-32s  %s\n' step status seconds
    printf '%-6s  %-32s  %s\n' ------ -------------------------------- -------
    for i in "${!STEPS[@]}"; do
        printf '%-6s  %-32s  %s\n' "${STEPS[$i]}" "${STATUSES[$i]}" "${SECONDS_TAKEN[$i]}"
    done
    if ((DRY_RUN)); then
        echo "dry run: nothing was run"
    else
        echo "results: $RESULTS (logs in $LOGS)"
    fi
}

if ((!DRY_RUN)); then
    mkdir -p "$LOGS" || die_usage "cannot create $LOGS"
fi
step_env
if ((RUN_TESTS)); then
    step_tests
fi
if ((RUN_E2E)); then
    step_e2e
fi
if ((BENCH)); then
    step_bench
fi
summary
exit "$FAILED"
