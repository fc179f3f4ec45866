"""The engine on mixture-of-experts models (``fastgrpo.engine.moe``) in the differential harness, router replay's record
and the trainer's replayed forward.

Random tiny Qwen3-MoE and Qwen2-MoE models (``test_generation.tiny_model``: 8 experts, top-2, two MoE layers;
Qwen3-MoE's 3 layers with the middle one dense and the top-2 renormalised, Qwen2-MoE's 4 layers with MoE every second
one, a shared expert, q/k/v biases and the top-2 weights as they are; ``initializer_range`` 0.3; Hugging Face's
reference runs its eager experts) under the harness's
schedules (``test_generation_fidelity``: refill, small KV budgets with preemption, ``sync_every`` 1/3/8, page sizes,
the CPU row cache or the pages, top-k/top-p, temperatures, multi-turn with a scripted handler, stop strings seen late
and trimmed), with ``record_routing`` on. For every drawn case and completion:

- the harness's checks: log-probs equal a teacher-forced Hugging Face forward's (1e-4, its rule), greedy equals
  ``generate``, the same seed gives the same completions under another schedule;
- the record: ``routing[t]`` is, for every token but the last, the set of experts Hugging Face's router chooses for
  it in each MoE layer of a teacher-forced forward over the whole sequence (prompt, turns, observations), and the last
  token's row holds E (never fed);
- replay (single-turn cases): the trainer's packed forward (``packed_logprobs``, the fused loss kernel's path)
  replaying the record gives the engine's log-probs of the sampled tokens within ``16 · eps32 · max|z|`` (z: the
  tokens' temperature-scaled logits; the two fp32 computations differ in summation order only, ~1 eps32·|z| seen).

Routing is discrete: a token whose router has a near tie (the K-th and (K+1)-th probabilities within
``ROUTER_MARGIN`` in the fp32 reference) could be routed otherwise by another summation order, so such cases are
drawn again (``hypothesis.reject``), as the harness does for greedy near ties. So is a case where the two schedules'
trajectories of a sample part at a sampled token whose uniform lies within ``DRAW_MARGIN`` of a boundary of the
CDF between the two tokens (the schedules' logits differ by fp32 rounding, ~1e-6: such a draw is rounding's; the
slow sweep met one, its uniform 5.5e-8 from the boundary).
"""

from unittest import mock

import pytest
import torch
from checks import EPS32, one_thread  # noqa: F401  (an autouse fixture)
from hypothesis import given, reject, settings
from test_generation import MOE_ARCH, random_prompts, teacher_forced_logp, tiny_model, truncated_distribution
from test_generation_fidelity import cases, check_case, check_turn_case, turn_cases

from fastgrpo.algorithms.batch import Sample, make_microbatch
from fastgrpo.algorithms.forward import packed_forward, packed_logprobs
from fastgrpo.distributed import ForwardWrapper
from fastgrpo.engine.engine import GenerationEngine, SamplingParams
from fastgrpo.engine.sampling import row_seeds, row_uniforms, sample_streams
from fastgrpo.models.attention import enable_packed_attention
from fastgrpo.models.moe import MoERouting, enable_moe

ROUTER_MARGIN = 1e-6  # fp32 router probabilities of two summation orders differ by ~1e-7
DRAW_MARGIN = 1e-5  # two schedules' CDFs differ by fp32 rounding of the logits (~1e-6 relative at most seen)


def moe_case(arch, case):
    """A harness case (drawn for a dense architecture) on the mixture-of-experts architecture ``arch``."""
    return (arch, *case[1:])


def hf_routing(model, ids):
    """Hugging Face's router choices ``[T, L_moe, K]`` (sorted) and each token's smallest gap between its K-th and
    (K+1)-th probabilities over the MoE layers ``[T]``, of a teacher-forced forward over ``ids``."""
    K = model.config.num_experts_per_tok
    with torch.no_grad():
        logits = model.model(torch.tensor([ids], device=model.device), output_router_logits=True).router_logits
    top = [z.softmax(-1).topk(K + 1, -1) for z in logits]
    chosen = torch.stack([t.indices[:, :K].sort(-1).values for t in top], 1)
    gap = torch.stack([t.values[:, K - 1] - t.values[:, K] for t in top], 1).min(1).values
    return chosen.cpu(), gap.cpu()


def router_guard(model, prompt, c):
    """Reject a case whose sequence meets a router near tie (module docstring)."""
    if hf_routing(model, prompt + c.token_ids)[1].min() < ROUTER_MARGIN:
        reject()


def draw_guard(params):
    """A ``pair_guard``: reject a case whose two schedules part at a draw that rounding decides (module docstring)."""

    def guard(model, prompt, key, a, b):
        if params.greedy or a.token_ids == b.token_ids:
            return  # greedy near ties: hf_greedy's check
        k = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        mask = a.loss_mask or [1] * len(a.token_ids)
        if k is None or not (mask[k] and (b.loss_mask or [1] * len(b.token_ids))[k]):
            return  # a length or an appended token differs: not a draw, the comparison must fail
        sample = torch.tensor([key[0] * params.n + key[1]])
        u = row_uniforms(row_seeds(sample_streams(params.seed, sample), torch.tensor([sum(mask[:k])]))).item()
        with torch.no_grad():
            z_V = model(torch.tensor([prompt + a.token_ids[:k]])).logits[0, -1].double()
        cdf_V = truncated_distribution(z_V, params.temperature, params.top_k, params.top_p).cumsum(0)
        lo, hi = sorted((a.token_ids[k], b.token_ids[k]))
        if (cdf_V[lo:hi] - u).abs().min() < DRAW_MARGIN:
            reject()

    return guard


def check_record(model, prompt, c):
    """``c.routing``: Hugging Face's choices at every token but the last, E at the last."""
    E, seq = model.config.num_experts, prompt + c.token_ids
    want, _ = hf_routing(model, seq)
    assert c.routing.shape == (len(seq), 2, 2) and c.routing.dtype == torch.uint8  # two MoE layers, top-2
    assert torch.equal(c.routing[:-1].long().sort(-1).values, want[:-1])
    assert (c.routing[-1] == E).all()


def check_replay(model, prompts, out, temperature):
    """The trainer's packed forward replaying the record reproduces the engine's log-probs (module docstring);
    ``model``: the engine's model, now with fastgrpo's experts, routing hooks and packed attention."""
    samples = [Sample(p, c.token_ids, c.logprobs, 0.0, routing=c.routing) for p, g in zip(prompts, out) for c in g]
    mb = make_microbatch(samples, torch.device("cpu"))
    got_N = packed_logprobs(ForwardWrapper(model, packed_forward), mb, temperature, MoERouting(mb.routing))
    mask = mb.mask != 0
    with torch.no_grad():
        b = mb.batch
        hidden_NH, weight_VH, _ = packed_forward(model, b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen,
                                                 moe_routing=MoERouting(mb.routing))
    z_max = (hidden_NH[mask] @ weight_VH.T).abs().max().item() / temperature
    err = (got_N[mask] - mb.sample_logprobs[mask]).abs().max().item()
    assert err <= 16 * EPS32 * z_max, (err, z_max)


def recording_engine(*args, **kwargs):
    return GenerationEngine(*args, record_routing=True, **kwargs)


def check_moe_case(case):
    _, _, _, params, _ = case
    with mock.patch("test_generation_fidelity.GenerationEngine", recording_engine):
        model, prompts, runs = check_case(*case, guard=router_guard, pair_guard=draw_guard(params))
    for out in runs:
        for p, group in zip(prompts, out):
            for c in group:
                check_record(model, p, c)
    enable_moe(model)  # the trainer's forward of the same weights
    enable_packed_attention(model)
    check_replay(model, prompts, runs[0], params.temperature or 1.0)


@pytest.mark.parametrize("arch", MOE_ARCH)
@settings(max_examples=4)
@given(case=cases())
def test_moe_engine_matches_hf_records_routing_and_replays(arch, case):
    check_moe_case(moe_case(arch, case))


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_ARCH)
@settings(max_examples=40)
@given(case=cases(max_prompts=6, max_samples=48))
def test_moe_engine_matches_hf_records_routing_and_replays_sweep(arch, case):
    check_moe_case(moe_case(arch, case))


def check_moe_turn_case(case):
    with mock.patch("test_generation_fidelity.GenerationEngine", recording_engine):
        model, prompts, runs = check_turn_case(*case, guard=router_guard, pair_guard=draw_guard(case[3]))
    for out in runs:
        for p, group in zip(prompts, out):
            for c in group:
                check_record(model, p, c)


@pytest.mark.parametrize("arch", MOE_ARCH)
@settings(max_examples=3)
@given(case=turn_cases())
def test_moe_multi_turn_matches_hf_and_records_every_turn(arch, case):
    check_moe_turn_case(moe_case(arch, case))


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_ARCH)
@settings(max_examples=30)
@given(case=turn_cases(max_prompts=4, max_samples=24))
def test_moe_multi_turn_matches_hf_and_records_every_turn_sweep(arch, case):
    check_moe_turn_case(moe_case(arch, case))


@pytest.mark.parametrize("arch", MOE_ARCH)
def test_a_session_records_routing_across_runs_and_updates(arch):
    """A generation session (async GRPO's engine side): prompts added between runs, ``update()`` between them (no
    weight change): every completion's record is Hugging Face's routing of its sequence."""
    model = tiny_model(arch, seed=2)
    params = SamplingParams(n=2, max_new_tokens=8, seed=5)
    engine = GenerationEngine(model, eos_token_ids=None, max_batch_size=3, sync_every=3, page_size=4,
                              record_routing=True)
    prompts = random_prompts([4, 7, 3], seed=3)
    done = {}
    session = engine.session(params, max_prompt_tokens=8, on_group_done=lambda p, g: done.setdefault(p, g))
    session.add(prompts[:2])
    session.run(1)
    session.update()
    session.add(prompts[2:])
    session.run(len(prompts) - len(done))
    session.close()
    assert sorted(done) == [0, 1, 2]
    for p, group in done.items():
        for c in group:
            router_guard_strict(model, prompts[p], c)
            check_record(model, prompts[p], c)
            torch.testing.assert_close(torch.tensor(c.logprobs), teacher_forced_logp(model, prompts[p], c.token_ids),
                                       atol=1e-4, rtol=0)


def router_guard_strict(model, prompt, c):
    """A fixed case: a near tie means the case must change (another seed), never a pass by rounding."""
    gap = hf_routing(model, prompt + c.token_ids)[1].min().item()
    assert gap >= ROUTER_MARGIN, f"router near tie ({gap:.3g}): change the case's seed"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", MOE_ARCH)
def test_cuda_graph_engine_runs_moe_layers_and_records_them(arch):
    """On CUDA: the decode step with its MoE layers (Triton grouped GEMMs, few-rows tiles) captured in CUDA graphs;
    log-probs within the harness's tolerance of Hugging Face's fp32 forward, and the record equal to its routing."""
    model = tiny_model(arch, seed=1).cuda()
    prompts = random_prompts([5, 9, 2], seed=4)
    engine = GenerationEngine(model, eos_token_ids=None, max_batch_size=8, record_routing=True)
    out = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=12, seed=1))
    for p, group in zip(prompts, out):
        for c in group:
            router_guard_strict(model, p, c)
            check_record(model, p, c)
            torch.testing.assert_close(torch.tensor(c.logprobs), teacher_forced_logp(model, p, c.token_ids).cpu(),
                                       atol=1e-4, rtol=0)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_an_moe_config_without_a_sparse_layer_is_refused_by_name(batch_invariant):
    """A Qwen3-MoE config whose decoder_sparse_step / mlp_only_layers leave every layer dense: a clear error, not an
    IndexError from the router lookup; one sparse layer left is accepted."""
    dense = tiny_model("qwen3_moe", num_hidden_layers=3, decoder_sparse_step=2, mlp_only_layers=[1])
    with pytest.raises(ValueError, match="leave no sparse MoE block"):
        GenerationEngine(dense, eos_token_ids=[], batch_invariant=batch_invariant)
    GenerationEngine(tiny_model("qwen3_moe", num_hidden_layers=3, decoder_sparse_step=2, mlp_only_layers=[]),
                     eos_token_ids=[], batch_invariant=batch_invariant)
