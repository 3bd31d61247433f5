"""Build script for tpx: the C++ extension tpx._C, with CUDA sources when they can be built.

Environment switches:
  TPX_CUDA=0|1            force a CPU-only build (0) or require the CUDA sources (1); by
                          default CUDA is built when torch has CUDA and nvcc is found.
  TORCH_CUDA_ARCH_LIST    CUDA architectures (default "8.0;9.0a").
  MAX_JOBS                parallel compile jobs (torch's cpp_extension honours it).
  TPX_BUILD_DIR           setuptools' build directory (default "build"); a second build of the
                          same checkout (e.g. the CUDA one of `make cuda-build`, in build/cuda)
                          keeps its objects apart from the default build's.

Build without build isolation so the installed torch is used:
  pip install --no-build-isolation -e .
"""

import glob
import os
import sys

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda():
    flag = os.environ.get("TPX_CUDA", "").strip()
    if flag not in ("", "0", "1"):
        sys.exit(f"tpx: TPX_CUDA must be 0 or 1, got {flag!r}")
    have_torch_cuda = torch.version.cuda is not None
    have_nvcc = CUDA_HOME is not None and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))
    if flag == "1":
        if not (have_torch_cuda and have_nvcc):
            sys.exit(
                "tpx: TPX_CUDA=1 but the CUDA build is impossible: "
                f"torch CUDA = {torch.version.cuda}, nvcc found = {have_nvcc}. "
                "Install a CUDA build of torch and the CUDA toolkit, or set TPX_CUDA=0."
            )
        return True
    if flag == "0":
        print("tpx: TPX_CUDA=0: building the C++ (CPU) extension only.", file=sys.stderr)
        return False
    if have_torch_cuda and have_nvcc:
        return True
    reason = "torch has no CUDA" if not have_torch_cuda else "nvcc was not found (set CUDA_HOME)"
    print(f"tpx: {reason}: building the C++ (CPU) extension only; CUDA kernels are not built.",
          file=sys.stderr)
    return False


def _sources(with_cuda):
    srcs = sorted(glob.glob("csrc/*.cpp"))
    for sub in ("common", "overlap", "vocab"):
        srcs += sorted(glob.glob(f"csrc/{sub}/*.cpp"))
    if with_cuda:
        srcs += sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu"))
    return srcs


def _headers():
    # Listed so that a changed header rebuilds the extension (setuptools compares only the
    # listed files with the built module; ninja then recompiles what includes them).
    return sorted(glob.glob("csrc/**/*.h", recursive=True) +
                  glob.glob("csrc/**/*.cuh", recursive=True))


def _extension():
    with_cuda = _want_cuda()
    cxx = ["-O3"]
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
        return CUDAExtension(
            "tpx._C",
            _sources(True),
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=[("TPX_WITH_CUDA", "1")],
            depends=_headers(),
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
        )
    return CppExtension(
        "tpx._C",
        _sources(False),
        include_dirs=[os.path.join(ROOT, "csrc")],
        depends=_headers(),
        extra_compile_args={"cxx": cxx},
    )


def _options():
    build_dir = os.environ.get("TPX_BUILD_DIR", "").strip()
    return {"build": {"build_base": build_dir}} if build_dir else {}


setup(
    options=_options(),
    packages=find_packages("python"),
    package_dir={"": "python"},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension},
    zip_safe=False,
)
