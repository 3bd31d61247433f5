#!/usr/bin/env bash
# tpx on a machine with one NVIDIA GPU, in one command: build with CUDA, run the GPU tests,
# the selfcheck, a compute-sanitizer pass over the kernels and the single-GPU benchmark.
#
#   benchmarks/gpu_check.sh OUTDIR [SECONDS]
#
# OUTDIR receives build.log, pytest_cuda.log, selfcheck.json, bench_gpu.json, sanitizer.log,
# emulated.log and the built extension (stripped, gzipped). SECONDS (default 540) is the time
# the whole run may take: each step gets at most what is left, and the steps are ordered by
# what they prove (build, GPU tests, selfcheck, benchmark, sanitizer, emulated kernels).
# Environment:
# PYTHON (default python3, a CUDA build of torch), TORCH_CUDA_ARCH_LIST (default 9.0a),
# MAX_JOBS (default: the number of cores), BENCH_GPU_ARGS (more arguments of bench_gpu.py, such
# as --sections emb,lce). The exit status is that of the first step that
# failed (0 when all passed).
set -u
out=${1:?usage: benchmarks/gpu_check.sh OUTDIR [SECONDS]}
budget=${2:-540}
py=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$SECONDS
status=0

step() {  # step NAME CAP COMMAND...: runs COMMAND under timeout min(CAP, time left - 5)
  local name=$1 cap=$2
  shift 2
  local left=$((budget - (SECONDS - start) - 5))
  if [ "$left" -lt 20 ]; then
    echo "== $name: skipped (${left} s left of ${budget})"
    return 0
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  echo "== $(date +%T) $name (at most ${cap} s; $((SECONDS - start)) s spent)"
  local t0=$SECONDS rc=0
  timeout --kill-after=5 "$cap" bash -c '"$@"' "$name" "$@" || rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
  return "$rc"
}

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv || true
$py -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, \
'| CUDA', torch.version.cuda, '| NCCL', torch.cuda.nccl.version(), '|', torch.cuda.get_device_name())"
(nvcc --version || true) | tail -2
nproc

build() {
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-$(nproc)} TPX_CUDA=1 \
    $py -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1
  local rc=$?
  tail -5 "$out/build.log"
  [ "$rc" -eq 0 ] || { grep -n -i -B2 -A8 "error" "$out/build.log" | head -80; return "$rc"; }
  $py -c "import json, tpx; print(json.dumps(tpx.build_info()))"
}
pytest_cuda() {
  set -o pipefail
  TPX_TEST_TIMEOUT=${TPX_TEST_TIMEOUT:-90} $py -m pytest tests/test_cuda.py -q -rA -p no:cacheprovider --durations=10 2>&1 |
    tee "$out/pytest_cuda.log" | sed '/^PASSED/d'
}

sanitize() {
  # The CUDA kernels' test cases under compute-sanitizer (memcheck), without the caching
  # allocator so that an access past a tensor's end is one past its allocation.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
    $py -c "
import sys, tempfile
sys.path[:0] = ['tests', 'examples']
import torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group('gloo', init_method='file://' + tempfile.mkdtemp() + '/store',
                        rank=0, world_size=1)
from test_cuda import _check_ce_kernels, _check_embedding_kernels
_check_ce_kernels(0, 1, 'cuda')
_check_embedding_kernels(0, 1, 'cuda')
dist.destroy_process_group()
print('kernel cases ran under compute-sanitizer memcheck')
" >"$out/sanitizer.log" 2>&1
  local rc=$?
  tail -25 "$out/sanitizer.log"
  return "$rc"
}

emulated() {
  set -o pipefail
  $py -m pytest tests/test_kernels_emulated.py -q -p no:cacheprovider 2>&1 | tee "$out/emulated.log" |
    tail -5
}

export out py
export -f build pytest_cuda sanitize emulated
if [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then  # a dry run with the tpx already importable
  $py -c "import json, tpx; print(json.dumps(tpx.build_info()))"
else
  step build 300 build || { echo "== build failed: nothing else can run"; exit "$status"; }
fi

step "pytest tests/test_cuda.py" 180 pytest_cuda

step selfcheck 75 $py -m tpx.selfcheck --json "$out/selfcheck.json"

step "bench_gpu" 200 $py benchmarks/bench_gpu.py ${BENCH_GPU_ARGS:-} --out "$out/bench_gpu.json"

if command -v compute-sanitizer >/dev/null 2>&1; then
  step "compute-sanitizer memcheck" 120 sanitize
else
  echo "== compute-sanitizer not found: skipped"
fi

step "pytest tests/test_kernels_emulated.py" 150 emulated

# The built extension, stripped and compressed, so that a later run can reuse it.
so=$(ls python/tpx/_C*.so 2>/dev/null | head -1)
if [ "${GPU_CHECK_SKIP_BUILD:-0}" != 1 ] && [ -n "$so" ] && strip -g -o "$out/.C.so" "$so" 2>/dev/null; then
  gzip -c "$out/.C.so" >"$out/$(basename "$so").gz" && rm -f "$out/.C.so"
  ls -l "$out"
fi

echo "== done in $((SECONDS - start)) s, status $status"
exit "$status"
