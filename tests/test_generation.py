"""GenerationEngine against independent references: Hugging Face greedy ``generate``, a teacher-forced full forward,
the closed-form sampling distribution softmax(logits / T) with top-k/top-p, and the model's own parameter storage.

Tiny random models (fp32, ``initializer_range=0.3`` so greedy output varies). The matmuls are a few
dozen elements wide, so the tests run on one intra-op thread (threads only add latency at this size, and the
machine is shared); the previous setting is restored afterwards.
"""

import copy
import weakref

import pytest
import torch
from checks import assert_decisive, one_thread, total_variation  # noqa: F401  (one_thread: autouse)
from fastgrpo.kernels.utils import use_triton
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import fastgrpo.engine.engine as generation
import fastgrpo.engine.loop as engine_loop
import fastgrpo.engine.runner as engine_runner
import fastgrpo.engine.workspace as engine_workspace
from fastgrpo.engine.engine import Completion, GenerationEngine, SamplingParams
from fastgrpo.engine.scheduler import Scheduler
from fastgrpo.engine.workspace import PACKED_GROUPS, mkl_packed_gemm


@pytest.fixture(autouse=True)
def restore_threads():
    """Each test gets back the thread count it started with (one: ``one_thread``, module-scoped) when it sets
    another one, so that a later test's timings are keyed by the threads it expects."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


VOCAB = 96
MAX_POS = 64
ARCHS = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
LOGPROB_ATOL = 1e-4  # fp32: engine vs teacher-forced forward differ only by summation order (~1e-6 seen)
# Mixture-of-experts models (tests/test_moe_generation.py), 8 experts of width 16, top-2, two MoE layers; Hugging
# Face's reference runs its eager experts (a loop over experts). Qwen3-MoE: 3 layers, the middle one dense
# (mlp_only_layers), top-2 renormalised. Qwen2-MoE: 4 layers, MoE at layers 1 and 3 (decoder_sparse_step 2), the
# dense ones of width 64, a shared expert of width 24, q/k/v biases, top-2 not renormalised (its defaults).
MOE_ARCH = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM), "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM)}
MOE_FIELDS = {
    "qwen3_moe": dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                      mlp_only_layers=[1], norm_topk_prob=True),
    "qwen2_moe": dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                      decoder_sparse_step=2, shared_expert_intermediate_size=24),
}


def tiny_model(arch: str, seed: int = 0, **changes) -> torch.nn.Module:
    """A random tiny model of ``arch``; ``changes``: config fields in place of the defaults here (an MoE's top-k)."""
    config_cls, model_cls = {**ARCHS, **MOE_ARCH}[arch]
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=MAX_POS,
        initializer_range=0.3,
        attention_bias=arch == "llama",  # exercise the optional biases where the architecture allows them
    )
    config = config_cls(**{**fields, **MOE_FIELDS.get(arch, {}), **changes})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if arch in MOE_ARCH:
        model.set_experts_implementation("eager")
    return model


def random_prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


GREEDY_MARGIN = 1e-4  # logits: the engine's differ from HF's by summation order (~1e-6), far below this


def hf_greedy(model, prompt, max_new_tokens, eos):
    """HF greedy continuation of one prompt (batch 1: no padding; explicit mask so no id is taken for padding).

    Every greedy choice must win by ``GREEDY_MARGIN``: a near tie would let the summation order of the CPU's
    kernels pick the token, and an equality test against another implementation would then be decided by rounding.
    """
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    top2 = torch.cat(out.logits).float().topk(2, dim=-1).values  # [steps, 2]
    assert_decisive("greedy top-1 - top-2 logit gap", top2[:, 0] - top2[:, 1], [0.0], GREEDY_MARGIN)
    return out.sequences[0, len(prompt) :].tolist()


def teacher_forced_logp(model, prompt, completion, temperature=1.0):
    """log_softmax(logits / T) of the completion's tokens under one full forward of prompt + completion (the logits
    in fp32, or fp64 for an fp64 model)."""
    ids = torch.tensor([prompt + completion], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # [len(completion), V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, ids[0, len(prompt) :, None]).squeeze(1)


def assert_logprobs_match_hf(model, prompt, completion, logprobs, temperature=1.0):
    """The engine's log-probs of ``completion`` against a teacher-forced fp32 Hugging Face forward: within
    LOGPROB_ATOL, or, where the model amplifies rounding so that the fp32 forward is itself that far from exact,
    within LOGPROB_ATOL plus twice that forward's own error against an fp64 forward (flash-attn's rule: an fp32
    result may be twice as far from the exact answer as the fp32 reference). Random LoRA adapters of scale 14 made
    such a model: HF fp32 4.6e-5 and the engine 7.8e-5 from fp64, 1.2e-4 apart. The fp64 forward runs only then."""
    got = torch.tensor(logprobs)
    ref = teacher_forced_logp(model, prompt, completion, temperature)
    if ((got - ref).abs() <= LOGPROB_ATOL).all():
        return
    exact = teacher_forced_logp(copy.deepcopy(model).double(), prompt, completion, temperature)
    bound = LOGPROB_ATOL + 2 * (ref.double() - exact).abs()
    assert ((got.double() - ref.double()).abs() <= bound).all(), (got, ref, exact)


# ---------------------------------------------------------------- greedy == Hugging Face


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize(
    "max_batch_size,max_total_tokens,sync_every",
    # all at once; rows refilled from the queue; a KV pool of 4 pages of 16 (admission by pages, preemption); stop
    # flags read every 5 steps (as on CUDA: finished rows idle until the next read, their tokens must not be recorded)
    [(64, None, 1), (3, None, 1), (4, 70, 1), (3, None, 5)],
    ids=["one-batch", "refill", "small-pool", "sync5"],
)
def test_greedy_matches_hf(arch, max_batch_size, max_total_tokens, sync_every):
    model = tiny_model(arch)
    prompts = random_prompts([5, 11, 3, 11, 8])
    max_new = 10
    free_run = [hf_greedy(model, p, max_new, None) for p in prompts]
    # an eos that greedy emits mid-way for some prompt and never for another: both finish reasons get exercised
    eos = next(
        t
        for out in free_run
        for t in out[1:-2]
        if t not in out[:1] and any(t not in other for other in free_run)
    )
    expected = [hf_greedy(model, p, max_new, eos) for p in prompts]

    engine = GenerationEngine(
        model,
        eos_token_ids=eos,
        max_batch_size=max_batch_size,
        max_total_tokens=max_total_tokens,
        sync_every=sync_every,
    )
    results = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=max_new))

    assert len(results) == len(prompts)
    reasons = set()
    for want, comps in zip(expected, results):
        assert len(comps) == 2
        for c in comps:
            assert isinstance(c, Completion)
            assert c.token_ids == want
            assert len(c.logprobs) == len(c.token_ids)
            assert c.finish_reason == ("stop" if want[-1] == eos else "length")
            reasons.add(c.finish_reason)
    assert reasons == {"stop", "length"}


def test_stop_token_ids_and_eos_are_both_honoured():
    model = tiny_model("qwen2")
    prompts = random_prompts([6, 4, 9], seed=2)
    free_runs = [hf_greedy(model, p, 8, None) for p in prompts]
    eos, stop = free_runs[0][5], free_runs[1][2]
    engine = GenerationEngine(model, eos_token_ids=eos)
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,)))
    for free_run, [c] in zip(free_runs, results):
        ends = [i for i, t in enumerate(free_run) if t in (eos, stop)]
        want = free_run[: ends[0] + 1] if ends else free_run  # the stop token is included
        assert c.token_ids == want
        assert c.finish_reason == ("stop" if ends else "length")
    [[c]] = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=1))
    assert c.token_ids == free_runs[0][:1] and c.finish_reason == ("stop" if c.token_ids[0] == eos else "length")


# ---------------------------------------------------------------- log-probs == teacher-forced forward


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, temperature=0.0, max_new_tokens=9),
        SamplingParams(n=3, temperature=0.7, top_k=12, top_p=0.9, max_new_tokens=9, seed=3),
        SamplingParams(n=3, temperature=1.3, max_new_tokens=9, seed=4),
    ],
    ids=["greedy", "T0.7-topk-topp", "T1.3"],
)
def test_logprobs_match_teacher_forced_forward(params):
    model = tiny_model("qwen3")
    prompts = random_prompts([4, 9, 6], seed=5)
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=4)
    temperature = params.temperature or 1.0
    for prompt, comps in zip(prompts, engine.generate(prompts, params)):
        for c in comps:
            ref = teacher_forced_logp(model, prompt, c.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=LOGPROB_ATOL, rtol=0)


@settings(max_examples=4)
@given(
    arch=st.sampled_from(sorted(ARCHS)),
    lengths=st.lists(st.integers(2, 12), min_size=6, max_size=10),
    n=st.integers(3, 8),
    stops=st.lists(st.integers(0, VOCAB - 1), min_size=6, max_size=12, unique=True),
    max_batch_size=st.integers(8, 24),
    sync_every=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**16),
)
def test_logprobs_exact_when_completions_end_at_different_times(
    arch, lengths, n, stops, max_batch_size, sync_every, seed
):
    """Many stop ids, so samples finish at different steps while others refill and the batch compacts: every
    log-prob equals a teacher-forced forward's (the issue's symptom: compaction once advanced the wrong slots'
    lengths, so attention dropped the newest keys and some tokens were sampled from a wrong distribution)."""
    model = tiny_model(arch, seed=seed % 3)
    prompts = random_prompts(lengths, seed=seed)
    engine = GenerationEngine(model, eos_token_ids=stops, max_batch_size=max_batch_size, sync_every=sync_every)
    results = engine.generate(prompts, SamplingParams(n=n, max_new_tokens=20, seed=seed))
    for prompt, comps in zip(prompts, results):
        for c in comps:
            ref = teacher_forced_logp(model, prompt, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=LOGPROB_ATOL, rtol=0)


def test_on_group_done_reports_each_group_once_when_it_finishes():
    """All samples admitted at once, greedy, flags read every step: a group finishes at the step its longest
    completion ends, so the callbacks come in non-decreasing order of that length, each prompt exactly once,
    with the very lists ``generate`` returns, each complete when reported."""
    model = tiny_model("qwen2")
    prompts = random_prompts([5, 9, 3, 7, 4, 6], seed=4)
    free_runs = [hf_greedy(model, p, 12, None) for p in prompts]
    eos = [free_runs[0][2], free_runs[3][6], free_runs[5][9]]
    engine = GenerationEngine(model, eos_token_ids=eos, max_batch_size=64)
    calls = []

    def on_group_done(p, comps):
        assert all(isinstance(c, Completion) for c in comps)
        calls.append((p, comps, max(len(c.token_ids) for c in comps)))

    params = SamplingParams(n=3, temperature=0.0, max_new_tokens=12)
    results = engine.generate(prompts, params, on_group_done=on_group_done)
    assert sorted(p for p, _, _ in calls) == list(range(len(prompts)))
    for p, comps, _ in calls:
        assert comps is results[p]
    ends = [end for _, _, end in calls]
    assert ends == sorted(ends) and len(set(ends)) > 1
    # with refill and waves too: each prompt once, the returned lists
    calls.clear()
    engine = GenerationEngine(model, eos_token_ids=eos, max_batch_size=4, max_total_tokens=100, sync_every=3)
    results = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=12, seed=1), on_group_done=on_group_done)
    assert sorted(p for p, _, _ in calls) == list(range(len(prompts)))
    assert all(comps is results[p] for p, comps, _ in calls)
    with pytest.raises(ValueError, match="on_group_done must be callable"):
        engine.generate(prompts, params, on_group_done=3)


def test_max_sequence_tokens_limits_each_prompt():
    """Each prompt's response stops at min(max_new_tokens, max_sequence_tokens - len(prompt)) (reason "length"),
    its tokens are HF's greedy continuation to that length and its log-probs a teacher-forced forward's."""
    model = tiny_model("llama")
    prompts = random_prompts([3, 12, 7, 15], seed=6)
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=3, sync_every=3)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=10, max_sequence_tokens=17)
    for prompt, comps in zip(prompts, engine.generate(prompts, params)):
        limit = min(10, 17 - len(prompt))
        for c in comps:
            assert c.finish_reason == "length" and len(c.token_ids) == limit
            assert c.token_ids == hf_greedy(model, prompt, limit, None)
            ref = teacher_forced_logp(model, prompt, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=LOGPROB_ATOL, rtol=0)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] has 12 tokens: no room"):
        engine.generate(prompts, SamplingParams(max_new_tokens=4, max_sequence_tokens=12))


# ---------------------------------------------------------------- the sampling distribution


def truncated_distribution(logits_V, temperature, top_k, top_p):
    """Closed form of the sampled distribution: softmax(logits / T), top-k, then top-p on the renormalised rest."""
    probs = torch.softmax(logits_V.double() / temperature, dim=-1)
    if top_k:
        probs[probs < probs.topk(top_k).values[-1]] = 0
        probs /= probs.sum()
    if top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        probs /= probs.sum()
    return probs



@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 6, 1.0), (0.8, 0, 0.7), (1.2, 10, 0.8)],
)
def test_sampled_steps_match_closed_form(temperature, top_k, top_p):
    """8 000 samples of two tokens: the first (sampled from the prefill's logits) against the closed form; the
    second (sampled in a decode step) against its closed-form marginal Σ_t1 p(t1) p(t2 | t1), and every second
    token inside the top-k/top-p support given its first token.
    """
    model = tiny_model("qwen2", seed=7)
    prompt = random_prompts([5], seed=8)[0]
    N = 8_000
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=1024)
    params = SamplingParams(n=N, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=2, seed=11)
    [comps] = engine.generate([prompt], params)
    first = torch.tensor([c.token_ids[0] for c in comps])
    second = torch.tensor([c.token_ids[1] for c in comps])

    with torch.no_grad():
        logits_V = model(torch.tensor([prompt])).logits[0, -1]
        # every possible first token appended: the next-token logits of all VOCAB continuations in one forward
        extended = torch.tensor([prompt + [t] for t in range(VOCAB)])
        logits_VV = model(extended).logits[:, -1]
    want1 = truncated_distribution(logits_V, temperature, top_k, top_p)
    want2_given1 = torch.stack([truncated_distribution(row, temperature, top_k, top_p) for row in logits_VV])

    assert (want1[first] > 0).all(), "a first token outside top-k/top-p was sampled"
    assert (want2_given1[first, second] > 0).all(), "a second token outside top-k/top-p was sampled"
    tv, expected_tv = total_variation(first, want1)
    assert tv < 4 * expected_tv
    tv, expected_tv = total_variation(second, want1 @ want2_given1)
    assert tv < 4 * expected_tv


def test_seed_reproduces_and_varies():
    model = tiny_model("llama")
    prompts = random_prompts([4, 7])
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=3)

    def run(seed):
        out = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=8, seed=seed))
        return [[c.token_ids for c in comps] for comps in out]

    assert run(5) == run(5)
    assert run(5) != run(6)
    torch.manual_seed(0)
    a = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8))
    torch.manual_seed(0)
    b = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8))
    assert a == b  # seed=None draws from torch's default generator


# ---------------------------------------------------------------- prefix sharing, co-location, memory


def test_group_shares_one_prefill(monkeypatch):
    model = tiny_model("qwen2")
    prompts = random_prompts([6, 9, 6])
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=5)
    prefilled = []
    real_prefill = engine.forward.prefill

    def counting_prefill(ops, tokens_N, *args, **kwargs):
        prefilled.append(tokens_N.numel())
        return real_prefill(ops, tokens_N, *args, **kwargs)

    monkeypatch.setattr(engine.forward, "prefill", counting_prefill)
    results = engine.generate(prompts, SamplingParams(n=4, temperature=0.0, max_new_tokens=6))
    assert sum(prefilled) == sum(len(p) for p in prompts)  # each prompt once, not once per sample
    for prompt, comps in zip(prompts, results):
        assert all(c.token_ids == comps[0].token_ids for c in comps)
        assert comps[0].token_ids == hf_greedy(model, prompt, 6, None)


class CheckedScheduler(Scheduler):
    """The engine's scheduler, with its invariants asserted after every admission and growth round."""

    instances = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        CheckedScheduler.instances.append(self)

    def admit(self, steps):
        out = super().admit(steps)
        self.check()
        return out

    def grow(self, steps, before_leave=None):
        out = super().grow(steps, before_leave)
        self.check()
        return out


def test_pages_accounted_shared_and_freed(monkeypatch):
    """Reference counts match the block tables and no written page is listed twice after every round (check()),
    every page is free after the call, the prompts are prefilled once each (shared pages), and last_stats reports
    the call."""
    CheckedScheduler.instances.clear()
    monkeypatch.setattr(engine_loop, "Scheduler", CheckedScheduler)
    model = tiny_model("qwen3")
    prompts = random_prompts([7, 16, 3, 21], seed=9)  # partial, full and multi-page prompts (page_size 4)
    engine = GenerationEngine(model, eos_token_ids=[5, 17], max_batch_size=6, page_size=4, sync_every=3)
    engine.generate(prompts, SamplingParams(n=4, max_new_tokens=12, seed=2))
    [sched] = CheckedScheduler.instances
    assert sched.used_pages == 0 and not any(sched.refs) and not sched.prompt_pages
    stats = engine.last_stats
    assert stats["preemptions"] == 0 and stats["prefill_tokens"] == sum(len(p) for p in prompts)
    assert stats["peak_running"] == 6 and stats["decode_steps"] > 0
    assert 0 < stats["peak_kv_tokens"] <= stats["kv_capacity_tokens"] and stats["page_size"] == 4


@pytest.mark.parametrize("params", [
    SamplingParams(n=4, max_new_tokens=24, seed=7),
    SamplingParams(n=4, temperature=0.8, top_k=10, top_p=0.9, max_new_tokens=24, seed=7),
], ids=["T1", "topk-topp"])
def test_preemption_does_not_change_the_result(monkeypatch, params):
    """A pool too small for every running sample forces preemptions (recompute); each sample's tokens equal those of
    an uninterrupted run with a large pool, its log-probs within 1e-5 (the recompute prefill sums differently)."""
    CheckedScheduler.instances.clear()
    monkeypatch.setattr(engine_loop, "Scheduler", CheckedScheduler)
    model = tiny_model("llama")
    prompts = random_prompts([9, 4, 13], seed=3)
    big = GenerationEngine(model, eos_token_ids=[], max_batch_size=12, page_size=4)
    want = big.generate(prompts, params)
    assert big.last_stats["preemptions"] == 0
    small = GenerationEngine(model, eos_token_ids=[], max_batch_size=12, page_size=4, max_total_tokens=4 * 24)
    got = small.generate(prompts, params)
    assert small.last_stats["preemptions"] > 0
    assert small.last_stats["prefill_tokens"] > sum(len(p) for p in prompts)  # recomputed
    for comps_w, comps_g in zip(want, got):
        for w, g in zip(comps_w, comps_g):
            assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
    assert all(sched.used_pages == 0 for sched in CheckedScheduler.instances)


def test_reads_the_live_parameters():
    model = tiny_model("qwen2")
    model.train()
    prompts = random_prompts([5, 8])
    engine = GenerationEngine(model, eos_token_ids=[])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    ptrs = {name: p.data_ptr() for name, p in model.named_parameters()}

    before = engine.generate(prompts, greedy)
    assert model.training  # mode restored
    assert all(p.grad is None for p in model.parameters())  # generation ran without autograd

    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ids = torch.tensor([prompts[1]])
    model(ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    after = engine.generate(prompts, greedy)
    assert not model.training

    assert {name: p.data_ptr() for name, p in model.named_parameters()} == ptrs
    assert [c[0].token_ids for c in after] != [c[0].token_ids for c in before]
    assert [c[0].token_ids for c in after] == [hf_greedy(model, p, 8, None) for p in prompts]


def test_cache_is_freed_after_generate(monkeypatch):
    caches = []

    class TrackedCache(engine_runner.KVCache):
        def __init__(self, **tensors):
            super().__init__(**tensors)
            caches.extend(weakref.ref(t) for t in (self, self.kv))

    monkeypatch.setattr(engine_runner, "KVCache", TrackedCache)
    model = tiny_model("qwen2")
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=2, max_total_tokens=64)
    engine.generate(random_prompts([5, 8, 3]), SamplingParams(n=2, max_new_tokens=6, seed=0))
    assert len(caches) == 2  # one pool per call
    assert all(ref() is None for ref in caches)  # no reference cycle or lingering attribute keeps the cache


def tracked_caches(monkeypatch) -> list:
    """The ``KVCache`` of every ``generate`` call from here on, in order (the engine's class swapped for one that
    records its instances)."""
    pools = []

    class TrackedCache(engine_runner.KVCache):
        def __init__(self, **tensors):
            super().__init__(**tensors)
            pools.append(self)

    monkeypatch.setattr(engine_runner, "KVCache", TrackedCache)
    return pools


@pytest.mark.parametrize("max_total_tokens,want_rows", [(None, True), (64, False)], ids=["default", "small-budget"])
def test_row_cache_stays_within_the_kv_budget(monkeypatch, max_total_tokens, want_rows):
    """By default the CPU row cache exists only when it holds no more tokens than the KV budget (the eager path's K/V
    memory stays within twice the budget); with a small budget the attention goes through the pages. Both give HF's
    greedy tokens."""
    pools = tracked_caches(monkeypatch)
    model = tiny_model("llama")
    prompts = random_prompts([5, 9, 3])
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=6, max_total_tokens=max_total_tokens)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=10))
    [cache] = pools
    assert (cache.work.kv_rows is not None) == want_rows
    budget = max_total_tokens or generation.DEFAULT_CPU_TOTAL_TOKENS
    if want_rows:  # [L, R, 2, Hkv, T, D]: R · T tokens
        assert cache.work.kv_rows.shape[1] * cache.work.kv_rows.shape[4] <= budget
    for prompt, comps in zip(prompts, out):
        assert all(c.token_ids == hf_greedy(model, prompt, 10, None) for c in comps)


def test_autocast_dtype_within_bf16_error_of_fp32():
    """dtype=bf16 on an fp32 model: flash-attn's rule against HF's own forward under the same autocast,
    max |engine − ref_fp32| ≤ 2 · max |ref_bf16 − ref_fp32| + 1e-2."""
    model = tiny_model("qwen2")
    prompts = random_prompts([5, 8])
    engine = GenerationEngine(model, eos_token_ids=[], dtype=torch.bfloat16)
    for prompt, [c] in zip(prompts, engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=1))):
        ref32 = teacher_forced_logp(model, prompt, c.token_ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref16 = teacher_forced_logp(model, prompt, c.token_ids)
        err = (torch.tensor(c.logprobs) - ref32).abs().max()
        assert err <= 2 * (ref16 - ref32).abs().max() + 1e-2
    assert all(p.dtype == torch.float32 for p in model.parameters())


# ---------------------------------------------------------------- the CUDA decode path inside the engine (interpreter)


def test_engine_with_the_decode_attention_kernel_matches_hf(monkeypatch):
    """The CUDA decode path's attention (the Triton kernel, here under the interpreter) inside the engine."""
    if not use_triton(torch.empty(0)):
        pytest.skip("needs TRITON_INTERPRET=1 (a CPU machine under the test suite's conftest)")
    monkeypatch.setattr(engine_runner, "use_fused_attention", lambda t: True)
    model = tiny_model("qwen3")
    prompts = random_prompts([5, 11, 3])
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=4)
    results = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=8))
    for prompt, comps in zip(prompts, results):
        assert all(c.token_ids == hf_greedy(model, prompt, 8, None) for c in comps)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "prompts,kwargs,match",
    [
        ([[]], {}, r"prompt_token_ids\[0\] is empty"),
        ([[1, 2], [VOCAB]], {}, r"prompt_token_ids\[1\].*outside the vocabulary"),
        ([[-1, 2]], {}, r"prompt_token_ids\[0\].*outside the vocabulary"),
        ([[1] * MAX_POS], {"max_new_tokens": 4}, r"no room for a response"),
        ([[1] * 9], {"max_sequence_tokens": 9}, r"no room for a response"),
        ([[1, 2]], {"stop_token_ids": (VOCAB + 5,)}, r"stop_token_ids"),
        (torch.ones(2, 3, dtype=torch.long), {}, r"prompt_token_ids must be a list"),
    ],
)
def test_bad_prompts_raise(prompts, kwargs, match):
    engine = GenerationEngine(tiny_model("qwen2"), eos_token_ids=[0])
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, SamplingParams(**{"max_new_tokens": 4, **kwargs}))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, MAX_POS - 1), min_size=1, max_size=3), max_new=st.integers(1, 40),
       budget=st.one_of(st.none(), st.integers(2, MAX_POS + 8)))
def test_the_model_context_caps_every_completion(lengths, max_new, budget):
    """One length rule for every prompt: ``min(max_new_tokens, min(max_sequence_tokens, context) - len(prompt))``
    tokens, then "length" (no stop token is reachable, so every completion runs to its limit)."""
    lengths = [n for n in lengths if n < min(budget or MAX_POS, MAX_POS)] or [1]
    engine = GenerationEngine(tiny_model("qwen2"), eos_token_ids=[])
    prompts = [[(7 * i + j) % VOCAB for j in range(n)] for i, n in enumerate(lengths)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new, max_sequence_tokens=budget, seed=1))
    for n, (c,) in zip(lengths, outs):
        assert len(c.token_ids) == min(max_new, min(budget or MAX_POS, MAX_POS) - n)
        assert c.finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"n": 0}, "n must"),
        ({"max_new_tokens": 0}, "max_new_tokens must"),
        ({"temperature": -0.5}, "temperature must"),
        ({"temperature": float("nan")}, "temperature must"),
        ({"top_p": 0.0}, "top_p must"),
        ({"top_p": 1.5}, "top_p must"),
        ({"top_k": -1}, "top_k must"),
        ({"stop_token_ids": (-2,)}, "stop_token_ids must"),
        ({"seed": 1.5}, "seed must"),
        ({"max_sequence_tokens": 1}, "max_sequence_tokens must"),
    ],
)
def test_bad_sampling_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_engine_arguments_raise():
    model = tiny_model("qwen2")
    with pytest.raises(ValueError, match="eos_token_ids"):
        GenerationEngine(model, eos_token_ids=[VOCAB])
    with pytest.raises(ValueError, match="max_batch_size"):
        GenerationEngine(model, eos_token_ids=[0], max_batch_size=0)
    with pytest.raises(ValueError, match=r"max_total_tokens=10 \(0 pages of 16\): cannot hold prompt 0"):
        GenerationEngine(model, eos_token_ids=[0], max_total_tokens=10).generate(
            [[1] * 4], SamplingParams(max_new_tokens=8)
        )
    with pytest.raises(ValueError, match="row_cache"):
        GenerationEngine(model, eos_token_ids=[0], row_cache=1)
    gpt2 = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="unsupported architecture"):
        GenerationEngine(gpt2, eos_token_ids=[0])


# ---------------------------------------------------------------- GPU tier (bench/gpu_check.sh)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_cuda_graph_path_matches_hf_and_frees_memory(arch):
    """The CUDA path (compiled elementwise ops, CUDA-graph decode, stop flags read every 8 steps, compaction):
    greedy == HF, sampled log-probs == a teacher-forced forward (fp32, no TF32), memory back to where it was."""
    model = tiny_model(arch).cuda()
    prompts = random_prompts([5, 11, 3, 11, 8])
    expected = [hf_greedy(model, p, 40, None) for p in prompts]
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=4)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    results = engine.generate(prompts, SamplingParams(n=3, temperature=0.0, max_new_tokens=40))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    for want, comps in zip(expected, results):
        assert all(c.token_ids == want for c in comps)
    for params in (  # torch sampling (top-p), then the fused temperature-only kernel
        SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=20, seed=0),
        SamplingParams(n=2, temperature=0.8, max_new_tokens=20, seed=0),
    ):
        for prompt, comps in zip(prompts, engine.generate(prompts, params)):
            for c in comps:
                ref = teacher_forced_logp(model, prompt, c.token_ids, 0.8).cpu()
                torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_compiled_elementwise_path_matches_hf(arch):
    """compile=True (the CUDA default) on CPU: the fused RMSNorm/rotary/SiLU pieces give HF's greedy output."""
    model = tiny_model(arch)
    prompts = random_prompts([5, 11, 3])
    expected = [hf_greedy(model, p, 10, None) for p in prompts]
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=4, compile=True)
    results = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=10))
    for want, comps in zip(expected, results):
        assert all(c.token_ids == want for c in comps)
    for prompt, [c] in zip(prompts, engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=2))):
        ref = teacher_forced_logp(model, prompt, c.token_ids)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=LOGPROB_ATOL, rtol=0)


@settings(max_examples=30)
@given(H=st.sampled_from([8, 64, 100, 256, 704, 1536, 4096]), M=st.integers(1, 77), feature_major=st.booleans(),
       threads=st.sampled_from([1, 2]), scale=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 2**31 - 1))
def test_cpu_rms_norm_is_hf_bit_for_bit(H, M, feature_major, threads, scale, seed):
    """The engine's fp32 CPU RMSNorm (seven kernels) against Hugging Face's ``Qwen2RMSNorm`` module on the same
    rows: bit for bit, rows row-major or feature-major (the engine's CPU activations are either), 1 or 2 threads,
    activations small enough for eps to matter or large."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from fastgrpo.engine.ops import rms_norm

    torch.set_num_threads(threads)  # restore_threads restores one thread
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(H, M, generator=g).t() if feature_major else torch.randn(M, H, generator=g)
    x = x * scale
    norm = Qwen2RMSNorm(H, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(H, generator=g))
        assert torch.equal(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))


def test_the_cpu_uniform_table_is_the_per_draw_hash():
    """The rows' table of uniforms (filled at admission) holds, at column j, exactly the uniform the per-step hash
    gives for draw t0 + j of the row's stream, so reading it changes no draw."""
    from fastgrpo.engine.sampling import row_seeds, row_uniforms, sample_streams, stream_uniforms

    g = torch.Generator().manual_seed(4)
    stream = sample_streams(12345, torch.randint(0, 1000, (9,), generator=g))
    t0 = torch.randint(0, 5000, (9,), generator=g)
    table = stream_uniforms(stream, t0, 37)
    assert table.shape == (9, 37) and table.dtype == torch.float64
    for j in range(37):
        assert torch.equal(table[:, j], row_uniforms(row_seeds(stream, t0 + j)))
    assert ((table >= 0) & (table < 1)).all()


@pytest.mark.skipif(not mkl_packed_gemm(), reason="this torch has no MKL packed GEMM (the engine uses W xᵀ then)")
@settings(max_examples=25)
@given(M=st.integers(1, 70), N=st.integers(1, 600), K=st.integers(1, 300), bias=st.booleans(),
       feature_major=st.booleans(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1))
def test_packed_lm_head_product_is_linear_within_fp32_rounding(M, N, K, bias, feature_major, threads, seed):
    """``packed_linear`` (the CPU decode step's LM head) against ``F.linear`` on the same fp32 operands: every
    entry within the forward-error bound of two K-term fp32 dot products, ``2 (K + 1) 2⁻²⁴ Σ|x w| (+ |b|)``, rows
    row-major or feature-major, 1 or 2 threads; the output row-major; the packs the two most recent row counts."""
    from fastgrpo.engine.workspace import packed_linear

    torch.set_num_threads(threads)  # restore_threads restores one thread
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    packs = {}
    for rows in (M, M + 1, M):  # a second row count, then the first again: reused, not repacked
        x = torch.randn(K, rows, generator=g).t() if feature_major else torch.randn(rows, K, generator=g)
        got, want = packed_linear(x, w, b, packs), torch.nn.functional.linear(x, w, b)
        bound = 2 * (K + 1) * 2.0**-24 * (x.abs() @ w.abs().t() + (b.abs() if bias else 0))
        assert got.shape == (rows, N) and got.is_contiguous()
        assert ((got - want).abs() <= bound).all()
    assert list(packs) == [M + 1, M]  # least recently used first
    packed_linear(torch.randn(M + 2, K, generator=g), w, b, packs)
    assert list(packs) == [M, M + 2]  # at most two kept


@pytest.mark.parametrize("packed", [True, False], ids=["mkl-packed", "buffered"])
def test_packed_or_buffered_products_give_hf_results(monkeypatch, packed):
    """The CPU step's LM head, MLP and q/k/v by MKL's packed GEMM (where torch has it) or as ``W hᵀ`` into the
    workspace buffers (feature-major), each forced whatever this host would pick: either gives HF's greedy tokens
    and, sampled, the teacher-forced forward's log-probs."""
    if packed and not mkl_packed_gemm():
        pytest.skip("this torch has no MKL packed GEMM")
    pools = tracked_caches(monkeypatch)
    model = tiny_model("qwen2")
    prompts = random_prompts([5, 9, 3], seed=11)
    engine = GenerationEngine(model, eos_token_ids=[3, 17], max_batch_size=6, cpu_packed=packed)
    greedy = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=12))
    assert engine.last_stats["cpu_packed"] == dict.fromkeys(PACKED_GROUPS, packed)
    sampled = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=12, seed=5))
    for cache in pools:
        assert (cache.work.packs is not None) == packed and (cache.work.logits is None) == packed
        if packed:  # the LM head, every MLP projection and every layer's stacked q/k/v, for at most 2 row counts
            assert len(cache.work.packs) == 1 + 4 * len(engine.layers)
            by_rows = [v[2] if isinstance(v, tuple) else v for v in cache.work.packs.values()]
            assert all(1 <= len(b) <= 2 for b in by_rows)
    for prompt, g_comps, s_comps in zip(prompts, greedy, sampled):
        assert all(c.token_ids == hf_greedy(model, prompt, 12, [3, 17]) for c in g_comps)
        for c in s_comps:
            assert_logprobs_match_hf(model, prompt, c.token_ids, c.logprobs)


@pytest.fixture
def auto_packed(monkeypatch):
    """``FASTGRPO_CPU_PACKED=auto`` with no size floor (the tiny models are timed) and an empty cache of timings;
    ``set_clock({(group, packed): seconds})`` puts a fake clock in place of the wall time (returns the calls it
    gets, ``[(group, packed), ...]``)."""
    if not mkl_packed_gemm():
        pytest.skip("this torch has no MKL packed GEMM: nothing to choose")
    monkeypatch.setenv(engine_workspace.PACKED_ENV, "auto")
    monkeypatch.setattr(engine_workspace, "PACKED_WEIGHTS_MIN_BYTES", 0)
    monkeypatch.setattr(engine_workspace, "_product_times", {})

    def set_clock(seconds):
        calls = []

        def fake(group, packed, run):
            calls.append((group, packed))
            return seconds[group, packed]

        monkeypatch.setattr(engine_workspace, "product_seconds", fake)
        return calls

    return set_clock


# packed faster; plain faster; packed faster by less than PACKED_MIN_GAIN (5%), which stays plain
FAKE_SECONDS = {("lm_head", True): 1.0, ("lm_head", False): 2.0, ("mlp", True): 3.0, ("mlp", False): 2.0,
                ("qkv", True): 0.97, ("qkv", False): 1.0}


def test_auto_keeps_the_faster_products_of_each_group(monkeypatch, auto_packed):
    """``auto``: each weight group's packed and plain products are timed (``PACKED_TIMING_ROUNDS`` each, the
    fastest kept) and the packed ones run when at least ``PACKED_MIN_GAIN`` faster; the mixed step (LM head
    packed, MLP and q/k/v plain) gives HF's greedy tokens."""
    calls = auto_packed(FAKE_SECONDS)
    pools = tracked_caches(monkeypatch)
    model = tiny_model("llama")
    prompts = random_prompts([5, 9, 3], seed=2)
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=6)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=8))
    stats = engine.last_stats
    assert stats["cpu_packed"] == {"lm_head": True, "mlp": False, "qkv": False}
    assert stats["cpu_packed_by"] == "timed"
    assert stats["cpu_product_ms"] == {g: (FAKE_SECONDS[g, True] * 1e3, FAKE_SECONDS[g, False] * 1e3)
                                       for g in PACKED_GROUPS}
    rounds = engine_workspace.PACKED_TIMING_ROUNDS
    # rounds of every group packed then every group plain (a group's weights cache-cold at each of its runs)
    assert calls == [(g, packed) for _ in range(rounds) for packed in (True, False) for g in PACKED_GROUPS]
    [cache] = pools
    assert cache.work.packed == {"lm_head"} and cache.work.logits is None and cache.work.gate is not None
    assert list(cache.work.packs) == [model.lm_head]
    for prompt, comps in zip(prompts, out):
        assert all(c.token_ids == hf_greedy(model, prompt, 8, None) for c in comps)


def test_auto_timings_are_cached_by_shapes_dtype_threads_and_rows(auto_packed):
    """Timed once per process for the weights' shapes and biases, dtype, thread count and row count: the same
    engine again, or another model of the same shapes, reuses the timings ("cached", even if the clock would now
    say otherwise); another row count or thread count times again."""
    calls = auto_packed(FAKE_SECONDS)
    prompts = random_prompts([4, 6], seed=3)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=3)
    engine = GenerationEngine(tiny_model("qwen2"), eos_token_ids=[], max_batch_size=4)
    engine.generate(prompts, params)
    timed = len(calls)
    assert timed == 2 * engine_workspace.PACKED_TIMING_ROUNDS * len(PACKED_GROUPS)
    auto_packed({k: 3.0 - v for k, v in FAKE_SECONDS.items()})  # the other sides faster, if it were asked
    for e in (engine, GenerationEngine(tiny_model("qwen2", seed=1), eos_token_ids=[], max_batch_size=4)):
        e.generate(prompts, params)
        assert e.last_stats["cpu_packed_by"] == "cached"
        assert e.last_stats["cpu_packed"] == {"lm_head": True, "mlp": False, "qkv": False}
    calls = auto_packed(FAKE_SECONDS)
    other_rows = GenerationEngine(tiny_model("qwen2"), eos_token_ids=[], max_batch_size=3)
    other_rows.generate(prompts, params)
    assert other_rows.last_stats["cpu_packed_by"] == "timed" and len(calls) == timed
    torch.set_num_threads(2)  # restore_threads restores it
    engine.generate(prompts, params)
    assert engine.last_stats["cpu_packed_by"] == "timed" and len(calls) == 2 * timed
    qwen3 = GenerationEngine(tiny_model("qwen3"), eos_token_ids=[], max_batch_size=4)  # q/k/v without biases
    qwen3.generate(prompts, params)
    assert qwen3.last_stats["cpu_packed_by"] == "timed" and len(calls) == 2 * timed + timed // 3  # q/k/v alone


@pytest.mark.parametrize("env,arg,want", [("0", None, False), ("1", None, True), ("auto", False, False),
                                          ("0", True, True), ("1", False, False)])
def test_packed_products_forced_by_env_or_argument(monkeypatch, auto_packed, env, arg, want):
    """``FASTGRPO_CPU_PACKED=0|1`` forces the products plain or packed with nothing timed; the engine's
    ``cpu_packed`` argument, when given, wins over the variable."""
    calls = auto_packed(FAKE_SECONDS)
    monkeypatch.setenv(engine_workspace.PACKED_ENV, env)
    engine = GenerationEngine(tiny_model("qwen2"), eos_token_ids=[], max_batch_size=4, cpu_packed=arg)
    engine.generate(random_prompts([4, 6]), SamplingParams(n=2, temperature=0.0, max_new_tokens=3))
    assert engine.last_stats["cpu_packed"] == dict.fromkeys(PACKED_GROUPS, want)
    assert engine.last_stats["cpu_packed_by"] == "forced" and calls == []


def test_auto_decides_nothing_it_cannot_pack_or_should_not(monkeypatch, auto_packed):
    """Not timed: a bf16 model (MKL's packed GEMM is fp32; forced or not), a model below the size floor under
    ``auto``; a value of the variable other than 0, 1 or auto is refused."""
    calls = auto_packed(FAKE_SECONDS)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=3)
    bf16 = GenerationEngine(tiny_model("qwen2").to(torch.bfloat16), eos_token_ids=[], cpu_packed=True)
    bf16.generate([[1, 2, 3]], params)
    assert bf16.last_stats["cpu_packed_by"] == "unavailable"
    assert bf16.last_stats["cpu_packed"] == dict.fromkeys(PACKED_GROUPS, False)
    monkeypatch.setattr(engine_workspace, "PACKED_WEIGHTS_MIN_BYTES", 4 << 20)
    small = GenerationEngine(tiny_model("qwen2"), eos_token_ids=[])
    small.generate([[1, 2, 3]], params)
    assert small.last_stats["cpu_packed_by"] == "size" and calls == []
    monkeypatch.setenv(engine_workspace.PACKED_ENV, "yes")
    with pytest.raises(ValueError, match="FASTGRPO_CPU_PACKED='yes'"):
        small.generate([[1, 2, 3]], params)
    with pytest.raises(ValueError, match="cpu_packed must be True, False or None"):
        GenerationEngine(tiny_model("qwen2"), eos_token_ids=[], cpu_packed=1)


def test_auto_with_the_wall_clock_gives_hf_results(auto_packed):
    """The real timing (whatever it picks on this host: no assertion on the times themselves): every group timed,
    each packed exactly when its packed products were enough faster, HF's greedy tokens."""
    model = tiny_model("qwen3")
    prompts = random_prompts([7, 2], seed=4)
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=4)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=8))
    stats = engine.last_stats
    assert stats["cpu_packed_by"] == "timed" and set(stats["cpu_product_ms"]) == set(PACKED_GROUPS)
    gain = 1 - engine_workspace.PACKED_MIN_GAIN
    assert stats["cpu_packed"] == {g: packed <= gain * plain for g, (packed, plain) in stats["cpu_product_ms"].items()}
    for prompt, comps in zip(prompts, out):
        assert all(c.token_ids == hf_greedy(model, prompt, 8, None) for c in comps)
