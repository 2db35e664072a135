# kernelpro: make install, make test (CPU, what CI runs), make test-gpu (on a GPU machine).
PY      ?= python3
VENV    ?= .venv
# The venv's python when there is one; otherwise the machine's (the GPU image carries torch already).
PYTHON  ?= $(shell [ -x $(VENV)/bin/python ] && echo $(VENV)/bin/python || echo $(PY))
TASK    ?=
CANDIDATE ?=

.PHONY: install test test-gpu lint format eval clean index optimize show

install:
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch first: without a GPU the CPU build from local disk, so nothing later pulls a multi-GB CUDA build.
	if nvidia-smi -L >/dev/null 2>&1; then $(VENV)/bin/pip install -q 'torch>=2.8,<2.15'; \
	else $(VENV)/bin/pip install -q torch==2.13.0; fi
	$(VENV)/bin/pip install -q -e '.[dev]'

test:
	$(PYTHON) -m pytest -m "not gpu" -q

test-gpu:
	# Only the modules that hold GPU tests are collected: the CPU-only ones may import packages a bare
	# GPU image lacks (the index stack), and none of their tests would run here anyway.
	$(PYTHON) -m pytest -m gpu -q -p no:cacheprovider $$(grep -l "mark.gpu" tests/test_*.py)

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format:
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .

eval:
	$(PYTHON) -m pipeline.cli eval --task $(TASK) --candidate $(CANDIDATE)

clean:
	rm -rf .kernelpro .pytest_cache .ruff_cache

optimize:
	@test -n "$(TASK)" || { echo "usage: make optimize TASK=tasks/softmax.py [POLICY=expert|llm] [EVALS=40]"; exit 2; }
	$(PYTHON) -m pipeline.cli optimize --task $(TASK) $(if $(POLICY),--policy $(POLICY)) $(if $(EVALS),--max-evals $(EVALS))

show:
	$(PYTHON) -m pipeline.cli show $(RUN)

index:
	$(PYTHON) -m pipeline.cli index build --corpus $(or $(CORPUS),cutlass)
