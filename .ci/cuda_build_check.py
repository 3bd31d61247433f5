"""The check behind `make cuda-build`: the CUDA build of tpx imports, says it has its CUDA
kernels, and passes the CPU tests that go through the operator dispatch.

Run with the interpreter of .venv-cuda from the repository root:

    .venv-cuda/bin/python .ci/cuda_build_check.py tests/test_ops.py ... [pytest args]

tpx is imported here, before pytest starts, from the installed wheel (never from python/ of
the source tree, whose extension is the CPU build); the test processes (and the ranks they
spawn) resolve ``tpx`` through the same sys.path.
"""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The ops whose CUDA dispatch runs tpx's own kernels (csrc/cuda), as build_info lists them.
EXPECTED_CUDA_KERNELS = {
    "vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy_backward",
    "vocab_parallel_cross_entropy_backward_", "vocab_parallel_embedding",
    "vocab_parallel_embedding_backward", "linear_cross_entropy", "linear_cross_entropy_backward",
}


def main(argv):
    import tpx
    from tpx import _C

    where = os.path.realpath(_C.__file__)
    source_pkg = os.path.join(ROOT, "python", "tpx") + os.sep
    if where.startswith(source_pkg):
        sys.exit(f"cuda-build: tpx was imported from the source tree ({where}), not from the "
                 "CUDA wheel installed in this interpreter's site-packages")
    info = tpx.build_info()
    print(f"cuda-build: tpx {info['version']} from {where}")
    print(f"cuda-build: torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"GPU visible: {torch.cuda.is_available()}")
    print(f"cuda-build: build_info = {info}")
    if torch.version.cuda is None:
        sys.exit("cuda-build: this torch has no CUDA")
    if not info["cuda"]:
        sys.exit("cuda-build: tpx was built without its CUDA sources")
    kernels = set(info["cuda_kernels"])
    if kernels != EXPECTED_CUDA_KERNELS:
        sys.exit(f"cuda-build: CUDA kernels {sorted(kernels)}, expected "
                 f"{sorted(EXPECTED_CUDA_KERNELS)}")
    # The dispatcher has a CUDA kernel for each of them (the registrations ran at import; a
    # missing symbol would have failed the import already).
    for op in sorted(kernels):
        name = getattr(torch.ops.tpx, op).default.name()
        if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"):
            sys.exit(f"cuda-build: {name} has no CUDA kernel registered")
    print(f"cuda-build: CUDA kernels of {len(kernels)} ops registered with the dispatcher")
    return pytest.main(list(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
