"""tpx.plans.check against planted plan mistakes, at TP 2 and 4: it names the module whose
output first differs from the unsharded model, the parameters whose gradients differ, the
replicas that drift; a correct plan passes clean."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpx
from harness import run_ranks
from tpx.parallel import ColwiseParallel, ReplicatedWithGradAllReduce, RowwiseParallel


class Attention(nn.Module):
    """Fused q|k|v projection, a per-head q norm (one weight of head_dim), causal attention,
    output projection."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_norm = nn.RMSNorm(dim // heads)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.wqkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q = self.q_norm(q)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.attn = Attention(dim)
        self.up = nn.Linear(dim, 64)
        self.down = nn.Linear(64, dim)
        self.head = nn.Linear(dim, 16)

    def forward(self, x):
        x = x + self.attn(x)
        x = x + self.down(F.gelu(self.up(x)))
        return self.head(x)


def _plan(fused_ok=True, norm_ok=True, mlp=True):
    d = 32
    plan = {"attn.wqkv": ColwiseParallel(segments=(d, d, d), head_size=8) if fused_ok
            else ColwiseParallel(),
            "attn.wo": RowwiseParallel()}
    if norm_ok:
        plan["attn.q_norm"] = ReplicatedWithGradAllReduce()
    if mlp:
        plan.update({"up": ColwiseParallel(), "down": RowwiseParallel()})
    return plan


def _set_local_heads(model, world):
    model.attn.heads //= world  # the module's own head count (what ShardedAttention does)


def _check(rank, world):
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(0)
    base = Block()
    with torch.no_grad():
        base.attn.q_norm.weight.copy_(1 + 0.2 * torch.randn(8, generator=gen))
    x = torch.randn(2, 6, 32, generator=gen)
    import copy

    # A correct plan: clean.
    report = tpx.plans.check(copy.deepcopy(base), None, _plan(), x)
    assert report.ok, str(report)
    assert [n for n, _ in report.left_whole] == ["head"], report.left_whole
    # The fused q|k|v split as one projection: every rank holds the wrong features. The
    # projection's own output is right (each rank's columns); the first module to read them
    # as q is the first that differs.
    report = tpx.plans.check(copy.deepcopy(base), None, _plan(fused_ok=False), x)
    assert not report.ok and report.first_divergent_module[0] == "attn.q_norm", str(report)
    assert report.last_matching_module == "attn.wqkv", str(report)
    # The per-head norm without its gradient sum: right outputs, wrong gradient, drifting
    # replicas.
    report = tpx.plans.check(copy.deepcopy(base), None, _plan(norm_ok=False), x)
    assert report.first_divergent_module is None, str(report)
    assert [n for n, _ in report.grad_errors] == ["attn.q_norm.weight"], str(report)
    assert any("q_norm.weight (grad)" in r for r in report.replica_errors), str(report)
    with pytest.raises(RuntimeError, match="q_norm"):
        tpx.plans.check(copy.deepcopy(base), None, _plan(norm_ok=False), x, strict=True)
    if rank == 0:
        print(report)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_plan_check(world):
    run_ranks(_check, world)


def _check_qwen3(rank, world):
    """Hugging Face's Qwen3 with its TP plan written as tpx styles: plain q_norm / k_norm (the
    per-head norms after the column-parallel q / k projections) are named by the check, their
    gradients and replicas; with ReplicatedWithGradAllReduce the plan is clean. Phi-3's fused
    gate_up under a plain ColwiseParallel: named at the activation after it."""
    import copy

    import transformers

    from tpx.parallel import ShardedAttention

    cfg = transformers.Qwen3Config(vocab_size=211, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    ids = torch.randint(0, 211, (2, 9), generator=torch.Generator().manual_seed(1))
    pre = "model.layers.*."
    plan = {pre + "self_attn": ShardedAttention(4, 2),
            pre + "self_attn.q_proj": ColwiseParallel(head_size=16),
            pre + "self_attn.k_proj": ColwiseParallel(head_size=16, replicate_heads=True),
            pre + "self_attn.v_proj": ColwiseParallel(head_size=16, replicate_heads=True),
            pre + "self_attn.o_proj": RowwiseParallel(),
            pre + "mlp.gate_proj": ColwiseParallel(), pre + "mlp.up_proj": ColwiseParallel(),
            pre + "mlp.down_proj": RowwiseParallel()}

    def loss(out):
        return out.logits.float().pow(2).mean()

    report = tpx.plans.check(copy.deepcopy(model), None, plan, ids, loss_fn=loss)
    norms = {f"model.layers.{i}.self_attn.{n}_norm.weight" for i in (0, 1) for n in "qk"}
    assert {n for n, _ in report.grad_errors} == norms, str(report)
    assert len(report.replica_errors) == 4 and report.output_error < 1e-4, str(report)
    fixed = dict(plan, **{pre + "self_attn.q_norm": ReplicatedWithGradAllReduce(),
                          pre + "self_attn.k_norm": ReplicatedWithGradAllReduce()})
    report = tpx.plans.check(copy.deepcopy(model), None, fixed, ids, loss_fn=loss)
    assert report.ok, str(report)

    # Phi-3's fused [gate | up] projection under a plain ColwiseParallel(): each rank holds a
    # block of gate features or of up features, never matching halves, and the MLP multiplies
    # the wrong pairs. Its own output is right (its columns); the activation after the split
    # is the first module that differs. Split by segments, the plan is clean.
    cfg = transformers.Phi3Config(vocab_size=211, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=4, pad_token_id=0)
    torch.manual_seed(0)
    phi3 = transformers.AutoModelForCausalLM.from_config(cfg)
    mlp = {"model.layers.*.mlp.down_proj": RowwiseParallel()}
    naive = dict(mlp, **{"model.layers.*.mlp.gate_up_proj": ColwiseParallel()})
    report = tpx.plans.check(copy.deepcopy(phi3), None, naive, ids, loss_fn=loss)
    assert not report.ok, str(report)
    assert report.first_divergent_module[0] == "model.layers.0.mlp.activation_fn", str(report)
    assert report.last_matching_module == "model.layers.0.mlp.gate_up_proj", str(report)
    halves = dict(mlp, **{"model.layers.*.mlp.gate_up_proj": ColwiseParallel(segments=(96, 96))})
    report = tpx.plans.check(copy.deepcopy(phi3), None, halves, ids, loss_fn=loss)
    assert report.ok, str(report)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_plan_check_qwen3(world):
    run_ranks(_check_qwen3, world)


class NonParametricNorm(nn.Module):
    """A layer norm without weights (OLMo's), written as users do: over the last dim it gets."""

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:])


def _check_multidim_and_older_api(rank, world):
    """Beyond 1-D: the 2-D plan of examples/tiny_llama.py's decoder is clean; the same plan
    with weightless norms left out of it (each normalises its rank's block of the hidden
    dimension) is named at the first norm. The older PyTorch API
    (``PairwiseParallel`` on an MLP) through the same check."""
    import copy

    from tiny_llama import Decoder

    from tpx.parallel import PairwiseParallel

    torch.manual_seed(0)
    model = Decoder(vocab=64, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, hidden=24)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(1))
    mesh = tpx.init_mesh("2d")
    plan = tpx.plans.auto(model, layout="2d")
    report = tpx.plans.check(copy.deepcopy(model), mesh, plan, ids)
    assert report.ok, str(report)
    # Norms without weights look like nothing to shard; left out of the plan, each normalises
    # its rank's block of the hidden dimension.
    for block in model.layers:
        block.attention_norm, block.ffn_norm = NonParametricNorm(), NonParametricNorm()
    no_norms = {k: v for k, v in plan.items() if not k.endswith("_norm")}
    report = tpx.plans.check(copy.deepcopy(model), mesh, no_norms, ids)
    assert not report.ok, str(report)
    assert report.first_divergent_module[0] == "layers.0.attention_norm", str(report)
    if rank == 0:
        print(report)

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 40), nn.ReLU(), nn.Linear(40, 16))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    report = tpx.plans.check(copy.deepcopy(mlp), None, PairwiseParallel(), x)
    assert report.ok, str(report)


def test_plan_check_multidim_and_older_api():
    run_ranks(_check_multidim_and_older_api, 4)


class _KeyBiasAttention(nn.Module):
    """Attention whose key projection has a bias: softmax does not see it, so its gradient
    is zero in exact arithmetic and rounding noise in float32."""

    def __init__(self, d=32, h=4):
        super().__init__()
        self.hd = d // h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = (p(x).view(n, t, -1, self.hd).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(n, t, -1))  # this rank's heads


def _key_bias(rank, world):
    torch.manual_seed(0)
    model = _KeyBiasAttention()
    x = torch.randn(2, 9, 32)
    ref = _KeyBiasAttention()
    ref.load_state_dict(model.state_dict())
    ref(x).pow(2).mean().backward()
    kb, kw = ref.k.bias.grad.abs().max(), ref.k.weight.grad.abs().max()
    assert kb < 100 * torch.finfo(torch.float32).eps * kw  # noise beside its weight's
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "o": RowwiseParallel()}
    report = tpx.plans.check(model, None, plan, x, rtol=1e-3)
    assert report.ok, str(report)  # the noise is not a difference


def test_a_gradient_at_rounding_noise_is_not_a_difference():
    run_ranks(_key_bias, 2)
