# One command sets everything up and runs the demo, one sets up and runs the tests.
# torch is installed first with an exact pin: on a CPU-only machine an open torch
# requirement would otherwise resolve to a multi-GB CUDA build. Elsewhere, point
# TORCH_INDEX at PyTorch's CPU wheel index to get the CPU build of the same release.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

.PHONY: setup demo leaderboard-demo leaderboard-demo-scale services test docs-check lint bench clean

# The example task plugins are installed too: the tests train and verify them (a task plugin is an
# installed package, never code inside a bundle).
$(VENV)/.installed: pyproject.toml setup.py witness/commit/_native.c witness/commit/_blake3.c Makefile examples/cnn_plugin/pyproject.toml examples/nanogpt_style/pyproject.toml examples/nanogpt/pyproject.toml examples/hf_clm/pyproject.toml examples/lightning_module/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,hf,lightning,s3]"
	$(PIP) install -q --no-deps -e examples/cnn_plugin -e examples/nanogpt_style -e examples/nanogpt -e examples/hf_clm -e examples/lightning_module
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/witness demo

# A local leaderboard with real certified runs and one rejected run, at http://127.0.0.1:8080
leaderboard-demo: setup
	$(VENV)/bin/witness leaderboard demo

# The same demo scaled out: PostgreSQL and an S3-compatible store (SeaweedFS) on loopback, two
# worker processes that share only those with the server (its own database, witness_demo, and bucket,
# witness-demo; a second run refuses to touch what the first left: `make leaderboard-demo-scale RESET=1`
# empties them first, and says what it empties)
leaderboard-demo-scale: setup
	url="$$(scripts/services.sh)" && AWS_ENDPOINT_URL=http://127.0.0.1:$${WITNESS_S3_PORT:-8333} \
	  AWS_ACCESS_KEY_ID=$${WITNESS_S3_ACCESS_KEY:-witness} AWS_SECRET_ACCESS_KEY=$${WITNESS_S3_SECRET:-witness-s3-secret} AWS_DEFAULT_REGION=us-east-1 \
	  $(VENV)/bin/witness leaderboard demo --dir leaderboard-demo-scale --db "$${url%/*}/witness_demo" \
	  --store s3://witness-demo/demo --workers 2 $(if $(RESET),--reset)

# PostgreSQL 15 and an S3-compatible store (SeaweedFS) on loopback, and Chromium, for the leaderboard's tests
services:
	scripts/services.sh

# the GPU extra (Triton): its kernels' tests run here, on the CPU, under Triton's interpreter
$(VENV)/.installed-gpu: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e ".[gpu]"
	touch $@

test: setup $(VENV)/.installed-gpu
	$(VENV)/bin/ruff check witness tests bench examples
	url="$$(scripts/services.sh)" && WITNESS_TEST_PG_URL="$$url" $(PY) -m pytest

# every code block of the docs marked `python run`, run as written (the test suite runs them too)
docs-check: setup
	$(PY) -m pytest tests/test_docs_snippets.py

bench: setup
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) witness-demo leaderboard-demo leaderboard-demo-scale leaderboard-data .pytest_cache
