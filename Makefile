# tpx developer entry points. The two set-up commands are `make demo` and `make test`:
# on a fresh machine each creates .venv, installs torch (the CPU wheel), builds tpx without
# build isolation and runs. `make test PYTHON=python3` uses an interpreter that already has
# torch (and pytest) instead of creating .venv.

PYTHON ?=
VENV := .venv
TORCH_SPEC ?= torch==2.13.0
ifeq ($(strip $(PYTHON)),)
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-installed-3
else
PY := $(PYTHON)
DEPS :=
endif

NVCC ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_SRCS := $(wildcard csrc/cuda/*.cu)
EXT_INPUTS := $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.h csrc/cuda/*.cu csrc/cuda/*.cuh) \
              setup.py pyproject.toml
STAMP := build/.installed-$(subst /,_,$(PY))
PYTEST_ARGS ?= -q

.PHONY: demo test test-emulated build cuda-check bench clean

DEMO_ARGS ?=
demo: $(STAMP)
	$(PY) -m torch.distributed.run --nproc-per-node 2 --master-port 29517 \
	    examples/train_tp_demo.py $(DEMO_ARGS)

test: $(STAMP) cuda-check
	$(PY) -m pytest tests $(PYTEST_ARGS)

build: $(STAMP)

# The CUDA kernels run on the CPU through tests/cuda_emulation (also part of `make test`).
test-emulated: $(STAMP)
	$(PY) -m pytest tests/test_kernels_emulated.py $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_linear.py

$(VENV)/.deps-installed-3:
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)" setuptools wheel pybind11 ninja pytest \
	    numpy tqdm matplotlib safetensors "transformers==5.23.0"
	touch $@

$(STAMP): $(DEPS) $(EXT_INPUTS)
	$(PY) -m pip install --no-build-isolation --no-deps -e .
	@$(PY) -c "import tpx; i = tpx.build_info(); print('tpx', i['version'], 'built', 'WITH CUDA kernels' if i['cuda'] else 'CPU-only (no CUDA kernels: torch has no CUDA or nvcc was not found)')"
	mkdir -p build && touch $@

# Every CUDA source must compile with bare nvcc (no torch headers) for sm_80 and sm_90a.
cuda-check:
ifeq ($(strip $(NVCC)),)
	@echo "cuda-check: nvcc not found; CUDA sources not compiled"
else ifeq ($(strip $(CUDA_SRCS)),)
	@echo "cuda-check: no CUDA sources in csrc/cuda"
else
	@mkdir -p build/cuda-check
	@set -e; for f in $(CUDA_SRCS); do \
	  echo "nvcc -c $$f (sm_80, sm_90a)"; \
	  $(NVCC) -std=c++17 -O2 -Icsrc -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
	    -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ -gencode arch=compute_80,code=sm_80 \
	    -gencode arch=compute_90a,code=sm_90a -c $$f -o build/cuda-check/$$(basename $$f).o; \
	done
endif

clean:
	rm -rf build python/tpx/*.so python/*.egg-info
