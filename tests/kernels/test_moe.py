"""The MoE block (``fastgrpo.kernels.moe``) against its fp32 reference and against transformers' Qwen3-MoE block.

Two paths on CPU: the Triton kernels under the interpreter (``kernel``) and the per-expert torch path (``torch``,
forced by patching ``use_triton``). Forward and backward (a random upstream gradient) to hidden, both expert weights,
the routing weights and, through the router, the router weight.

Tolerance (flash-attn's rule, max over elements): ``|out − ref_fp32| ≤ 2·|ref_lowp − ref_fp32| + atol`` with
``ref_lowp`` the reference in the inputs' dtype (for fp32 inputs it is ``ref_fp32`` and ``atol`` carries the bound).
``atol = rel · max|ref_fp32|`` (a floor keeps an all-zero gradient well posed): for fp32 ``rel = 16·eps32·L`` with
``L = H + 2I + S`` the summed lengths of the chain's reductions (the gate/up and down products, and the ``S``
pairs an expert's weight gradient sums over), each reduction's rounding error being at most its length times eps of
its terms' magnitude, with a factor 16 for the cancellation that makes ``max|ref|`` smaller than the terms; for bf16
``ref_lowp`` carries the bound and ``rel`` adds one ulp (2⁻⁸) of the final rounding, which the two sides do apart.

The routing is discrete: a comparison between fp32 and bf16 routers is only meaningful when both pick the same
experts, so such cases are skipped (hypothesis: rejected) when the two top-K sets differ.
"""

import importlib

import pytest
import torch
from checks import EPS32, assert_flash
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

moe = importlib.import_module("fastgrpo.kernels.moe")  # the module (its use_triton is patched), not a function
BF16_ULP = 2.0**-8
FLOOR = 1e-6


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """The Triton kernels (interpreted on CPU tensors) or the per-expert torch path."""
    if request.param == "kernel" and not moe.use_triton(torch.empty(1)):
        pytest.skip("the kernel path on CPU tensors needs TRITON_INTERPRET=1 (set by conftest.py without CUDA)")
    if request.param == "torch":
        monkeypatch.setattr(moe, "use_triton", lambda t: False)
    return request.param


def _weights(E, H, I, dtype, seed):
    """Router ``[E, H]``, gate_up ``[E, 2I, H]``, down ``[E, H, I]`` (leaves), scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    wr = (torch.randn(E, H, generator=g) / H**0.5).to(dtype).requires_grad_()
    gu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype).requires_grad_()
    dn = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype).requires_grad_()
    return wr, gu, dn


def _routing(T, E, K, allowed, seed):
    """``ids [T, K]``: each token a random K-subset of the first ``allowed`` experts (``allowed = K``: every token on
    the same experts; ``allowed < E``: the others empty); weights ``[T, K]`` positive."""
    g = torch.Generator().manual_seed(seed + 1)
    perm = torch.stack([torch.randperm(allowed, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    ids = perm.long().view(T, K)
    w = torch.rand(T, K, generator=g) + 0.1
    return ids, w


def _atol(ref, dtype, L):
    rel = 16 * EPS32 * L + (BF16_ULP if dtype == torch.bfloat16 else 0.0)
    return max(rel * (ref.abs().max().item() if ref.numel() else 0.0), FLOOR)


def _run(fn, leaves, upstream):
    """``(outputs, grads of leaves)`` for ``Σ out·upstream``."""
    out = fn()
    grads = torch.autograd.grad((out.float() * upstream).sum(), leaves, allow_unused=True)
    return out.detach().float(), [torch.zeros_like(x).float() if gr is None else gr.float()
                                  for x, gr in zip(leaves, grads)]


def _compare(fn, ref, leaves, upstream, dtype, L, names):
    out, grads = _run(fn, leaves, upstream)
    out32, grads32 = _run(lambda: ref(True), leaves, upstream)
    outlo, gradslo = _run(lambda: ref(False), leaves, upstream)
    for name, a, r, lo in zip(["out", *names], [out, *grads], [out32, *grads32], [outlo, *gradslo]):
        assert_flash(name, a, r, lo, _atol(r, dtype, L))


def _experts_case(T, H, I, E, K, allowed, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(T, H, generator=g).to(device, dtype).requires_grad_()
    gu, dn = (t.detach().to(device).requires_grad_() for t in _weights(E, H, I, dtype, seed)[1:])
    ids, w = (t.to(device) for t in _routing(T, E, K, allowed, seed))
    w = w.to(dtype).requires_grad_()
    upstream = torch.randn(T, H, generator=g).to(device)

    def fn():
        return moe.moe_experts(x, gu, dn, ids, w)

    def ref(upcast):
        return moe.moe_experts_reference(x, gu, dn, ids, w, upcast=upcast)

    _compare(fn, ref, [x, gu, dn, w], upstream, dtype, H + 2 * I + T * K, ["grad_x", "grad_gate_up", "grad_down",
                                                                            "grad_w"])


@pytest.mark.parametrize(
    "T, H, I, E, K, allowed, dtype",
    [
        (13, 24, 20, 5, 2, 5, torch.float32),
        (13, 24, 20, 5, 2, 5, torch.bfloat16),
        (7, 33, 17, 3, 3, 3, torch.float32),  # K = E: every token on every expert; odd H and I
        (21, 40, 24, 6, 1, 1, torch.bfloat16),  # every token on one expert, five experts empty
        (1, 16, 16, 4, 2, 3, torch.float32),  # one token; an empty expert
    ],
)
def test_experts_match_reference(path, T, H, I, E, K, allowed, dtype):
    _experts_case(T, H, I, E, K, allowed, dtype, seed=T + H)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_larger(path, dtype):
    """Several row tiles per expert, several N and K tiles (the interpreter's tiles are 16 × 64 × 64)."""
    _experts_case(150, 130, 100, 16, 4, 16, dtype, seed=11)


@pytest.mark.gpu
def test_gpu_qwen3_30b_a3b_layer():
    """The compiled kernels at Qwen3-30B-A3B's layer (H 2048, I 768, 128 experts, top 8), 1024 tokens in bf16, against
    the fp32 and bf16 references; then the peak memory of one forward + backward stays within the stated buffers:
    ``[S, 2I]`` twice (saved, its gradient), ``[S, I]``, ``[S, H]`` twice, ``[T, H]`` outputs and O(S) routing state
    (S = T·K), with a factor 1.5 for the allocator's rounding, plus the weights' gradients: nothing of size
    ``[T, E, ·]`` and no weight copy per pair. One case, to bound the GPU tier's time."""
    T, H, I, E, K = 1024, 2048, 768, 128, 8
    _experts_case(T, H, I, E, K, E, torch.bfloat16, seed=3, device="cuda")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gu, dn = (t.detach().cuda().requires_grad_() for t in _weights(E, H, I, torch.bfloat16, seed=3)[1:])
    ids, w = (t.cuda() for t in _routing(T, E, K, E, seed=3))
    S, elem = T * K, 2
    buffers = elem * S * (2 * 2 * I + I + 2 * H) + 4 * 3 * T * H + 128 * S  # + fp32 [T, H]s, routing and dw parts
    weight_grads = elem * 3 * E * I * H  # allocated once, exactly
    stated = 1.5 * buffers + weight_grads  # a [T, E, H] temporary (512 MiB here) would exceed it twice over
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    moe.moe_experts(x, gu, dn, ids, w.bfloat16()).float().sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= stated, f"peak extra {peak / 2**20:.0f} MiB > the stated {stated / 2**20:.0f} MiB"


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # the
# fixture only patches the path choice, the same for every example
@given(T=st.sampled_from([1, 2, 5, 9, 17, 31]), H=st.sampled_from([8, 16, 19, 32, 45]),
       I=st.sampled_from([4, 16, 23, 32, 37]), E=st.integers(1, 7), K=st.integers(1, 3), dtype_bf16=st.booleans(),
       spread=st.sampled_from(["all", "some", "one"]), seed=st.integers(0, 2**16))
def test_experts_randomized(path, T, H, I, E, K, dtype_bf16, spread, seed):
    """Odd sizes, 1 token, top-K up to E, routing spread over all experts, leaving some empty, or every token on the
    same K experts; fp32 and bf16."""
    K = min(K, E)
    allowed = {"all": E, "some": max(K, E - 2), "one": K}[spread]
    _experts_case(T, H, I, E, K, allowed, torch.bfloat16 if dtype_bf16 else torch.float32, seed)


def _same_top_k(x, wr, K):
    """Whether the fp32 and the input-dtype routers pick the same expert sets (else a comparison is ill posed)."""
    _, _, ids32 = moe.moe_router(x.detach().float(), wr.detach().float(), K, norm_topk_prob=False)
    _, _, idslo = moe.moe_router(x.detach(), wr.detach(), K, norm_topk_prob=False)
    return torch.equal(ids32.sort(-1).values, idslo.sort(-1).values)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(T=st.sampled_from([1, 6, 15]), H=st.sampled_from([16, 21]), I=st.sampled_from([12, 32]),
       E=st.integers(2, 6), K=st.integers(1, 3), norm=st.booleans(), dtype_bf16=st.booleans(),
       seed=st.integers(0, 2**16))
def test_block_with_router_matches_reference(path, T, H, I, E, K, norm, dtype_bf16, seed):
    """The whole block: router (its weight gets a gradient through the routing weights) and experts."""
    K, dtype = min(K, E), torch.bfloat16 if dtype_bf16 else torch.float32
    wr, gu, dn = _weights(E, H, I, dtype, seed)
    g = torch.Generator().manual_seed(seed + 3)
    x = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    if not _same_top_k(x, wr, K):
        reject()
    upstream = torch.randn(T, H, generator=g)

    def fn():
        return moe.sparse_moe_block(x, wr, gu, dn, top_k=K, norm_topk_prob=norm)[0]

    def ref(upcast):
        return moe.sparse_moe_block_reference(x, wr, gu, dn, top_k=K, norm_topk_prob=norm, upcast=upcast)[0]

    _compare(fn, ref, [x, wr, gu, dn], upstream, dtype, H + 2 * I + T * K,
             ["grad_x", "grad_router", "grad_gate_up", "grad_down"])


def _hf_block(H, I, E, K, norm, dtype, seed):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                         num_experts_per_tok=K, norm_topk_prob=norm)
    config._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(config)
    wr, gu, dn = _weights(E, H, I, torch.float32, seed)
    with torch.no_grad():
        block.gate.weight.copy_(wr)
        block.experts.gate_up_proj.copy_(gu)
        block.experts.down_proj.copy_(dn)
    return block.to(dtype)


@pytest.mark.parametrize("dtype, norm", [(torch.float32, True), (torch.bfloat16, False)])
def test_block_matches_transformers(path, dtype, norm):
    """``sparse_moe_block`` on a ``Qwen3MoeSparseMoeBlock``'s own tensors equals its forward and backward: against the
    fp32 HF block, with the HF block run in the inputs' dtype as ``ref_lowp``; the router's outputs are the same."""
    B, T, H, I, E, K = 2, 5, 32, 24, 6, 2
    blocks = {d: _hf_block(H, I, E, K, norm, d, seed=7) for d in {torch.float32, dtype}}
    g = torch.Generator().manual_seed(8)
    x = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_()
    upstream = torch.randn(B, T, H, generator=g)
    hf = blocks[dtype]
    params = [hf.gate.weight, hf.experts.gate_up_proj, hf.experts.down_proj]
    if not _same_top_k(x.view(-1, H), params[0], K):
        pytest.fail("this fixed case must route identically in fp32 and in its dtype: change the seed")

    def ours():
        return moe.sparse_moe_block(x, *params, top_k=K, norm_topk_prob=norm)[0]

    def ref(upcast):
        return blocks[torch.float32 if upcast else dtype](x.float() if upcast else x)

    # the leaves are the low-precision block's parameters; the fp32 block's are other tensors: map their grads
    def run_ref(upcast):
        block = blocks[torch.float32 if upcast else dtype]
        leaves = [x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]
        return _run(lambda: ref(upcast), leaves, upstream)

    out, grads = _run(ours, [x, *params], upstream)
    out32, grads32 = run_ref(True)
    outlo, gradslo = run_ref(False)
    for name, a, r, lo in zip(["out", "grad_x", "grad_router", "grad_gate_up", "grad_down"], [out, *grads],
                              [out32, *grads32], [outlo, *gradslo]):
        assert_flash(name, a, r, lo, _atol(r, dtype, H + 2 * I + B * T * K))
    logits, weights, ids = moe.moe_router(x, params[0], K, norm_topk_prob=norm)
    hf_logits, hf_weights, hf_ids = hf.gate(x.view(-1, H))
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights) and torch.equal(logits, hf_logits)


def test_router_replay(path):
    """Given the recorded experts, the block routes to them with weights recomputed from the current logits: equal to
    the experts op on those ids and ``p[t, ids]`` (renormalised), and with no ids, replaying its own top-K is a no-op;
    the router weight gets its gradient either way."""
    T, H, I, E, K = 9, 16, 12, 5, 2
    wr, gu, dn = _weights(E, H, I, torch.float32, seed=4)
    x = torch.randn(T, H)
    ids, _ = _routing(T, E, K, E, seed=4)
    out, logits = moe.sparse_moe_block(x, wr, gu, dn, top_k=K, norm_topk_prob=True, topk_ids=ids)
    p = torch.softmax(logits.detach().float(), -1).gather(1, ids)
    want = moe.moe_experts(x, gu, dn, ids, p / p.sum(-1, keepdim=True))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    own = moe.moe_router(x, wr, K, norm_topk_prob=True)[2]
    torch.testing.assert_close(moe.sparse_moe_block(x, wr, gu, dn, top_k=K, norm_topk_prob=True, topk_ids=own)[0],
                               moe.sparse_moe_block(x, wr, gu, dn, top_k=K, norm_topk_prob=True)[0], rtol=0, atol=0)
    out.sum().backward()
    assert wr.grad is not None and wr.grad.abs().max() > 0


def test_no_tokens(path):
    """Zero tokens: an empty output, zero gradients for the weights (a rank with an empty micro-batch)."""
    _, gu, dn = _weights(3, 16, 8, torch.float32, seed=0)
    wr = torch.randn(3, 16, requires_grad=True)
    x = torch.zeros(0, 16, requires_grad=True)
    out, logits = moe.sparse_moe_block(x, wr, gu, dn, top_k=2, norm_topk_prob=True)
    assert out.shape == (0, 16) and logits.shape == (0, 3)
    out.sum().backward()
    assert gu.grad is not None and not gu.grad.any() and not dn.grad.any()


def test_no_grad_forward_equals_grad_forward(path):
    """Under ``no_grad`` (old / reference log-probs) the forward keeps no gate/up buffer and gives the same output."""
    T, H, I, E, K = 11, 24, 16, 4, 2
    x = torch.randn(T, H)
    _, gu, dn = _weights(E, H, I, torch.float32, seed=1)
    ids, w = _routing(T, E, K, E, seed=1)
    with torch.no_grad():
        a = moe.moe_experts(x, gu, dn, ids, w)
    assert torch.equal(a, moe.moe_experts(x, gu, dn, ids, w).detach())


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_balancing_loss_matches_transformers(masked, dtype):
    """Same number as ``transformers``' ``load_balancing_loss_func`` (3 layers pooled, with and without an attention
    mask), and the same gradient to the logits."""
    pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    B, T, E, K = 3, 7, 8, 2
    g = torch.Generator().manual_seed(5)
    logits = tuple(torch.randn(B * T, E, generator=g).to(dtype).requires_grad_() for _ in range(3))
    mask = (torch.rand(B, T, generator=g) > 0.3).long() if masked else None
    ours = moe.load_balancing_loss(logits, E, K, attention_mask=mask)
    theirs = load_balancing_loss_func(logits, E, K, mask)
    torch.testing.assert_close(ours, theirs.float(), rtol=4 * EPS32, atol=0.0)
    g_ours = torch.autograd.grad(ours, logits)
    g_theirs = torch.autograd.grad(theirs, logits)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=4 * EPS32, atol=4 * EPS32 * b.abs().max().item())


def test_bad_inputs_name_the_argument():
    x = torch.randn(4, 16)
    wr, gu, dn = (t.detach() for t in _weights(3, 16, 8, torch.float32, seed=0))
    ids, w = _routing(4, 3, 2, 3, seed=0)
    with pytest.raises(ValueError, match="gate_up_proj"):
        moe.moe_experts(x, gu[:, :15], dn, ids, w)
    with pytest.raises(ValueError, match="down_proj"):
        moe.moe_experts(x, gu, dn[:, :, :7], ids, w)
    with pytest.raises(ValueError, match="gate_up_proj"):
        moe.moe_experts(x, gu.double(), dn, ids, w)
    with pytest.raises(ValueError, match="topk_ids"):
        moe.moe_experts(x, gu, dn, ids + 3, w)
    with pytest.raises(ValueError, match="topk_weights"):
        moe.moe_experts(x, gu, dn, ids, w[:, :1])
    with pytest.raises(ValueError, match="top_k"):
        moe.sparse_moe_block(x, wr, gu, dn, top_k=4, norm_topk_prob=True)
    with pytest.raises(ValueError, match="topk_ids"):
        moe.sparse_moe_block(x, wr, gu, dn, top_k=2, norm_topk_prob=True, topk_ids=ids[:, :1])
    with pytest.raises(ValueError, match="topk_ids"):
        moe.sparse_moe_block(x, wr, gu, dn, top_k=2, norm_topk_prob=True, topk_ids=ids + 3)
    with pytest.raises(ValueError, match="router_weight"):
        moe.sparse_moe_block(x, wr[:, :8], gu, dn, top_k=2, norm_topk_prob=True)
