"""The CUDA kernels of csrc/cuda/*.cu, executed on the CPU and checked against torch.

The very .cu files are compiled with g++ against the emulation layer in tests/cuda_emulation/
(fiber threads run concurrently within a block, warp shuffles check their masks, launch
limits are asserted) with AddressSanitizer and UBSan, linked with a small driver into a
standalone executable, and cached under build/cuda_emulation/ keyed on the sources' hash.
Each test writes the inputs to files, runs the launchers of kernels.h in that executable and
compares the outputs with the ATen path (torch and the CPU ops of tpx) on the same inputs:
the cases of tests/test_cuda.py, shaped so that every kernel variant (warp per row and block
per row, 16-byte vector head / body / tail, every copy width of the embedding forward) runs.
"""

import concurrent.futures
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tpx  # noqa: F401  (registers torch.ops.tpx)
from test_cuda import _LOW_TOL, _ce_reference, _strided_copy

ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "tests" / "cuda_emulation"
CXX = os.environ.get("CXX", "g++")
CXXFLAGS = ["-std=gnu++17", "-O1", "-g", "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-fno-strict-aliasing",
            "-Wall", "-Wextra", "-Wno-unknown-pragmas",
            # the flags torch's extension build and `make cuda-check` compile the kernels with
            "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
            "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
            f"-I{EMU / 'include'}", f"-I{EMU}", f"-I{ROOT / 'csrc'}"]
KERNEL_SOURCES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
EMU_SOURCES = [EMU / "cuda_emu.cpp", EMU / "driver.cpp", EMU / "selftest.cpp"]
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
NAN_FILL = float("nan")


def _digest(paths):
    h = hashlib.sha256(" ".join([CXX] + CXXFLAGS).encode())
    for f in sorted(set(paths)):
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


HEADERS = sorted((ROOT / "csrc" / "cuda").glob("*.cuh")) + sorted(
    (ROOT / "csrc" / "cuda").glob("*.h")) + sorted(EMU.rglob("*.h"))


@pytest.fixture(scope="module")
def emu_binary():
    """The emulated kernels as an executable, built once per hash of the sources (objects are
    cached per translation unit, so a change to one .cu file recompiles only that file)."""
    if shutil.which(CXX) is None:
        pytest.fail(f"the emulated CUDA kernels need a C++ compiler; {CXX!r} was not found")
    cache = ROOT / "build" / "cuda_emulation"
    exe = cache / _digest(KERNEL_SOURCES + EMU_SOURCES + HEADERS) / "tpx_kernels_emu"
    if exe.exists():
        return exe
    (cache / "obj").mkdir(parents=True, exist_ok=True)
    exe.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=exe.parent) as tmp:
        def compile_one(src):
            obj = cache / "obj" / f"{src.name}-{_digest([src] + HEADERS)}.o"
            if not obj.exists():
                lang = ["-x", "c++"] if src.suffix == ".cu" else []
                tmp_obj = Path(tmp) / obj.name
                r = subprocess.run([CXX, *CXXFLAGS, *lang, "-c", str(src), "-o", str(tmp_obj)],
                                   capture_output=True, text=True)
                assert r.returncode == 0, (f"compiling {src.name} for the emulator failed:\n"
                                           f"{r.stderr}")
                os.replace(tmp_obj, obj)
            return str(obj)

        # the translation units compiled side by side, one per core
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            objs = list(pool.map(compile_one, KERNEL_SOURCES + EMU_SOURCES))
        tmp_exe = Path(tmp) / exe.name
        r = subprocess.run([CXX, "-fsanitize=address,undefined", *objs, "-o", str(tmp_exe)],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"linking the emulator failed:\n{r.stderr}"
        os.replace(tmp_exe, exe)
    return exe


class Run:
    """A batch of launcher calls for the emulator. Tensor arguments are copied in with their
    exact layout: the buffer is the storage from its start up to the tensor's last element,
    so the pointer keeps its alignment and an access past the last element is out of bounds."""

    def __init__(self, exe, tmp_path):
        self.exe, self.dir = exe, tmp_path
        self.lines, self.outputs, self.n = [], [], 0

    def _file(self):
        self.n += 1
        return self.dir / f"b{self.n}.bin"

    def call(self, op, outputs=(), **args):
        """Queues op(args); returns a dict name -> placeholder filled by run()."""
        # Buffers first, then the aliases of this call's buffers.
        for name, v in sorted(args.items(), key=lambda kv: isinstance(kv[1], str)):
            if isinstance(v, torch.Tensor):
                end = v.storage_offset() + 1 + sum((s - 1) * st for s, st in
                                                   zip(v.shape, v.stride()))
                flat = torch.empty(0, dtype=v.dtype).set_(v.untyped_storage(), 0, (end,), (1,))
                path = self._file()
                path.write_bytes(flat.view(torch.uint8).numpy().tobytes())
                self.lines.append(f"buf {name} {end * v.element_size()} "
                                  f"{v.storage_offset() * v.element_size()} {path}")
            elif isinstance(v, str):  # another argument's buffer: in place
                self.lines.append(f"alias {name} {v}")
            elif isinstance(v, float):
                self.lines.append(f"float {name} {v.hex()}")
            else:
                self.lines.append(f"int {name} {int(v)}")
        self.lines.append(f"call {op}")
        result = {}
        for name in outputs:
            v = args[name]
            if isinstance(v, str):
                v = args[v]
            path = self._file()
            self.lines.append(f"save {name} {path}")
            self.outputs.append((result, name, v, path))
        return result

    def run(self, seed=1):
        req = self.dir / "request.txt"
        req.write_text("\n".join(self.lines) + "\n")
        env = dict(os.environ, TPX_EMU_SEED=str(seed),
                   ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
                   UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
        r = subprocess.run([str(self.exe), str(req)], capture_output=True, text=True, env=env,
                           timeout=600)
        err = r.stderr if len(r.stderr) < 8000 else r.stderr[:6000] + "\n...\n" + r.stderr[-2000:]
        assert r.returncode == 0, f"the emulated kernels failed (exit {r.returncode}):\n{err}"
        for result, name, like, path in self.outputs:
            raw = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
            flat = raw.view(like.dtype)
            result[name] = flat.as_strided(like.shape, like.stride(), like.storage_offset())
        self.lines, self.outputs = [], []


# The emulator itself: each deliberate mistake is reported -----------------------------------

@pytest.mark.parametrize("name, message", [
    ("lane_exits_before_shuffle", "does not take part: thread (31,0,0) of block (0,0,0) exited"),
    ("mask_omits_caller", "calls with mask 0x0000ffff, which omits it"),
    ("source_lane_outside_mask", "which is not in the mask 0x0000ffff"),
    ("divergent_syncthreads", "is not reached by every thread of the block"),
    ("block_too_large", "invalid block (1025,1,1)"),
    ("grid_y_too_large", "invalid grid (1,65536,1)"),
    ("shared_too_large", "of dynamic shared memory (at most 48 KiB)"),
    ("write_past_end", "AddressSanitizer: heap-buffer-overflow"),
    ("neighbour_without_barrier", "wrong values"),
])
def test_emulator_reports(emu_binary, tmp_path, name, message):
    req = tmp_path / "request.txt"
    req.write_text(f"selftest {name}\n")
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0", TPX_EMU_SEED="3")
    r = subprocess.run([str(emu_binary), str(req)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode != 0 and message in r.stdout + r.stderr, (r.returncode, r.stdout,
                                                                   r.stderr[-3000:])


def test_emulator_barrier_orders_shared_memory(emu_binary, tmp_path):
    """The same exchange as neighbour_without_barrier, with its __syncthreads: correct."""
    req = tmp_path / "request.txt"
    req.write_text("selftest neighbour_with_barrier\n")
    r = subprocess.run([str(emu_binary), str(req)], capture_output=True, text=True,
                       env=dict(os.environ, ASAN_OPTIONS="detect_leaks=0"), timeout=120)
    assert r.returncode == 0 and "0 wrong values" in r.stdout, (r.stdout, r.stderr[-3000:])


# Cross-entropy ------------------------------------------------------------------------------

# (dtype, V, strided, label_smoothing, ignore_index) as in test_cuda.py: V = 1003 takes the
# warp-per-row kernels, 5001 the block-per-row ones; "strided" rows have a stride of V + 3 and
# start one element into their buffer.
CE_CASES = [
    (torch.float32, 1003, False, 0.0, -100), (torch.float32, 1003, True, 0.1, -100),
    (torch.float32, 5001, False, 0.1, 7), (torch.float32, 5001, True, 0.0, -100),
    (torch.bfloat16, 1003, True, 0.1, -100), (torch.bfloat16, 5001, False, 0.0, 7),
    (torch.float16, 1003, False, 0.0, -100), (torch.float16, 5001, True, 0.1, -100),
]


def _ce_id(c):
    return f"{str(c[0]).split('.')[-1]}-V{c[1]}-{'strided' if c[2] else 'dense'}-eps{c[3]}-ii{c[4]}"


def _stats_call(run, x, target, vocab_start, ignore_index, with_sum):
    stats = torch.full((x.shape[0], 4), NAN_FILL)
    return run.call("ce_forward_stats", ["stats"], logits=x, dtype=DTYPES[x.dtype],
                    rows=x.shape[0], width=x.shape[1], row_stride=x.stride(0), target=target,
                    vocab_start=vocab_start, ignore_index=ignore_index,
                    with_sum_logits=int(with_sum), stats=stats)


def _backward_call(run, x, target, lse, g, vocab_start, V, ignore_index, eps, out=None):
    kw = dict(logits=x, logits_row_stride=x.stride(0), dtype=DTYPES[x.dtype], rows=x.shape[0],
              width=x.shape[1], target=target, lse=lse.contiguous(), grad_loss=g.contiguous(),
              vocab_start=vocab_start, vocab_size=V, ignore_index=ignore_index,
              label_smoothing=float(eps))
    if out is None:  # in place
        return run.call("ce_backward", ["grad"], grad="logits", grad_row_stride=x.stride(0), **kw)
    return run.call("ce_backward", ["grad"], grad=out, grad_row_stride=out.stride(0), **kw)


def _check_stats(stats, x, target, vocab_start, ignore_index, with_sum, case):
    xf = x.float()
    W = x.shape[1]
    torch.testing.assert_close(stats[:, 0], xf.max(1).values, rtol=0, atol=0,
                               msg=lambda m: f"row max {case}: {m}")
    lse = stats[:, 0] + stats[:, 1].log()
    torch.testing.assert_close(lse, torch.logsumexp(xf, 1), rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"lse {case}: {m}")
    local = target - vocab_start
    held = (local >= 0) & (local < W) & (target != ignore_index)
    xt = torch.where(held, xf.gather(1, local.clamp(0, W - 1)[:, None])[:, 0],
                     torch.zeros(()))
    assert torch.equal(stats[:, 2], xt), f"target logit {case}"
    if with_sum:
        torch.testing.assert_close(stats[:, 3].double(), x.double().sum(1), rtol=1e-5,
                                   atol=1e-3, msg=lambda m: f"sum of logits {case}: {m}")
    else:
        assert not stats[:, 3].any(), f"sum of logits written though not asked for: {case}"
    return lse


@pytest.mark.parametrize("case", CE_CASES, ids=_ce_id)
def test_cross_entropy_kernels(emu_binary, tmp_path, case):
    dtype, V, strided, eps, ignore_index = case
    gen = torch.Generator().manual_seed(1000 + CE_CASES.index(case))
    N = 37  # 5 blocks of 8 rows (the last one partial) / 37 blocks of one row
    full = 3 * torch.randn(N, V, generator=gen)
    full[0] = torch.linspace(-20, 20, V)  # the max grows at every element
    full[1] = -torch.linspace(-20, 20, V)
    target = torch.randint(0, V, (N,), generator=gen)
    target[::5] = ignore_index
    v0, v1 = 14, 14 + (V - 14) // 2  # a shard whose rows start at an unaligned column
    target[2] = V - 1
    target[4], target[6], target[7], target[8], target[9] = 0, v0 - 1, v0, v1 - 1, v1
    if eps == 0.0:  # masked logits (smoothing would make the loss infinite)
        full[3, 1::2] = float("-inf")
        target[3] = 0
    x = full.to(dtype)
    if strided:
        x = _strided_copy(x)
    g = torch.randn(N, generator=gen)
    xs = x[:, v0:v1]
    case = _ce_id(case)

    run = Run(emu_binary, tmp_path)
    st_full = _stats_call(run, x, target, 0, ignore_index, eps > 0)
    st_shard = _stats_call(run, xs, target, v0, ignore_index, eps > 0)
    run.run()

    # The whole vocabulary: the loss from the statistics as tpx combines them at world size 1,
    # and the gradient, against F.cross_entropy on the same (rounded) logits.
    stats = st_full["stats"]
    lse = _check_stats(stats, x, target, 0, ignore_index, eps > 0, case)
    loss = lse - (1 - eps) * stats[:, 2]
    if eps > 0:
        loss = loss - eps / V * stats[:, 3]
    loss = loss.masked_fill(target == ignore_index, 0)
    ref_in = x.float().requires_grad_(True)
    ref = F.cross_entropy(ref_in, target, reduction="none", ignore_index=ignore_index,
                          label_smoothing=eps)
    ref.backward(g)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"loss {case}: {m}")

    shard_stats = st_shard["stats"]
    rl, rlse, rgrad = _ce_reference(xs, target, v0, V, ignore_index, eps, g)
    shard_lse = _check_stats(shard_stats, xs, target, v0, ignore_index, eps > 0, case + " shard")
    torch.testing.assert_close(shard_lse.double(), rlse, rtol=1e-5, atol=1e-5)

    out = torch.full((N, V), NAN_FILL, dtype=dtype)
    out_of_place = _backward_call(run, x, target, lse, g, 0, V, ignore_index, eps, out)
    y = x.contiguous().clone()
    in_place = _backward_call(run, y, target, lse, g, 0, V, ignore_index, eps)
    shard_out = torch.full((N, v1 - v0), NAN_FILL, dtype=dtype)
    shard_grad = _backward_call(run, xs, target, shard_lse, g, v0, V, ignore_index, eps,
                                shard_out)
    run.run()

    grad = out_of_place["grad"]
    torch.testing.assert_close(grad.float(), ref_in.grad, **_LOW_TOL[dtype],
                               msg=lambda m: f"grad {case}: {m}")
    # The CPU op of tpx (the ATen path) on the same inputs.
    aten = torch.ops.tpx.vocab_parallel_cross_entropy_backward(g, x, target, lse, 0, V,
                                                               ignore_index, eps)
    torch.testing.assert_close(grad.float(), aten.float(), **_LOW_TOL[dtype],
                               msg=lambda m: f"grad vs tpx CPU op {case}: {m}")
    assert torch.equal(in_place["grad"], grad), f"in-place grad != out-of-place grad: {case}"
    torch.testing.assert_close(shard_grad["grad"].double(), rgrad, **_LOW_TOL[dtype],
                               msg=lambda m: f"shard grad {case}: {m}")


# Embedding ----------------------------------------------------------------------------------

# (dtype, D, strided, padding_idx): the cases of test_cuda.py and fp16 D = 12 (24-byte rows),
# so that the forward copies in every unit: 16 bytes (D 8, 64, 256), 8 (fp16 D 12), 4
# (fp32 D 13, strided fp32) and 2 (bf16 D 13, fp16 D 7).
EMB_CASES = [
    (torch.float32, 8, False, None), (torch.float32, 13, True, 5),
    (torch.float32, 256, False, 5), (torch.bfloat16, 13, False, 5),
    (torch.bfloat16, 256, True, None), (torch.float16, 64, False, 5),
    (torch.float16, 7, True, None), (torch.float16, 12, False, None),
]


def _emb_id(c):
    return f"{str(c[0]).split('.')[-1]}-D{c[1]}-{'strided' if c[2] else 'dense'}-pad{c[3]}"


def _sorted_args(ids, vocab_start, num_local, padding_idx):
    """The sort keys of the deterministic backward, as vocab_cuda.cpp builds them."""
    local = ids.reshape(-1) - vocab_start
    valid = (local >= 0) & (local < num_local)
    if padding_idx >= 0:
        valid &= local != padding_idx
    keys = torch.where(valid, local, torch.full_like(local, num_local))
    return torch.sort(keys, stable=True)


def _backward_calls(run, gy, ids, vocab_start, num_local, pad, D, dtype):
    count = gy.shape[0]
    common = dict(grad=gy, grad_row_stride=gy.stride(0), dtype=DTYPES[dtype], count=count,
                  dim=D, num_local=num_local)
    atomic = run.call("embedding_backward_atomic", ["grad_weight"], ids=ids.reshape(-1),
                      vocab_start=vocab_start, padding_idx=pad,
                      grad_weight=torch.zeros(num_local, D), **common)
    sorted_rows, perm = _sorted_args(ids, vocab_start, num_local, pad)
    det = run.call("embedding_backward_sorted", ["grad_weight"], sorted_rows=sorted_rows,
                   perm=perm, grad_weight=torch.zeros(num_local, D, dtype=dtype), **common)
    return atomic, det


def _reference_grad(ids, gy, V, D, padding_idx):
    ref_w = torch.zeros(V, D, dtype=torch.float64, requires_grad=True)
    F.embedding(ids.reshape(-1), ref_w, padding_idx=padding_idx).backward(gy.double())
    return ref_w.grad


@pytest.mark.parametrize("case", EMB_CASES, ids=_emb_id)
def test_embedding_kernels(emu_binary, tmp_path, case):
    dtype, D, strided, padding_idx = case
    gen = torch.Generator().manual_seed(2000 + EMB_CASES.index(case))
    V = 1003
    full = torch.randn(V, D, generator=gen).to(dtype)
    if strided:
        full = _strided_copy(full)
    # Few distinct ids: many repeats per row, and runs that cross the deterministic
    # backward's chunk boundaries.
    ids = torch.randint(0, 40, (6, 35), generator=gen)
    ids.view(-1)[::7] = torch.randint(0, V, (ids.view(-1)[::7].numel(),), generator=gen)
    v0, v1 = 20, 500
    if padding_idx is not None:
        ids.view(-1)[1::5] = padding_idx
    # The edges of the table and of the shard [v0, v1), at positions clear of the padding.
    ids.view(-1)[[2, 3, 4, 5, 7, 8, 9]] = torch.tensor([0, v0 - 1, v0, v1 - 1, v1, V - 1, V - 2])
    gy = torch.randn(ids.numel(), D, generator=gen).to(dtype)
    if strided:
        gy = _strided_copy(gy)
    pad = -1 if padding_idx is None else padding_idx
    shard = full[v0:v1]
    local_pad = pad - v0 if padding_idx is not None else -1
    flat_ids = ids.reshape(-1)
    case = _emb_id(case)

    run = Run(emu_binary, tmp_path)
    fwd = run.call("embedding_forward", ["out"], weight=full, weight_row_stride=full.stride(0),
                   dtype=DTYPES[dtype], num_local=V, dim=D, ids=flat_ids, count=flat_ids.numel(),
                   vocab_start=0, out=torch.full((flat_ids.numel(), D), NAN_FILL, dtype=dtype))
    fwd_shard = run.call("embedding_forward", ["out"], weight=shard,
                         weight_row_stride=shard.stride(0), dtype=DTYPES[dtype],
                         num_local=v1 - v0, dim=D, ids=flat_ids, count=flat_ids.numel(),
                         vocab_start=v0,
                         out=torch.full((flat_ids.numel(), D), NAN_FILL, dtype=dtype))
    atomic, det = _backward_calls(run, gy, ids, 0, V, pad, D, dtype)
    atomic_s, det_s = _backward_calls(run, gy, ids, v0, v1 - v0, local_pad, D, dtype)
    run.run(seed=1)
    _, det_again = _backward_calls(run, gy, ids, 0, V, pad, D, dtype)
    run.run(seed=2)  # another interleaving of the threads and another block order

    assert torch.equal(fwd["out"], F.embedding(flat_ids, full)), f"forward {case}"
    held = (flat_ids >= v0) & (flat_ids < v1)
    expect = torch.where(held[:, None], F.embedding(flat_ids, full), torch.zeros((), dtype=dtype))
    assert torch.equal(fwd_shard["out"], expect), f"shard forward {case}"

    ref = _reference_grad(ids, gy, V, D, padding_idx)
    for name, got, want in [("atomic", atomic["grad_weight"], ref),
                            ("deterministic", det["grad_weight"], ref),
                            ("shard atomic", atomic_s["grad_weight"], ref[v0:v1]),
                            ("shard deterministic", det_s["grad_weight"], ref[v0:v1])]:
        # The atomic form accumulates in fp32 and is rounded once by the caller.
        got = got.to(dtype).double()
        torch.testing.assert_close(got, want, **_LOW_TOL[dtype],
                                   msg=lambda m: f"{name} grad {case}: {m}")
    if padding_idx is not None:
        assert not atomic["grad_weight"][padding_idx].any(), f"padding row got a gradient {case}"
        assert not det["grad_weight"][padding_idx].any(), f"padding row got a gradient {case}"
    assert torch.equal(det_again["grad_weight"], det["grad_weight"]), (
        f"deterministic grad not reproducible: {case}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_embedding_deterministic_long_run(emu_binary, tmp_path, dtype):
    """One id at 1000 of 1200 positions (a pad token without padding_idx): a run many times
    the deterministic backward's split of 128 sorted positions, so its sum is spread over
    chunk partials. Bitwise equal under two thread interleavings and block orders, and equal
    to the fp64 reference within fp32 summation error."""
    gen = torch.Generator().manual_seed(3000 + (dtype == torch.bfloat16))
    V, D, count = 64, 200, 1200  # D 200: two column groups of 128, the second partial
    ids = torch.randint(0, V, (count,), generator=gen)
    ids[torch.randperm(count, generator=gen)[:1000]] = 3
    gy = torch.randn(count, D, generator=gen).to(dtype)
    v0, num_local = 2, 30  # a shard that holds the long run, and the whole table

    def calls(run):
        out = []
        for start, n in ((0, V), (v0, num_local)):
            sorted_rows, perm = _sorted_args(ids, start, n, -1)
            out.append(run.call("embedding_backward_sorted", ["grad_weight"], grad=gy,
                                grad_row_stride=D, dtype=DTYPES[dtype], count=count, dim=D,
                                sorted_rows=sorted_rows, perm=perm, num_local=n,
                                grad_weight=torch.zeros(n, D, dtype=dtype)))
        return out

    run = Run(emu_binary, tmp_path)
    first = calls(run)
    run.run(seed=1)
    second = calls(run)
    run.run(seed=7)

    ref = _reference_grad(ids, gy, V, D, None)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else _LOW_TOL[dtype]
    for (a, b, want, what) in [(first[0], second[0], ref, "table"),
                               (first[1], second[1], ref[v0:v0 + num_local], "shard")]:
        assert torch.equal(a["grad_weight"], b["grad_weight"]), f"{what}: not reproducible"
        torch.testing.assert_close(a["grad_weight"].double(), want, **tol,
                                   msg=lambda m: f"{what} grad: {m}")
