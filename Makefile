# tpx developer entry points. The two set-up commands are `make demo` and `make test`:
# on a fresh machine each creates .venv, installs torch (the CPU wheel), builds tpx without
# build isolation and runs. `make test PYTHON=python3` uses an interpreter that already has
# torch (and pytest) instead of creating .venv.

PYTHON ?=
VENV := .venv
TORCH_SPEC ?= torch==2.13.0
ifeq ($(strip $(PYTHON)),)
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-installed-6
else
PY := $(PYTHON)
DEPS :=
endif

NVCC ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_SRCS := $(wildcard csrc/cuda/*.cu)
EXT_INPUTS := $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.h csrc/cuda/*.cu csrc/cuda/*.cuh) \
              setup.py pyproject.toml
STAMP := build/.installed-$(subst /,_,$(PY))
PYTEST_ARGS ?= -q --durations=15

.PHONY: demo test test-slow test-emulated build cuda-check cuda-build bench clean

# `make demo` trains with 1-D TP on 2 processes; LAYOUT=2d (4 processes), 2.5d or 3d (8) shards
# the same model over a mesh instead.
DEMO_ARGS ?=
LAYOUT ?= 1d
DEMO_NPROC_1d := 2
DEMO_NPROC_2d := 4
DEMO_NPROC_2.5d := 8
DEMO_NPROC_3d := 8
DEMO_NPROC := $(DEMO_NPROC_$(LAYOUT))
demo: $(STAMP)
	@test -n "$(DEMO_NPROC)" || { echo "make demo: LAYOUT must be 1d, 2d, 2.5d or 3d (got '$(LAYOUT)')"; exit 2; }
	$(PY) -m torch.distributed.run --nproc-per-node $(DEMO_NPROC) --master-port 29517 \
	    examples/train_tp_demo.py --layout $(LAYOUT) $(DEMO_ARGS)

test: $(STAMP) cuda-check
	$(PY) -m pytest tests -m "not slow" $(PYTEST_ARGS)

# The cases marked slow (more ranks or sizes of cases `make test` runs); CI runs both.
test-slow: $(STAMP)
	$(PY) -m pytest tests -m slow $(PYTEST_ARGS)

build: $(STAMP)

# The CUDA kernels run on the CPU through tests/cuda_emulation (also part of `make test`).
test-emulated: $(STAMP)
	$(PY) -m pytest tests/test_kernels_emulated.py $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_linear.py

# torchtitan 0.2.2 (its last release whose TP goes through torch.distributed.tensor.parallel)
# for tests/test_torchtitan.py: without its dependencies, which would pull another torch;
# tyro and torchdata are the ones its Llama 3 imports. peft (optional for users) for
# tests/test_lora.py.
$(VENV)/.deps-installed-6:
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)" setuptools wheel pybind11 ninja pytest \
	    numpy tqdm matplotlib safetensors "transformers==5.24.0" "peft==0.21.2" expecttest tyro
	$(VENV)/bin/python -m pip install --quiet --no-deps "torchtitan==0.2.2" "torchdata==0.11.0"
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

# The whole CUDA extension, built, linked and imported on a machine without a GPU, in its own
# venv (.venv-cuda: torch's default CUDA wheel from the package index, ~3.5 GB with its nvidia-*
# wheels; `===` so pip does not pick the local CPU wheel) and its own build directory
# (build/cuda), then installed as a wheel so it never touches the CPU build of python/tpx.
# Stamps: the venv is installed once; the wheel is rebuilt when csrc/, setup.py or
# python/tpx change (ninja recompiles only the changed sources); the checks rerun after a
# rebuild or a change of the tests they run.
# CPATH: the system toolkit has the CUDA runtime headers but not cuBLAS/cuSPARSE/cuSOLVER
# (included by ATen/cuda/CUDAContext.h) nor NCCL (c10d's ProcessGroupNCCL.hpp); the nvidia-*
# wheels bring them. Today's sources include neither, so the paths are a safeguard.
CUDA_VENV := .venv-cuda
CUDA_PY := $(CUDA_VENV)/bin/python
CUDA_TORCH_SPEC ?= torch===2.13.0
CUDA_DEPS := $(CUDA_VENV)/.deps-installed-1
CUDA_BUILD := build/cuda
CUDA_TESTS := tests/test_build.py tests/test_ops.py tests/test_linear.py tests/test_loss.py \
              tests/test_embedding.py tests/test_selfcheck.py
PY_SRCS := $(shell find python/tpx -name '*.py')
# nvcc may be a wrapper script: ask it where its toolkit is (torch would guess from its path).
CUDA_HOME ?= $(if $(NVCC),$(shell $(NVCC) --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | \
                                  sed -n 's/^\#\$$ TOP=//p' | xargs realpath 2>/dev/null))
CUDA_BUILD_JOBS ?= 2

cuda-build: $(CUDA_BUILD)/.checked

$(CUDA_DEPS):
	python3 -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -m pip install --quiet "$(CUDA_TORCH_SPEC)" setuptools wheel \
	    pybind11 ninja pytest numpy
	touch $@

$(CUDA_BUILD)/.installed: $(CUDA_DEPS) $(EXT_INPUTS) $(PY_SRCS)
ifeq ($(strip $(NVCC)),)
	@echo "cuda-build: nvcc not found (put the CUDA toolkit's bin/ on PATH)"; exit 1
endif
	@mkdir -p $(CUDA_BUILD)/dist
	rm -f $(CUDA_BUILD)/dist/*.whl
	site=$$($(CUDA_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  CUDA_HOME=$(CUDA_HOME) \
	  CPATH=$$site/nvidia/cu13/include:$$site/nvidia/nccl/include$${CPATH:+:$$CPATH} \
	  TPX_CUDA=1 TPX_BUILD_DIR=$(CUDA_BUILD)/setuptools MAX_JOBS=$(CUDA_BUILD_JOBS) \
	  nice -n 10 $(CUDA_PY) -m pip wheel --no-build-isolation --no-deps -w $(CUDA_BUILD)/dist .
	$(CUDA_PY) -m pip install --quiet --no-deps --force-reinstall $(CUDA_BUILD)/dist/tpx-*.whl
	touch $@

$(CUDA_BUILD)/.checked: $(CUDA_BUILD)/.installed $(CUDA_TESTS) tests/harness.py tests/conftest.py \
                         .ci/cuda_build_check.py
	env -u PYTHONPATH nice -n 10 $(CUDA_PY) .ci/cuda_build_check.py $(CUDA_TESTS) $(PYTEST_ARGS)
	touch $@

# `make test-torch TORCH_SPEC=torch==X.Y.Z`: the whole test suite on another release of torch.
# That release gets its own venv (.venv-torch-X.Y.Z, installed once; torch's default wheel from
# the package index, a CUDA build of several GB) and tpx is built against it as a CPU-only
# wheel in its own build directory (build/torch-X.Y.Z), then installed into that venv: the
# editable build of python/tpx and build/ of the main build are never touched. The tests run
# from the repository root on the installed wheel (the source tree's python/ is not on
# sys.path; the first line printed says where tpx came from). DIST_EXTRA_CONFIG puts setuptools'
# egg-info there too, out of python/.
# PIP_CONFIG_FILE=/dev/null: pip reads no configuration file for this target, so a constraints
# file of the machine's pip configuration does not hold back the newest torch.
# TT_TRANSFORMERS: the transformers release installed with that torch. Below torch 2.6 the
# models of transformers 5.19 and later do not import (torch.accelerator), so torch 2.5.x gets
# 5.18.0, the newest that runs there.
TT_VERSION := $(patsubst torch==%,%,$(filter torch==%,$(TORCH_SPEC)))
TT_VENV := .venv-torch-$(TT_VERSION)
TT_PY := $(TT_VENV)/bin/python
TT_DEPS := $(TT_VENV)/.deps-installed-2
TT_BUILD := build/torch-$(TT_VERSION)
TT_TRANSFORMERS ?= $(if $(filter 2.5.%,$(TT_VERSION)),transformers==5.18.0,transformers==5.24.0)
TT_BUILD_JOBS ?= 2
TT_PIP := PIP_CONFIG_FILE=/dev/null nice -n 10 $(TT_PY) -m pip

.PHONY: test-torch
test-torch: $(TT_BUILD)/.installed
	env -u PYTHONPATH $(TT_PY) -c 'import os, sys, torch, tpx; \
	  where = os.path.realpath(tpx.__file__); \
	  print("test-torch: torch", torch.__version__, "| tpx", tpx.build_info()["version"], "from", where); \
	  sys.exit("test-torch: tpx was imported from the source tree, not from the installed wheel" \
	           if where.startswith(os.path.realpath("python") + os.sep) else \
	           "test-torch: torch " + torch.__version__ + " is not $(TT_VERSION)" \
	           if torch.__version__.split("+")[0] != "$(TT_VERSION)" else 0)'
	env -u PYTHONPATH nice -n 10 $(TT_PY) -m pytest tests -p no:cacheprovider $(PYTEST_ARGS)

$(TT_DEPS):
	@test -n "$(TT_VERSION)" || { echo "make test-torch: TORCH_SPEC must be torch==X.Y.Z (got '$(TORCH_SPEC)')"; exit 2; }
	python3 -m venv $(TT_VENV)
	$(TT_PIP) install --quiet "torch==$(TT_VERSION)" setuptools wheel pybind11 ninja pytest \
	    numpy tqdm matplotlib safetensors "$(TT_TRANSFORMERS)" "peft==0.21.2" expecttest
	touch $@

$(TT_BUILD)/.installed: $(TT_DEPS) $(EXT_INPUTS) $(PY_SRCS)
	@mkdir -p $(TT_BUILD)/dist $(TT_BUILD)/setuptools
	rm -f $(TT_BUILD)/dist/*.whl
	printf '[egg_info]\negg_base = $(TT_BUILD)/setuptools\n' > $(TT_BUILD)/setuptools.cfg
	DIST_EXTRA_CONFIG=$(TT_BUILD)/setuptools.cfg \
	  TPX_CUDA=0 TPX_BUILD_DIR=$(TT_BUILD)/setuptools MAX_JOBS=$(TT_BUILD_JOBS) \
	  $(TT_PIP) wheel --no-build-isolation --no-deps -w $(TT_BUILD)/dist .
	$(TT_PIP) install --quiet --no-deps --force-reinstall $(TT_BUILD)/dist/tpx-*.whl
	touch $@

clean:
	rm -rf build python/tpx/*.so python/*.egg-info
