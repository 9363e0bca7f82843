# Two commands on a fresh machine (see README.md):
#   make run    export the tiny preset to ONNX, check it in ONNX Runtime CPU, print the parity table
#   make test   run the test suite
# Each installs what it needs into .venv first (once; again when pyproject.toml or
# constraints.txt change).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
JOBS ?= 2

.PHONY: run test parity bench-export-scale lint-docker clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: this machine's pip takes the CPU wheel from local disk.
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e '.[onnxruntime,triton,test]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/rmsnorm-deploy export tiny --force

test: $(STAMP)
	$(PY) -m pytest -n $(JOBS) -q

parity: $(STAMP)
	$(VENV)/bin/rmsnorm-deploy parity

# Export a 1.24B-parameter LLaMA-architecture model (float16) and record time and peak memory.
bench-export-scale: $(STAMP)
	$(PY) benchmarks/bench_export_scale.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
