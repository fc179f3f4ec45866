"""``numerics.batch_invariant`` on the model's device (issue 35): the same exact-product ops on CPU and CUDA.

CPU tier: the mode's device plumbing (every tensor its code makes is made on its inputs' device: the engine's
invariant forward, its sampler's log-prob and the trainer's packed forward run with every factory call of
fastgrpo's own code that names no device raising, and every other one landing on the meta device), the self-check run
on the device the mode is used on (once per device) and the overrides registered for the CUDA dispatch key as well as
the CPU one. GPU tier (``-m gpu``, skipped without CUDA): the bitwise tier of ``tests/test_bitwise.py`` on CUDA,
the exact products giving CUDA the CPU's bits, and ``check_model`` accepting a CUDA model.
"""

import contextlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from fastgrpo.kernels import batch_invariant as bi
from fastgrpo.kernels import batch_invariant_attention as ba
from hypothesis import given, settings
from hypothesis import strategies as st
from test_bitwise import bitwise_cases, check_bitwise, check_turns_bitwise, moe_cases, trainer_mismatches
from test_generation import random_prompts, tiny_model
from test_generation_fidelity import cases, run_turns, turn_cases
from torch.overrides import TorchFunctionMode
from turn_script import CharTokenizer

import fastgrpo
from fastgrpo.engine.batch_invariant import PagedKV
from fastgrpo.engine.cache import KVCache
from fastgrpo.engine.engine import GenerationEngine, SamplingParams
from fastgrpo.models.attention import enable_packed_attention
from fastgrpo.models.batch_invariant import check_model

FACTORIES = {torch.arange, torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty,
             torch.empty_strided, torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace,
             torch.logspace, torch.eye}  # the tensor factories that take a device (the _like ones take their input's)
PACKAGE = tuple(os.path.dirname(m.__file__) + os.sep for m in (fastgrpo, fastgrpo.kernels.batch_invariant))


class ImplicitDeviceTrap(TorchFunctionMode):
    """A tensor factory called without ``device=``: from fastgrpo's own code (the package and its kernels) it raises,
    naming the line; from elsewhere (transformers) it makes a meta tensor, as ``torch.set_default_device("meta")``
    would, which raises where it meets the run's tensors. fastgrpo's own calls raise at the call because a meta tensor
    used as an index of a CPU tensor is accepted without an error. PyTorch's kernels replaced by the overrides run
    below the function-mode layer, out of its sight: they make their outputs with ``new_empty`` / ``empty_like``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in FACTORIES and kwargs.get("device") is None:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PACKAGE):
                raise AssertionError(f"torch.{func.__name__} without a device at {caller.f_code.co_filename}:"
                                     f"{caller.f_lineno}")
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


@pytest.mark.parametrize("by_queries", [False, True])
@settings(max_examples=6, deadline=None)
@given(B=st.integers(1, 5), M=st.integers(1, 5), ps=st.sampled_from([1, 3, 8]), P=st.integers(1, 5),
       rows=st.integers(1, 5), queries=st.integers(1, 4), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 1000))
def test_paged_attention_in_row_chunks_gives_the_whole_gathers_bits(by_queries, B, M, ps, P, rows, queries, dtype,
                                                                    seed):
    """``PagedKV`` (the CUDA path's attention over the pages) gathers its sequences' K/V ``rows`` at a time, or
    (``by_queries``: not one row fits) one row at a time with its queries ``queries`` (fewer than the row's) at a
    time, the attention's bound set so: every live query's output is the bits of the attention over the whole
    batch's K/V gathered at once from the same pages, the padded queries (row -1) written nowhere; the decode step's
    form (no rows: query ``i`` is row ``i``) likewise."""
    if by_queries:
        M, rows = max(M, 2), 0
        queries = 1 + (queries - 1) % (M - 1)
    g = torch.Generator().manual_seed(seed)
    Hq, Hkv, D, L = 4, 2, 8, P * ps
    kv = torch.randn(1, 2, Hkv, B * P + 1, ps, D, generator=g).to(dtype)  # one page more: never read
    kv[:, 0] = ba.key_grid(kv[:, 0])
    table_BP = torch.randperm(B * P + 1, generator=g)[: B * P].view(B, P)
    qpos_BM = torch.randint(0, L, (B, M), generator=g)
    live_BM = torch.rand(B, M, generator=g) < 0.7
    live_BM[:, 0] = True
    N = int(live_BM.sum())
    rows_BM = torch.full((B, M), -1)
    rows_BM[live_BM] = torch.randperm(N, generator=g)
    slot_N = torch.empty(N, dtype=torch.long)  # the new tokens' slots: their queries' positions' (distinct)
    b_N, m_N = live_BM.nonzero().unbind(1)
    p_N = qpos_BM[b_N, m_N]
    slot_N[rows_BM[b_N, m_N]] = table_BP[b_N, p_N // ps] * ps + p_N % ps
    q_NHD = torch.randn(N, Hq, D, generator=g).to(dtype)
    k_NHD, v_NHD = (torch.randn(N, Hkv, D, generator=g).to(dtype) for _ in range(2))
    whole = kv.clone()
    KVCache(whole).write(0, slot_N, ba.key_grid(k_NHD), v_NHD)
    k, v = whole[0][:, :, table_BP].permute(0, 2, 1, 3, 4, 5).reshape(2, B, Hkv, L, D)
    o_BHMD = ba.attention(q_NHD[rows_BM].transpose(1, 2), k, v, qpos_BM, D**-0.5)
    expected = torch.empty_like(q_NHD)
    expected[rows_BM[live_BM]] = o_BHMD.transpose(1, 2)[live_BM]
    queries = queries if by_queries else M
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ba, "CHUNK_BYTES", max(rows, 1) * 8 * Hkv * L * (2 * D + 2 * queries * Hq // Hkv))
        assert ba.rows_per_call(torch.device("cpu"), Hq, Hkv, L, M, D) == max(rows, 1)
        assert rows or ba.queries_per_row(torch.device("cpu"), Hq, Hkv, L, D) == queries
        out = PagedKV(KVCache(kv), slot_N, qpos_BM, table_BP, rows_BM).attend(0, q_NHD, k_NHD, v_NHD, D**-0.5)
        assert torch.equal(out, expected) and torch.equal(kv, whole)
        decode = PagedKV(KVCache(kv.clone()), slot_N[:0], qpos_BM[:, :1], table_BP).attend(
            0, q_NHD[rows_BM[:, 0]], k_NHD[:0], v_NHD[:0], D**-0.5)
        assert torch.equal(decode, o_BHMD[:, :, 0])


@pytest.mark.parametrize("tied", [False, True])
def test_the_cuda_kv_budget_takes_off_only_the_grids_not_held(monkeypatch, tied):
    """On CUDA the engine's KV budget is ``0.8 · (free + cached − allocated − grids)`` tokens of
    ``2 · layers · Hkv · D · 4`` bytes (fp32), where ``grids`` is 8 bytes an entry of every matrix but an untied input
    embedding while none is held, 0 while a scope keeps them made (the trainer's, for its run: a call made them, then
    the weights moved), and all of them again once that scope has closed. The memory figures are patched in."""
    model = tiny_model("qwen2", tie_word_embeddings=tied)
    engine = GenerationEngine(model, eos_token_ids=[], batch_invariant=True)
    free, cached, allocated = 3 << 30, 5 << 26, 3 << 26
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: cached)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    c = model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    grids = 8 * sum(p.numel() for name, p in model.named_parameters()
                    if p.dim() == 2 and (tied or name != "model.embed_tokens.weight"))

    def budget() -> int:
        return engine._budget_tokens(torch.device("cuda"), torch.float32)

    assert budget() == int(0.8 * (free + cached - allocated - grids)) // per_token
    with bi.keep_weight_grids(list(model.parameters())):  # the trainer's scope
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))
        assert budget() == int(0.8 * (free + cached - allocated)) // per_token
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        assert budget() == int(0.8 * (free + cached - allocated)) // per_token  # stale, still held
    assert budget() == int(0.8 * (free + cached - allocated - grids)) // per_token


@pytest.mark.parametrize("arch, row_cache, changes", [
    ("qwen3", False, dict(vocab_size=2100, max_position_embeddings=160)),  # two vocabulary tiles, big key blocks
    ("qwen2", True, {}),
    ("qwen3_moe", False, {}),
])
def test_the_mode_makes_its_tensors_on_its_inputs_device(arch, row_cache, changes):
    """The engine's mode-on call (prefill, decode through the pages or the CPU row cache, the sampler's log-prob, an
    MoE's router and experts) and the trainer's packed forward and log-probs, inside :class:`ImplicitDeviceTrap`:
    no factory call of the mode's code leaves its device to the default, and the log-probs still match bit for bit.
    The long case crosses the attention's big blocks (64 keys) and the LM head's vocabulary tiles (2048)."""
    model = tiny_model(arch, seed=1, **changes)
    prompts = random_prompts([70, 9, 3] if changes else [5, 9, 3], seed=2)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=20 if changes else 6, seed=3)
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=3, page_size=4, row_cache=row_cache,
                              batch_invariant=True, record_routing=arch == "qwen3_moe")
    with ImplicitDeviceTrap():
        outs = engine.generate(prompts, params)
    enable_packed_attention(model)
    with ImplicitDeviceTrap():
        differ, total = trainer_mismatches(model, prompts, outs, 1.0, 4096, 1)
    assert total > 0 and differ == 0


def test_resumed_turns_make_their_tensors_on_their_inputs_device():
    """Multi-turn inside the trap: turns resumed by a prefill onto their cached K/V through the pages
    (``PagedKV`` with per-sequence rows, positions and tables), then the trainer's forward, bit for bit."""
    model = tiny_model("qwen2", seed=2)
    prompts = random_prompts([6, 3], seed=4)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, stop_token_ids=tuple(range(0, 96, 6)),
                            max_turns=3, seed=5)
    script = dict(seed=1, max_obs=3, finish_prob=0.0, max_delay=0)
    with ImplicitDeviceTrap():
        outs, _, engine = run_turns(model, CharTokenizer(96, seed=0), prompts, params, script, max_batch_size=4,
                                    sync_every=2, page_size=4, spare_pages=None, row_cache=False,
                                    batch_invariant=True)
    assert engine.last_stats["resume_prefill_tokens"] > 0
    enable_packed_attention(model)
    with ImplicitDeviceTrap():
        differ, total = trainer_mismatches(model, prompts, outs, 1.0, 4096, 1)
    assert total > 0 and differ == 0


def test_the_trap_catches_a_factory_without_a_device():
    """The trap itself: a call from the package without a device raises, one from elsewhere makes a meta tensor, one
    with a device is left alone."""
    with ImplicitDeviceTrap():
        assert torch.arange(3).device.type == "meta"
        assert torch.arange(3, device="cpu").device.type == "cpu"
        with pytest.raises(AssertionError, match="torch.arange without a device at .*probe.py:1"):
            exec(compile("torch.arange(3)", PACKAGE[0] + "probe.py", "exec"), {"torch": torch})


@contextlib.contextmanager
def recorded_self_checks(monkeypatch):
    """The devices :func:`bi.self_check` runs on (a fresh record of checked devices)."""
    seen = []
    monkeypatch.setattr(bi, "CHECKED_DEVICES", set())
    monkeypatch.setattr(bi, "self_check", lambda device: seen.append(str(device)))
    yield seen


def test_self_check_runs_on_the_modes_device_once(monkeypatch):
    """``invariant_ops(device)`` checks that device (its exp, log, GEMM are its own), once per device and process."""
    with recorded_self_checks(monkeypatch) as seen:
        with bi.invariant_ops("cpu"), bi.invariant_ops(torch.device("meta")), bi.invariant_ops("cpu"):
            pass
        with bi.invariant_ops(torch.device("meta")):
            pass
    assert seen == ["cpu", "meta"]


def test_the_overrides_cover_the_cuda_dispatch_key():
    """While the ops are registered, each overridden operator's CPU and CUDA kernels are this module's, and after the
    last exit neither is (the dispatcher's own table: the CUDA entry exists even in a CPU-only build)."""

    def ours(op: str, key: str) -> bool:
        dump = torch._C._dispatch_dump(f"aten::{op}").splitlines()
        return any(line.startswith(f"{key}: registered at {bi.__file__}") for line in dump)

    with bi.invariant_ops("cpu"):
        for op in bi.OVERRIDES:
            for key in ("CPU", "CUDA"):
                assert ours(op, key), f"aten::{op} has no invariant kernel for {key}"
    assert not any(ours(op, key) for op in bi.OVERRIDES for key in ("CPU", "CUDA"))


def test_refusals_of_devices_and_graphs():
    """A model on another device than CPU / CUDA is refused, and so are CUDA graphs asked for with the mode (its
    decode runs eagerly) and an activation dtype other than the weights' (autocast)."""
    with pytest.raises(ValueError, match="a model on meta"):
        check_model(tiny_model("qwen2").to("meta"))
    with pytest.raises(ValueError, match="cuda_graphs=True with batch_invariant"):
        GenerationEngine(tiny_model("qwen2"), eos_token_ids=[], batch_invariant=True, cuda_graphs=True)
    with pytest.raises(ValueError, match="dtype=torch.bfloat16 with batch_invariant"):  # autocast of fp32 weights
        GenerationEngine(tiny_model("qwen2"), eos_token_ids=[], batch_invariant=True, dtype=torch.bfloat16)
    GenerationEngine(tiny_model("qwen2"), eos_token_ids=[], batch_invariant=True, dtype=torch.float32)  # theirs


# ---------------------------------------------------------------- the gpu tier

gpu = pytest.mark.gpu


@gpu
def test_cuda_self_check_and_exact_products_give_the_cpus_bits():
    """The device's self-check passes, and the exact products are device-independent: every partial sum is exact
    and the bias add and the cast are correctly rounded, so CUDA's DGEMM in whatever blocking gives the CPU's bits
    (fp32 and bf16, decode and training row counts, a long K where cuBLAS may split it). (RMSNorm's mean is not
    compared: CUDA divides by a scalar as a product with its reciprocal, the CPU divides; each device is
    consistent with itself, which is what the mode needs.)"""
    bi.self_check("cuda")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for M, K, N in ((1, 64, 96), (7, 1536, 256), (300, 4096, 64)):
            x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
            x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
            outs = []
            for dev in ("cpu", "cuda"):
                with bi.invariant_ops(dev), bi.invariant_forward():
                    xd, wd, bd = x.to(dev), w.to(dev), b.to(dev)
                    outs.append((F.linear(xd, wd, bd).cpu(), F.linear(xd, wd).cpu()))
            for cpu, cuda in zip(*outs):
                assert torch.equal(cpu, cuda)


@gpu
def test_cuda_attention_backward_is_the_triton_kernels():
    """The mode's attention on CUDA: forward values its own, gradients those of the trainer's Triton varlen kernel
    (recomputed in the backward), bit for bit."""
    from fastgrpo.kernels.batch_invariant_attention import varlen_attention as invariant
    from fastgrpo.kernels.varlen_attention import varlen_attention_unchecked

    g = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0, 37, 130, 200], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(200, h, 64, generator=g, device="cuda", requires_grad=True) for h in (4, 2, 2))
    do = torch.randn(200, 4, 64, generator=g, device="cuda")
    got = torch.autograd.grad(invariant(q, k, v, cu, 0.125), (q, k, v), do)
    want = torch.autograd.grad(varlen_attention_unchecked(q, k, v, cu, 93, softmax_scale=0.125), (q, k, v), do)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@gpu
def test_check_model_accepts_a_cuda_model(monkeypatch):
    """A CUDA model is accepted, and the engine's mode-on call decodes eagerly: no CUDA graph is made."""
    from fastgrpo.engine import runner

    model = tiny_model("qwen3").cuda()
    enable_packed_attention(model)
    check_model(model, "fastgrpo_varlen")
    engine = GenerationEngine(model, eos_token_ids=[], batch_invariant=True)
    monkeypatch.setattr(runner, "DecodeGraphs", None)  # calling it would raise
    out = engine.generate(random_prompts([4, 6]), SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=0))
    assert [len(c.token_ids) for comps in out for c in comps] == [4] * 4


@gpu
@pytest.mark.parametrize("arch, dtype, vocab", [
    (arch, dtype, 9000 if (i + j) % 2 else 96)
    for i, arch in enumerate(("qwen2", "llama", "qwen3")) for j, dtype in enumerate((torch.float32, torch.bfloat16))])
@settings(max_examples=2, deadline=None)
@given(bitwise_cases(cases()))
def test_cuda_engine_logprobs_equal_the_trainers(arch, dtype, vocab, case):
    """The bitwise tier on CUDA: each of the random tiny Qwen2 / Llama / Qwen3 in fp32 and in bf16, each
    architecture once with a vocabulary of 9000 (5 of the LM head's tiles, whose sum must not depend on the number of
    rows: a decode of one row against the trainer's chunk of many), on two drawn schedules of the engine (the first
    the smallest, one token of one prompt; batch sizes, preemption, page sizes, sync intervals; the pages: CUDA has no
    row cache), every sampled token's log-prob ``torch.equal`` to the trainer's packed forward's."""
    schedule, _, engine_threads, trainer_threads, budget = case
    check_bitwise((arch, *schedule[1:]), dtype, engine_threads, trainer_threads, budget,
                  changes=dict(vocab_size=vocab), device="cuda")


@gpu
@settings(max_examples=2, deadline=None)
@given(bitwise_cases(moe_cases()))
def test_cuda_moe_engine_logprobs_equal_the_trainers(case):
    check_bitwise(*case, changes=dict(num_experts_per_tok=3), device="cuda")


@gpu
@settings(max_examples=2, deadline=None)
@given(turn_cases(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_cuda_multi_turn_logprobs_equal_the_trainers(case, dtype):
    """Turns resumed against their cached K/V (the prefill onto the pages) on CUDA."""
    check_turns_bitwise(case, dtype, 4096, device="cuda")
