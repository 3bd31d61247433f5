"""Pretrained Hugging Face checkpoints into TP: tpx.from_pretrained and the build-on-meta,
shard, to_empty, load flow, against the unsharded model that wrote the checkpoint (logits, one
training step), with transformers' own save_pretrained files (per-expert MoE layout included);
the lazy reads of the files against eager torch; the check that nothing to_empty left
uninitialized reaches a forward; tied embeddings with any plan, and keys the files do not hold
(named, or set as transformers sets them), against transformers' own one-device load."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tpx
import tpx.checkpoint
from harness import run_ranks
from tpx.checkpoint import lazy

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

V = 1003


# ---------------------------------------------------------------------------------------------
# Lazy tensors of the files against eager torch (one process).

def _sources(tmp_path, tensors):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = str(tmp_path / "t.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    f = safe_open(path, framework="pt", device="cpu")
    mapped = lazy.map_safetensors(path)
    assert sorted(mapped) == sorted(tensors)
    # half of them read through the mapped file, half through safetensors' slices
    return f, {k: lazy.Source(f.get_slice(k), k, path, mapped[k] if i % 2 else None)
               for i, k in enumerate(tensors)}


def _random_region(shape, g):
    out = []
    for n in shape:
        a = int(torch.randint(0, n, (1,), generator=g))
        b = int(torch.randint(a + 1, n + 1, (1,), generator=g))
        out.append((a, b))
    return tuple(out)


def test_lazy_reads_equal_eager(tmp_path):
    g = torch.Generator().manual_seed(0)
    experts = {f"e{i}": torch.randn(6, 5, generator=g) for i in range(4)}
    ups = {f"u{i}": torch.randn(6, 5, generator=g) for i in range(4)}
    fused = {"qkv": torch.randn(12, 5, generator=g), "gu": torch.randn(3, 5, 8, generator=g)}
    f, src = _sources(tmp_path, {**experts, **ups, **fused})
    e = torch.stack([experts[f"e{i}"] for i in range(4)])
    u = torch.stack([ups[f"u{i}"] for i in range(4)])
    ls = torch.stack([src[f"e{i}"] for i in range(4)])
    lu = torch.stack([src[f"u{i}"] for i in range(4)])
    cases = {
        "stack": (ls, e),
        "stack dim 1": (torch.stack([src["e0"], src["e1"]], dim=1),
                        torch.stack([experts["e0"], experts["e1"]], dim=1)),
        "stack+cat": (torch.cat([ls, lu], dim=1), torch.cat([e, u], dim=1)),
        "chunk": (torch.chunk(src["qkv"], 3, dim=0)[1], torch.chunk(fused["qkv"], 3, dim=0)[1]),
        "split": (torch.split(src["qkv"], [2, 7, 3], dim=0)[1],
                  torch.split(fused["qkv"], [2, 7, 3], dim=0)[1]),
        "transpose": (torch.transpose(torch.cat([ls, lu], dim=1), 1, 2).contiguous(),
                      torch.cat([e, u], dim=1).transpose(1, 2)),
        "unsqueeze/squeeze": (src["qkv"].unsqueeze(0).unsqueeze(2).squeeze(0),
                              fused["qkv"].unsqueeze(1)),
        "interleave (reshape)": (
            src["gu"].reshape(3, 5, 4, 2).transpose(2, 3).reshape(3, 5, 8),
            fused["gu"].reshape(3, 5, 4, 2).transpose(2, 3).reshape(3, 5, 8)),
        "index": (src["gu"][1, :, 2:6], fused["gu"][1, :, 2:6]),
        "ellipsis": (src["gu"][..., 3], fused["gu"][..., 3]),
    }
    for name, (lz, ref) in cases.items():
        assert tuple(lz.shape) == tuple(ref.shape), name
        torch.testing.assert_close(lz.read(), ref, rtol=0, atol=0, msg=name)
        for _ in range(5):
            region = _random_region(ref.shape, g)
            want = ref[tuple(slice(a, b) for a, b in region)]
            torch.testing.assert_close(lz.read(region), want, rtol=0, atol=0, msg=name)
            # into a strided destination (a transposed view), in another dtype
            out = torch.empty(want.shape[::-1], dtype=torch.float64).t() if want.dim() == 2 \
                else torch.empty(want.shape, dtype=torch.float64)
            lz.read_into(region, out)
            torch.testing.assert_close(out, want.double(), rtol=0, atol=0, msg=name)
    assert ls.sliced and not cases["interleave (reshape)"][0].sliced
    with pytest.raises(lazy.NotSliceable, match="torch.add"):
        torch.add(src["e0"], src["e1"])
    with pytest.raises(lazy.NotSliceable, match="padding"):  # a vocabulary padded on save
        src["e0"].new_zeros(3, *src["e0"].shape[1:])


# ---------------------------------------------------------------------------------------------
# Whole models at TP 2 (and more in the slow tier), against the model that wrote the files.

def _config(family):
    import hf_tiny

    if family in ("llama", "llama_tied", "llama_2d", "llama6", "llama6_tied"):
        six = family.startswith("llama6")  # 6 heads (KV too): TP 2 and TP 3
        return transformers.LlamaConfig(  # 2-D layouts split the vocabulary in equal blocks
            vocab_size=1000 if family == "llama_2d" else V, hidden_size=48 if six else 64,
            intermediate_size=88, num_hidden_layers=2, num_attention_heads=6 if six else 8,
            num_key_value_heads=6 if six else 2, max_position_embeddings=64,
            tie_word_embeddings=family.endswith("_tied"))
    return hf_tiny.tiny_config(family)  # gemma3_text (scaled embedding, tied), MoE families


def _ids(seed=11):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (2, 12), generator=g)


def _write(rank, family, path, dtype=torch.float32):
    """The unsharded model (same seed on every rank), written by transformers on rank 0."""
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_config(family))
    ref = ref.to(dtype)
    if rank == 0:
        ref.save_pretrained(path)
    dist.barrier()
    return ref


def _step(m):
    ids = _ids()
    m.train()
    m(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(m.parameters(), lr=0.5).step()
    m.zero_grad()


def _compare_step(model, ref, what, rtol=1e-5, atol=1e-5):
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=rtol, atol=atol, msg=lambda m: f"{what} logits: {m}")
    for m in (model, ref):
        _step(m)
    full = tpx.checkpoint.full_state_dict(model)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=10 * rtol, atol=10 * atol,
                                   msg=lambda m: f"{what} after a step, {key}: {m}")


def _from_pretrained(rank, world, family, path, experts="tp"):
    ref = _write(rank, family, path)
    model, info = tpx.from_pretrained(path, experts=experts, output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [], info
    assert not model.training  # as transformers returns it
    assert all(p.device.type == "cpu" for p in model.parameters())
    if family in ("llama_tied", "gemma3_text"):
        assert model.lm_head.weight is model.model.embed_tokens.weight
    _compare_step(model, ref, f"{family} TP={world}")


@pytest.mark.parametrize("family,experts", [
    ("llama", "tp"), ("llama_tied", "tp"), ("gemma3_text", "tp"),
    ("qwen3_moe", "tp"), ("qwen3_moe", "ep"),
    pytest.param("mixtral", "tp", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", "tp", marks=pytest.mark.slow)])
def test_from_pretrained_tp2(tmp_path, family, experts):
    run_ranks(_from_pretrained, 2, family, str(tmp_path / "hf"), experts)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_from_pretrained_tp4(tmp_path, family):
    run_ranks(_from_pretrained, 4, family, str(tmp_path / "hf"))


def _moe_files_per_expert(rank, world, path):
    from safetensors import safe_open

    _write(rank, "qwen3_moe", path)
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    # transformers writes the Hub's layout (one tensor per expert), not the fused parameter
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in keys, keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)


def test_moe_checkpoint_is_per_expert(tmp_path):
    run_ranks(_moe_files_per_expert, 1, str(tmp_path / "hf"))


def _bf16_files(rank, world, path):
    ref = _write(rank, "llama", path, dtype=torch.bfloat16)
    model = tpx.from_pretrained(path)  # dtype="auto": the config's, bf16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    full = tpx.checkpoint.full_state_dict(model)
    for key, value in ref.state_dict().items():
        assert torch.equal(full[key], value), key  # read as stored, no rounding on the way
    model32 = tpx.from_pretrained(path, dtype=torch.float32)
    assert {p.dtype for p in model32.parameters()} == {torch.float32}
    full = tpx.checkpoint.full_state_dict(model32)
    for key, value in ref.state_dict().items():
        assert torch.equal(full[key], value.float()), key


def test_from_pretrained_bf16_files(tmp_path):
    run_ranks(_bf16_files, 2, str(tmp_path / "hf"))


def _hub_cache(rank, world, root):
    """A Hub id read from the local cache (the layout huggingface_hub keeps)."""
    snap = os.path.join(root, "models--tpx-test--tiny-llama", "snapshots", "0" * 40)
    ref = _write(rank, "llama", snap)
    if rank == 0:
        os.makedirs(os.path.join(root, "models--tpx-test--tiny-llama", "refs"))
        with open(os.path.join(root, "models--tpx-test--tiny-llama", "refs", "main"), "w") as f:
            f.write("0" * 40)
    dist.barrier()
    model = tpx.from_pretrained("tpx-test/tiny-llama", cache_dir=root)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        tpx.from_pretrained("tpx-test/not-there", cache_dir=root)


def test_from_pretrained_hub_id_in_cache(tmp_path):
    run_ranks(_hub_cache, 2, str(tmp_path / "hub"))


def _three_steps(rank, world, family, path):
    """Build on meta, shard, to_empty, load: the same model, rotary tables and Gemma's scale
    (buffers the files do not hold) set as transformers sets them."""
    ref = _write(rank, family, path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config(family))
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    model.to_empty(device="cpu")
    with pytest.raises(RuntimeError, match=r"built on the meta device, given memory by "
                                           r"to_empty and never written since"):
        model(input_ids=_ids())  # nothing loaded yet: refused, not garbage
    result = tpx.checkpoint.load_hf_checkpoint(model, path)
    assert result == [] and result.missing_keys == []
    assert "model.rotary_emb.inv_freq" in result.recomputed or family == "gemma3_text"
    _compare_step(model, ref, f"{family} three steps")


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_meta_shard_to_empty_load(tmp_path, family):
    run_ranks(_three_steps, 2, family, str(tmp_path / "hf"))


def _without(rank, path, drop):
    """A copy of the checkpoint ``path`` without the tensors ``drop`` (rank 0 writes it)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    part = path + "-partial"
    if rank == 0:
        os.makedirs(part)
        with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
            assert set(drop) <= set(f.keys())
            kept = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
        save_file(kept, os.path.join(part, "model.safetensors"), metadata={"format": "pt"})
        for name in ("config.json", "generation_config.json"):
            with open(os.path.join(path, name)) as a, open(os.path.join(part, name), "w") as b:
                b.write(a.read())
    dist.barrier()
    return part


def _missing_reported(rank, world, path):
    """Keys the files do not hold: named on every rank before anything is loaded (strict), or
    named and set as transformers sets them (strict=False): the values of transformers' own
    one-device load from the same seed, a sharded weight included, with any plan."""
    cases = [("llama6", ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]),
             ("llama6_tied", ["model.embed_tokens.weight"])]  # the tie's only tensor
    parts = {}
    for family, drop in cases:
        src = f"{path}-{family}"
        _write(rank, family, src)
        part = parts[family] = _without(rank, src, drop)
        torch.manual_seed(7)
        one, one_info = transformers.AutoModelForCausalLM.from_pretrained(
            part, output_loading_info=True)
        missing = sorted(one_info["missing_keys"])  # the tied lm_head.weight too, when both go
        ids = _ids()
        with torch.no_grad():
            want = one(input_ids=ids).logits
        with pytest.raises(ValueError, match=r"does not hold \[.*\].*nothing was loaded") as e:
            tpx.from_pretrained(part)
        assert all(f"'{k}'" in str(e.value) for k in missing), (str(e.value), missing)
        for plan in ({}, None):
            torch.manual_seed(7)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model, info = tpx.from_pretrained(part, plan=plan, strict=False,
                                                  output_loading_info=True)
            said = [str(w.message) for w in caught if "load_hf_checkpoint" in str(w.message)]
            assert len(said) == 1 and "set by the model's _init_weights" in said[0], said
            assert all(f"'{k}'" in said[0] for k in missing), (said, missing)
            assert sorted(info["missing_keys"]) == missing, (info, missing)
            full = tpx.checkpoint.full_state_dict(model)
            for key, value in one.state_dict().items():
                assert torch.equal(full[key], value), (family, plan, key)
            with torch.no_grad():
                torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5,
                                           atol=1e-5)
            if family == "llama6_tied":
                assert model.lm_head.weight is model.model.embed_tokens.weight
    # A tensor that no initialization sets: named, and refused by the first forward.
    from unittest import mock

    with mock.patch.object(transformers.LlamaPreTrainedModel, "_init_weights",
                           lambda self, module: None), \
            pytest.warns(UserWarning, match=r"still hold what to_empty left.*'model.norm.weight'"):
        model = tpx.from_pretrained(parts["llama6"], plan={}, strict=False)
    with pytest.raises(RuntimeError, match=r"never written since.*'model.norm.weight'"):
        model(input_ids=ids)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_missing_keys_reported_and_set_as_transformers_sets_them(tmp_path, world):
    run_ranks(_missing_reported, world, str(tmp_path / "hf"))


def _tied_any_plan(rank, world, path):
    """A checkpoint of tied embeddings (save_pretrained leaves lm_head.weight out of the files)
    read with any plan: tied as on one device (a plan that shards the head alone keeps the
    embedding whole, and the head reads its part of the embedding's tensor), the logits of
    transformers' one-device load, nothing reported missing."""
    from torch.distributed.tensor import Replicate

    _write(rank, "llama6_tied", path)
    one = transformers.AutoModelForCausalLM.from_pretrained(path)
    ids = _ids()
    with torch.no_grad():
        want = one(input_ids=ids).logits
    mlp = {"model.layers.*.mlp.gate_proj": tpx.ColwiseParallel(),
           "model.layers.*.mlp.up_proj": tpx.ColwiseParallel(),
           "model.layers.*.mlp.down_proj": tpx.RowwiseParallel()}
    cases = [("plan={}, strict=False", dict(plan={}, strict=False)), ("plan={}", dict(plan={})),
             ("the default plan", {}), ("the MLPs only", dict(plan=mlp)),
             ("the head only", dict(plan={"lm_head": tpx.ColwiseParallel(
                 output_layouts=Replicate())}))]
    for what, kwargs in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, info = tpx.from_pretrained(path, output_loading_info=True, **kwargs)
        assert not [w for w in caught if "load_hf_checkpoint" in str(w.message)], what
        assert info["missing_keys"] == [] and info["unexpected_keys"] == [], (what, info)
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        assert tied == (what != "the head only"), what
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5,
                                       atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_tied_embeddings_with_any_plan(tmp_path, world):
    run_ranks(_tied_any_plan, world, str(tmp_path / "hf"))


class _Rope(nn.Module):
    """A plain decoder piece in torchtitan's manner: a rotary table rebuilt by init_weights."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.register_buffer("freqs", torch.arange(16.0), persistent=False)

    def init_weights(self):
        nn.init.normal_(self.up.weight)
        nn.init.zeros_(self.up.bias)
        nn.init.normal_(self.down.weight)
        nn.init.zeros_(self.down.bias)
        self.freqs = torch.arange(16.0)  # a new tensor, as torchtitan's init_weights does

    def forward(self, x):
        return self.down(torch.relu(self.up(x * self.freqs)))


def _own_init(rank, world):
    with torch.device("meta"):
        m = _Rope()
    tpx.parallelize_module(m, None, {"up": tpx.ColwiseParallel(), "down": tpx.RowwiseParallel()})
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.init_weights()
    m(torch.randn(2, 16))  # written in place or replaced: not flagged
    assert "_apply" not in vars(m)  # checked once, then no longer watched


def test_own_initialization_is_not_flagged():
    run_ranks(_own_init, 2)


def _two_d(rank, world, path):
    ref = _write(rank, "llama_2d", path)
    model = tpx.from_pretrained(path, device_mesh=tpx.init_mesh("2d"), layout="2d")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 1000, (4, 12), generator=g)  # the batch divides by q = 2
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    files = tpx.checkpoint.save_pretrained(model, path + "-out")  # blocks, each written once
    total = torch.tensor([files.bytes_written])
    dist.all_reduce(total)
    assert int(total) == sum(t.numel() * t.element_size() for t in _tensors(path).values())
    if rank == 0:
        mine, theirs = _tensors(path + "-out"), _tensors(path)
        assert sorted(mine) == sorted(theirs)
        for k, v in theirs.items():
            assert torch.equal(mine[k], v), k


@pytest.mark.slow
def test_from_pretrained_2d_layout(tmp_path):
    run_ranks(_two_d, 4, str(tmp_path / "hf"))


# ---------------------------------------------------------------------------------------------
# Saving back: every rank writes its part; the files are transformers' own layout.

def _tensors(path):
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _save_back(rank, world, family, src, out, experts):
    ref = _write(rank, family, src)
    model = tpx.from_pretrained(src, experts=experts)
    # as loaded: the files hold what transformers wrote, tensor for tensor, bit for bit
    files = model.save_pretrained(out + "-as-loaded", max_shard_size="40KB")
    assert len(files) > 1 and os.path.exists(os.path.join(out + "-as-loaded",
                                                          "model.safetensors.index.json"))
    total = torch.tensor([files.bytes_written])
    dist.all_reduce(total)  # every element written once, by one rank
    expected = sum(t.numel() * t.element_size() for t in _tensors(src).values())
    assert int(total) == expected, (int(total), expected)
    if rank == 0:
        mine, theirs = _tensors(out + "-as-loaded"), _tensors(src)
        assert sorted(mine) == sorted(theirs)
        for k, v in theirs.items():
            assert mine[k].dtype == v.dtype and torch.equal(mine[k], v), k
    # after a training step: transformers reads the directory on one device
    _step(model)
    _step(ref)
    model.save_pretrained(out)
    if rank == 0:
        ref.save_pretrained(out + "-ref")
    dist.barrier()
    one = transformers.AutoModelForCausalLM.from_pretrained(out)
    theirs = ref.state_dict()
    for key, value in one.state_dict().items():
        torch.testing.assert_close(value, theirs[key], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{family} TP={world} saved {key}: {m}")


def _reload(rank, world, out):
    """The directory tpx wrote, read at another TP degree, against the one-device model."""
    model = tpx.from_pretrained(out)
    ref = transformers.AutoModelForCausalLM.from_pretrained(out + "-ref")
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,experts,world,again", [
    ("llama", "tp", 2, 4), ("llama", "tp", 4, 2),  # TP 4: KV heads replicated, written once
    ("llama_tied", "tp", 2, 1), ("gemma3_text", "tp", 2, 1),
    ("qwen3_moe", "tp", 2, 1), ("qwen3_moe", "ep", 2, 1)])
def test_save_pretrained_every_rank_writes(tmp_path, family, experts, world, again):
    out = str(tmp_path / "out")
    run_ranks(_save_back, world, family, str(tmp_path / "hf"), out, experts)
    run_ranks(_reload, again, out)


def _save_failures(rank, world, path):
    _write(rank, "llama", path)
    model = tpx.from_pretrained(path)
    with pytest.raises(ValueError, match="max_shard_size"):
        tpx.checkpoint.save_pretrained(model, path + "-x", max_shard_size="a lot")
    blocked = path + "-blocked"
    if rank == 0:
        with open(blocked, "w") as f:  # a file where the directory should go
            f.write("x")
    dist.barrier()
    # rank 0 cannot create the directory: it raises its error, its peers a prompt one
    with pytest.raises((FileExistsError, NotADirectoryError) if rank == 0 else RuntimeError,
                       match="" if rank == 0 else "another rank failed"):
        model.save_pretrained(blocked)
    model.save_pretrained(path + "-ok")  # the group is still usable


def test_save_pretrained_failure_on_one_rank(tmp_path):
    run_ranks(_save_failures, 2, str(tmp_path / "hf"))


def _save_positioned(rank, world, src, out):
    """Ranks on several hosts write with pwrite (a shared mapping would write back whole
    pages of a network file system): the same files."""
    from unittest import mock

    _write(rank, "qwen3_moe", src)
    model = tpx.from_pretrained(src)
    with mock.patch("tpx.checkpoint.hf_write._one_host", return_value=False), \
            mock.patch("tpx.checkpoint.hf_write._Mapped", side_effect=AssertionError):
        files = model.save_pretrained(out, max_shard_size="40KB")
    total = torch.tensor([files.bytes_written])
    dist.all_reduce(total)
    theirs = _tensors(src)
    assert int(total) == sum(t.numel() * t.element_size() for t in theirs.values())
    if rank == 0:
        mine = _tensors(out)
        assert sorted(mine) == sorted(theirs)
        for k, v in theirs.items():
            assert torch.equal(mine[k], v), k


def test_save_pretrained_with_pwrite(tmp_path):
    run_ranks(_save_positioned, 4, str(tmp_path / "hf"), str(tmp_path / "out"))


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_finetune_example(tmp_path, lora):
    """examples/finetune_hf.py as a user runs it: checkpoint in, TP (LoRA), steps, checkpoint
    out, read back on one process (it asserts the logits itself)."""
    import sys

    from harness import free_port, run_command

    if lora:
        pytest.importorskip("peft")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), os.path.join(root, "examples", "finetune_hf.py"),
           "--make-tiny", "tiny", "--model", "tiny", "--out", "out", "--steps", "3",
           "--seq", "16", "--lr", "1e-3"] + (["--lora"] if lora else [])
    r = run_command(cmd, cwd=str(tmp_path), timeout=300,
                    env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "read back on one process: largest logit difference" in r.stdout
    assert os.path.exists(tmp_path / "out" / ("adapter_model.safetensors" if lora
                                               else "model.safetensors"))


def _adapter_on_top(rank, world, src, adapter):
    """A pretrained model read by tpx.from_pretrained, then a LoRA adapter trained on one
    device loaded on top (peft's PeftModel.from_pretrained, tpx's layers registered): the
    logits and one training step of the adapters as on one device."""
    peft = pytest.importorskip("peft")
    from tpx.nn import lora

    ref = _write(rank, "llama", src)
    if rank == 0:
        torch.manual_seed(3)
        one = peft.get_peft_model(ref, peft.LoraConfig(r=4, lora_alpha=8,
                                                       target_modules=["q_proj", "v_proj"]))
        for n, p in one.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p)  # not the zero start: the adapter changes the logits
        one.save_pretrained(adapter)
    dist.barrier()
    ref = peft.PeftModel.from_pretrained(ref, adapter, is_trainable=True)
    model = tpx.from_pretrained(src)
    config = lora.register(peft.LoraConfig.from_pretrained(adapter))
    model = peft.PeftModel.from_pretrained(model, adapter, config=config, is_trainable=True)
    _compare_step(model, ref, f"adapter on top, TP={world}")


def test_adapter_on_a_pretrained_model(tmp_path):
    run_ranks(_adapter_on_top, 2, str(tmp_path / "hf"), str(tmp_path / "adapter"))
