# kernelpro: make install, make test (CPU, what CI runs), make test-gpu (on a GPU machine).
PY      ?= python3
GPU_WORKERS ?= 0
GPU_CACHE ?= /tmp/kernelpro-test-gpu-cache
GPU_FILES = $$(grep -l "mark.gpu" tests/test_*.py)
VENV    ?= .venv
# The venv's python when there is one; otherwise the machine's (the GPU image carries torch already).
PYTHON  ?= $(shell [ -x $(VENV)/bin/python ] && echo $(VENV)/bin/python || echo $(PY))
TASK    ?=
CANDIDATE ?=
# Where pip takes torch from; empty: pip's configured index. Without a GPU, point it at PyTorch's CPU wheel
# index (README, "Install") so pip does not fetch the multi-GB CUDA build.
TORCH_INDEX_URL ?=
CUDA_HOME ?= /usr/local/cuda
# Looked up when install's commands are expanded, so `make -n install` shows what this machine gets.
HAVE_GPU   = $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
HAVE_NVCC  = $(shell { command -v nvcc || [ -x "$(CUDA_HOME)/bin/nvcc" ]; } >/dev/null 2>&1 && echo yes)
# (Specs with commas live in variables: a comma inside $(if ...) would split its arguments.)
TORCH_GPU   = 'torch>=2.8,<2.15'
TORCH_CPU   = torch==2.13.0
NVCC_WHEELS = 'nvidia-cuda-nvcc>=13,<14' 'nvidia-cuda-cccl>=13,<14'
TORCH_SPEC  = $(if $(HAVE_GPU),$(TORCH_GPU),$(TORCH_CPU))

.PHONY: install test test-gpu lint format eval clean index optimize show

install:
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch first, so nothing later pulls another build: with a GPU the CUDA build in the project's range,
	# without one the CPU build (from TORCH_INDEX_URL when set).
	$(VENV)/bin/pip install -q $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)") $(TORCH_SPEC)
	# No nvcc on PATH or in CUDA_HOME: NVIDIA's nvcc wheels (nvcc, its headers and CCCL), which
	# pipeline/compile.py finds in the venv.
	$(if $(HAVE_NVCC),,$(VENV)/bin/pip install -q $(NVCC_WHEELS))
	$(VENV)/bin/pip install -q -e '.[dev]'

test:
	# One worker a core (at most 4), each test file on one worker: its module fixtures (a CPU worker, compiled
	# candidates, the KernelBench verdicts) are built once, and the sandbox tests' loopback servers stay theirs.
	$(PYTHON) -m pytest -m "not gpu" -q -n auto --maxprocesses 4 --dist loadfile

test-gpu:
	# Only the modules that hold GPU tests are collected: the CPU-only ones may import packages a bare
	# GPU image lacks (the index stack), and none of their tests would run here anyway. Most of their time is
	# nvcc on the CPU and no test asserts a time, so GPU_WORKERS=N (pytest-xdist) may share the one GPU:
	# test_gpu_expert's cases spread over the workers, every other file's stay together on one
	# (tests/conftest.py: SPREAD_FILES). 0, the default: one process. Many workers (12 on one H100) can trip
	# the harness's hidden-work check (host time against events, other processes time-slicing the GPU), so
	# with workers the cases that failed are run again, alone in one process, and that run's verdict is the
	# suite's (a real failure fails twice). A calibration taken while the others run is refused (no roofline
	# floor, so no too_fast verdict from a floor measured low). The failures' list lives in GPU_CACHE, out
	# of the tree.
	$(if $(filter-out 0,$(GPU_WORKERS)),rm -rf $(GPU_CACHE); $(PYTHON) -m pytest -m gpu -q -o cache_dir=$(GPU_CACHE) -n $(GPU_WORKERS) --dist loadscope $(GPU_FILES) || { echo "test-gpu: the failures above once more alone in one process (workers sharing the GPU can trip hidden_work)"; $(PYTHON) -m pytest -m gpu -q -o cache_dir=$(GPU_CACHE) --last-failed --last-failed-no-failures none $(GPU_FILES); },$(PYTHON) -m pytest -m gpu -q -p no:cacheprovider $(GPU_FILES))

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
	$(PYTHON) -m pipeline.cli index build --corpus $(or $(CORPUS),cutlass) $(if $(FOLDER),--folder "$(FOLDER)")
