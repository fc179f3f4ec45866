"""The bitwise tier of the differential harness (``numerics.batch_invariant``, issue 35): the engine's log-prob of
every sampled token is ``torch.equal`` to the trainer's packed-forward log-prob of that token, through the real
``packed_logprobs`` path (``ForwardWrapper(model, packed_forward)``, ``fused_linear_logprobs``) the trainer runs.

The schedules are those of ``test_generation_fidelity`` (random tiny Qwen2 / Llama / Qwen3, prompts, n, stop ids,
``max_batch_size`` below the samples (refill), small KV budgets (admission waits, preemption and recompute),
``sync_every`` 1 / 3 / 8, page sizes 1 / 3 / 16, the CPU row cache or the pages, greedy, temperatures, top-k/top-p)
and more: fp32 and bf16, the engine and the trainer on 1 or 2 threads each (2: the slow tier), the trainer's
micro-batch token budget (which sequences are packed together), multi-turn conversations (observations appended, the
turns resumed against their cached K/V, paused samples evicted and recomputed), LoRA, and a generation session across
a weight update.
For every case 0 tokens differ, and two schedules give the same tokens and the same log-prob bits.

The fast tier runs a few derandomized examples of each; ``-m slow`` runs a larger sweep.
"""

import contextlib
import importlib.util
from unittest import mock

import pytest
import test_generation_fidelity
import torch
from fastgrpo.kernels.batch_invariant import invariant_ops
from hypothesis import given, settings
from hypothesis import strategies as st
from test_generation import ARCHS, MOE_ARCH, random_prompts, tiny_model
from test_generation_fidelity import cases, draw_schedules, engine_for, run_turns, turn_cases
from turn_script import CharTokenizer

from fastgrpo.algorithms.batch import Sample, pack_microbatches
from fastgrpo.algorithms.forward import packed_forward, packed_logprobs
from fastgrpo.distributed import ForwardWrapper
from fastgrpo.engine.engine import GenerationEngine, SamplingParams
from fastgrpo.models.attention import enable_packed_attention
from fastgrpo.models.loading import enable_activation_checkpointing
from fastgrpo.models.moe import EXPERTS_IMPLEMENTATION, MoERouting, enable_moe, moe_blocks

# PEFT for the LoRA cases only: the others (the CUDA tier's too, tests/test_bitwise_devices.py) run without it
PEFT = importlib.util.find_spec("peft") is not None
if PEFT:
    from test_lora import random_lora
needs_peft = pytest.mark.skipif(not PEFT, reason="needs peft")


def trainer_mismatches(model, prompts, outs, temperature, budget, threads) -> tuple[int, int]:
    """(tokens whose engine log-prob differs from the trainer's, sampled tokens): every trajectory of ``outs``
    packed into micro-batches of at most ``budget`` tokens, scored by ``packed_logprobs`` with the invariant ops on
    ``threads`` threads, on the model's device. An MoE model (the engine recorded its routing) runs the trainer's
    experts and routing hooks (``enable_moe``), and each micro-batch is checked further (:func:`check_moe_routing`)."""
    enable_packed_attention(model)
    moe = bool(moe_blocks(model))
    if moe and model.config._experts_implementation != EXPERTS_IMPLEMENTATION:
        enable_moe(model)
    samples = [Sample(p, list(c.token_ids), list(c.logprobs), 0.0, True, loss_mask=list(c.loss_mask),
                      routing=c.routing) for p, comps in zip(prompts, outs) for c in comps]
    longest = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    device = next(model.parameters()).device
    differ = total = 0
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with invariant_ops(device):
            for mb in pack_microbatches(samples, max(budget, longest), device):
                forward = ForwardWrapper(model, packed_forward)
                logp = (check_moe_routing(model, forward, mb, temperature) if moe else
                        packed_logprobs(forward, mb, temperature))
                sampled = mb.mask != 0
                differ += int((logp[sampled] != mb.sample_logprobs[sampled]).sum())
                total += int(sampled.sum())
    finally:
        torch.set_num_threads(saved)
    return differ, total


def check_moe_routing(model, forward, mb, temperature):
    """An MoE micro-batch: the trainer's own routing (each MoE layer's router output, after fastgrpo's hook) equals
    the engine's record ``mb.routing`` at every recorded token (all but each sequence's last), ids in the same order;
    replaying the record (router replay) gives the same log-prob bits at every target. Returns the log-probs."""
    routes = []
    hooks = [block.gate.register_forward_hook(lambda m, a, out: routes.append(out[2])) for _, block in
             moe_blocks(model)]
    try:
        logp = packed_logprobs(forward, mb, temperature)
    finally:
        for hook in hooks:
            hook.remove()
    trainer_NLK = torch.stack(routes, 1)
    recorded_N = mb.routing[:, 0, 0] < model.config.num_experts
    assert recorded_N.sum() == recorded_N.numel() - (mb.batch.cu_seqlens.numel() - 1)  # all but the last tokens
    assert torch.equal(trainer_NLK[recorded_N], mb.routing[recorded_N].long()), "the record is not the trainer's"
    replayed = packed_logprobs(forward, mb, temperature, MoERouting(mb.routing))
    assert torch.equal(replayed, logp), "replaying the engine's routing changed the trainer's log-probs"
    return logp


@contextlib.contextmanager
def one_thread_scope():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def assert_same_runs(runs):
    """Two schedules: the same tokens, masks, finish reasons and log-prob bits."""
    for comps_a, comps_b in zip(*runs):
        for a, b in zip(comps_a, comps_b):
            assert (a.token_ids, a.loss_mask, a.finish_reason) == (b.token_ids, b.loss_mask, b.finish_reason)
            assert torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


@st.composite
def bitwise_cases(draw, base, max_threads=1):
    """A schedule of ``base`` and: the dtype, the engine's and the trainer's thread counts (2 only in the slow tier:
    a small multi-threaded fp64 GEMM can take tens of milliseconds on a loaded 2-core host), the trainer's token
    budget per micro-batch."""
    return (draw(base), draw(st.sampled_from([torch.float32, torch.bfloat16])), draw(st.integers(1, max_threads)),
            draw(st.integers(1, max_threads)), draw(st.sampled_from([16, 64, 4096])))


def check_bitwise(case, dtype, engine_threads, trainer_threads, budget, adapt=None, changes=None, device="cpu"):
    """``changes``: the tiny model's config fields to change (``tiny_model``); ``device``: where the model, the
    engine and the trainer's forward run."""
    arch, seed, lengths, params, schedules = case
    model = tiny_model(arch, seed=seed % 5, **(changes or {})).to(device, dtype)
    model = model if adapt is None else adapt(model, seed)
    prompts = random_prompts(lengths, seed=seed)
    record = arch in MOE_ARCH  # an MoE model's engine records its routing (router replay)
    saved = torch.get_num_threads()
    torch.set_num_threads(engine_threads)
    try:
        runs = [engine_for(model, params, prompts, **s, batch_invariant=True, record_routing=record).generate(
            prompts, params) for s in schedules]
    finally:
        torch.set_num_threads(saved)
    differ, total = trainer_mismatches(model, prompts, runs[0], params.temperature or 1.0, budget, trainer_threads)
    assert total > 0 and differ == 0, f"{differ} of {total} sampled tokens differ from the trainer's log-prob"
    assert_same_runs(runs)


@settings(max_examples=6, deadline=None)
@given(bitwise_cases(cases()))
def test_engine_logprobs_equal_the_trainers_bit_for_bit(case):
    check_bitwise(*case)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(bitwise_cases(cases(max_prompts=6, max_samples=64), max_threads=2))
def test_engine_logprobs_equal_the_trainers_sweep(case):
    check_bitwise(*case)


@st.composite
def long_cases(draw):
    """Sequences past several big blocks of the attention (64 keys): the row cache's kept value grids
    (``KeptValueGrids``) made as the rows pass a block and made again when a row is loaded anew (rows change hands:
    a small batch, preemption with few spare pages), against the pages' path and the trainer."""
    P = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(1, 90), min_size=P, max_size=P))
    params = SamplingParams(n=draw(st.integers(1, 3)), temperature=1.0, max_new_tokens=draw(st.integers(60, 150)),
                            seed=draw(st.integers(0, 2**20)))
    schedules = [dict(max_batch_size=draw(st.integers(1, 4)), sync_every=draw(st.sampled_from([1, 3])),
                      page_size=draw(st.sampled_from([3, 16])), spare_pages=draw(st.sampled_from([None, 0, 2])),
                      row_cache=row_cache) for row_cache in (True, False)]
    return (draw(st.sampled_from(sorted(ARCHS))), draw(st.integers(0, 2**16)), lengths, params, schedules), \
        draw(st.sampled_from([torch.float32, torch.bfloat16])), 1, 1, draw(st.sampled_from([64, 4096]))


@settings(max_examples=3, deadline=None)
@given(long_cases())
def test_long_sequences_logprobs_equal_the_trainers(case):
    check_bitwise(*case, changes=dict(max_position_embeddings=256))


def moe_cases(**kwargs):
    """The harness's schedules (drawn for a dense architecture) on a random tiny Qwen3-MoE or Qwen2-MoE."""
    return on_moe(cases(**kwargs))


def on_moe(base):
    """``base``'s cases (architecture first) on a random tiny Qwen3-MoE or Qwen2-MoE instead."""
    return st.tuples(st.sampled_from(list(MOE_ARCH)), base).map(lambda ac: (ac[0], *ac[1][1:]))


def router_changes():
    """The router's top-k (2 to 4 of 8 experts: the sum over k has an order from 3 on) and renormalisation."""
    return st.builds(lambda k, norm: dict(num_experts_per_tok=k, norm_topk_prob=norm), st.integers(2, 4),
                     st.booleans())


@settings(max_examples=6, deadline=None)
@given(bitwise_cases(moe_cases()), router_changes())
def test_moe_engine_logprobs_and_routing_equal_the_trainers(case, changes):
    """Qwen3-MoE and Qwen2-MoE (shared expert): every sampled token's log-prob bit for bit, the engine's routing record
    the trainer's own routing (in order), and router replay changing no bit (:func:`check_moe_routing`)."""
    check_bitwise(*case, changes=changes)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(bitwise_cases(moe_cases(max_prompts=6, max_samples=64), max_threads=2), router_changes())
def test_moe_engine_logprobs_and_routing_equal_the_trainers_sweep(case, changes):
    check_bitwise(*case, changes=changes)


def lora(model, seed):
    """Random non-zero adapters (test_lora's) without dropout (the mode refuses LoRA dropout)."""
    return random_lora(model, seed, dropout=0.0)


@needs_peft
@settings(max_examples=3, deadline=None)
@given(bitwise_cases(cases(max_prompts=3, max_samples=12)))
def test_lora_engine_logprobs_equal_the_trainers(case):
    check_bitwise(*case, adapt=lora)


def attention_lora(model, seed):
    """:func:`lora` on the attention projections only: an MoE model's ``gate_proj`` / ``up_proj`` / ``down_proj``
    names make PEFT adapt its fused experts, which fastgrpo refuses."""
    return random_lora(model, seed, dropout=0.0, targets=["q_proj", "k_proj", "v_proj", "o_proj"])


@needs_peft
@settings(max_examples=2, deadline=None)
@given(bitwise_cases(moe_cases(max_prompts=3, max_samples=12)))
def test_moe_lora_engine_logprobs_and_routing_equal_the_trainers(case):
    check_bitwise(*case, adapt=attention_lora)


def check_turns_bitwise(case, dtype, budget, device="cpu", changes=None):
    arch, seed, lengths, params, script, schedules = case
    model = tiny_model(arch, seed=seed % 5, **(changes or {})).to(device, dtype)
    tokenizer = CharTokenizer(96, seed=seed)
    prompts = random_prompts(lengths, seed=seed)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [run_turns(model, tokenizer, prompts, params, script, **s, batch_invariant=True,
                          record_routing=arch in MOE_ARCH)[0] for s in schedules]
    finally:
        torch.set_num_threads(saved)
    differ, total = trainer_mismatches(model, prompts, runs[0], params.temperature or 1.0, budget, 1)
    assert total > 0 and differ == 0, f"{differ} of {total} sampled tokens differ from the trainer's log-prob"
    assert_same_runs(runs)
    return prompts, runs[0]


@settings(max_examples=3, deadline=None)
@given(turn_cases(), st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from([32, 4096]))
def test_multi_turn_logprobs_equal_the_trainers(case, dtype, budget):
    check_turns_bitwise(case, dtype, budget)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(turn_cases(max_prompts=5, max_samples=32), st.sampled_from([torch.float32, torch.bfloat16]),
       st.sampled_from([32, 4096]))
def test_multi_turn_logprobs_equal_the_trainers_sweep(case, dtype, budget):
    check_turns_bitwise(case, dtype, budget)


@st.composite
def long_turn_cases(draw):
    """Conversations past the attention's 64-key big blocks (the turn cases stop at 64 tokens): prompts at and around
    a block's edge, turns resumed onto cached K/V beyond it (the pages' index-picked blocks, the row cache's kept value
    grids made again when a resumed row is loaded anew), observations up to 40 tokens, tight page budgets."""
    P = draw(st.integers(1, 2))
    n = draw(st.integers(1, 2))
    lengths = [draw(st.sampled_from([64, 65, 100])),  # a conversation past the first big block
               *draw(st.lists(st.sampled_from([1, 30, 63, 64]), min_size=P - 1, max_size=P - 1))]
    greedy = draw(st.booleans())
    params = SamplingParams(
        n=n, temperature=0.0 if greedy else draw(st.sampled_from([0.7, 1.0])),
        max_new_tokens=draw(st.sampled_from([10, 30, 70])),
        stop_token_ids=tuple(draw(st.lists(st.integers(0, 95), min_size=2, max_size=12, unique=True))),
        max_turns=draw(st.integers(2, 4)), max_sequence_tokens=draw(st.sampled_from([None, 200])),
        seed=draw(st.integers(0, 2**20)))
    script = dict(seed=draw(st.integers(0, 2**16)), max_obs=draw(st.sampled_from([3, 15, 40])),
                  finish_prob=draw(st.sampled_from([0.0, 0.2])), max_delay=draw(st.sampled_from([0, 2])),
                  stop_strings=((), ()))
    return (draw(st.sampled_from(sorted(ARCHS))), draw(st.integers(0, 2**16)), lengths, params, script,
            draw_schedules(draw, P * n))


def check_long_turns_bitwise(case, dtype, budget):
    with mock.patch.object(test_generation_fidelity, "MAX_POS", 256):  # the harness's bound on a conversation: 64
        prompts, runs = check_turns_bitwise(case, dtype, budget, changes=dict(max_position_embeddings=256))
    assert max(len(p) + len(c.token_ids) for p, comps in zip(prompts, runs) for c in comps) > 64


@settings(max_examples=2, deadline=None)
@given(long_turn_cases(), st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from([64, 4096]))
def test_long_multi_turn_logprobs_equal_the_trainers(case, dtype, budget):
    check_long_turns_bitwise(case, dtype, budget)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(long_turn_cases(), st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from([64, 4096]))
def test_long_multi_turn_logprobs_equal_the_trainers_sweep(case, dtype, budget):
    check_long_turns_bitwise(case, dtype, budget)


@settings(max_examples=3, deadline=None)
@given(on_moe(turn_cases()), st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from([32, 4096]))
def test_moe_multi_turn_logprobs_and_routing_equal_the_trainers(case, dtype, budget):
    """Multi-turn on Qwen3-MoE / Qwen2-MoE: observations appended, turns resumed: the log-probs, the record (every
    turn's tokens, observations included) and replay as in the single-turn MoE test."""
    check_turns_bitwise(case, dtype, budget)


@pytest.mark.parametrize("row_cache", [True, False])
def test_session_after_a_weight_update(row_cache):
    """A generation session across an in-place weight update with its K/V recomputed: the tokens sampled after the
    update have the trainer's log-probs under the new weights (the engine's weight grids are made again)."""
    model = tiny_model("qwen2", seed=3)
    prompts = random_prompts([4, 9, 6], seed=3)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=11)
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=4, row_cache=row_cache, batch_invariant=True)
    with engine.session(params, max_prompt_tokens=16) as session, one_thread_scope():
        session.add(prompts)
        done = session.run(1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        session.update(recompute_kv=True)
        done += session.run(len(prompts))
    outs = [comps for _, comps in sorted(done, key=lambda kc: kc[0])]
    for comps in outs:  # only the tokens of the new version are the new weights' samples
        for c in comps:
            c.loss_mask = [int(v == 1) for v in c.versions]
    differ, total = trainer_mismatches(model, prompts, outs, 1.0, 4096, 1)
    assert total > 0 and differ == 0


def test_refusals():
    """What breaks invariance is refused when the engine is built, naming the reason."""
    model = tiny_model("qwen2")
    for change, match in [(dict(hidden_act="gelu"), "activation"), (dict(attention_dropout=0.1), "attention_dropout"),
                          (dict(model_type="mistral"), "architecture 'mistral'")]:
        bad = tiny_model("qwen2")
        for key, value in change.items():
            setattr(bad.config, key, value)
        with pytest.raises(ValueError, match=match):
            GenerationEngine(bad, eos_token_ids=[], batch_invariant=True)
    with pytest.raises(ValueError, match="fp64"):
        GenerationEngine(tiny_model("llama").double(), eos_token_ids=[], batch_invariant=True)
    # sliding windows by the layers' types: a Qwen2 whose max_window_layers reaches its layer count has none
    for window_from, sliding in [(1, True), (2, False)]:
        qwen = tiny_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=window_from)
        for mode in (False, True):
            if sliding:
                with pytest.raises(ValueError, match="sliding-window attention"):
                    GenerationEngine(qwen, eos_token_ids=[], batch_invariant=mode)
            else:
                GenerationEngine(qwen, eos_token_ids=[], batch_invariant=mode)
    with pytest.raises(ValueError, match="torch.compile"):
        GenerationEngine(torch.compile(model), eos_token_ids=[], batch_invariant=True)
    from fastgrpo.models.batch_invariant import check_model

    def compile_layer(m):
        m.model.layers[1] = torch.compile(m.model.layers[1])

    def compile_forward(m):
        m.model.forward = torch.compile(m.model.forward)

    # compiled in place or in part: inductor's kernels replace the mode's ops in the trainer's forward
    for compile_part, where in [(lambda m: m.model.compile(), "model"), (lambda m: m.model.layers[0].compile(),
                                "model.layers.0"), (compile_layer, "model.layers.1"), (compile_forward, "model")]:
        part = tiny_model("qwen2")
        enable_packed_attention(part)
        compile_part(part)
        for check in (lambda m: check_model(m, "fastgrpo_varlen"),
                      lambda m: GenerationEngine(m, eos_token_ids=[], batch_invariant=True)):
            with pytest.raises(ValueError, match=f"{where} is torch.compile'd"):
                check(part)

    with pytest.raises(ValueError, match="attention is 'sdpa'"):
        check_model(model, "fastgrpo_varlen")
    moe = tiny_model("qwen3_moe")  # transformers' eager experts: the trainer's loader sets fastgrpo's
    enable_packed_attention(moe)
    with pytest.raises(ValueError, match="experts are 'eager'"):
        check_model(moe, "fastgrpo_varlen")
    enable_moe(moe)
    check_model(moe, "fastgrpo_varlen")
    dense = tiny_model("llama")
    enable_packed_attention(dense)
    for m in (dense, moe):  # the model's own checkpointing recomputes outside the mode; fastgrpo's in it
        m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        with pytest.raises(ValueError, match="recomputes outside the mode"):
            check_model(m, "fastgrpo_varlen")
        GenerationEngine(m, eos_token_ids=[], batch_invariant=True)  # the engine runs no backward: accepted
        enable_activation_checkpointing(m)
        check_model(m, "fastgrpo_varlen")


# ---------------------------------------------------------------- the GRPO step on the engine's log-probs

GRPO_SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations=4", "rollout.max_new_tokens=6",
              "sft.warmup_steps=0", "reward.num_workers=0", "grpo.mask_zero_std_groups=false",
              "grpo.rollout_is=token_truncate", "logging.progress_bar=false", "train.num_threads=1",
              "data.shuffle=false"]


def grpo_update(tmp_path, mode: bool, *overrides, recipe=None):
    """One GRPO rollout of the tiny recipe (or ``recipe``; the mode on or off), the same fixed advantages (±1 by
    completion: the untrained policy's rewards are all 0), then the policy update; returns (samples, metrics,
    old-log-prob forwards, the parameters after)."""
    from fastgrpo.config import load_config, stage_settings
    from fastgrpo.trainer import Trainer

    cfg = load_config(recipe, overrides=[*GRPO_SMALL, f"numerics.batch_invariant={str(mode).lower()}",
                                 f"logging.output_dir={tmp_path / str(mode)}", *overrides])
    trainer = Trainer(cfg)
    try:
        settings = stage_settings(cfg, 0)
        samples, _ = trainer.algorithm.rollout(trainer.sampler.next(trainer.algorithm.rows_per_step), settings)
        for i, s in enumerate(samples):
            s.advantage = 1.0 if i % 2 else -1.0
        update = trainer.algorithm.update
        forwards = []
        policy_logprobs = update._policy_logprobs
        update._policy_logprobs = lambda plans, n_mbs, attr, t, **kw: (forwards.append(attr),
                                                                      policy_logprobs(plans, n_mbs, attr, t, **kw))
        m = update.run(samples, beta=0.0, epsilon_high=settings["epsilon_high"],
                       max_new_tokens=settings["max_new_tokens"])
        params = [p.detach().clone() for p in trainer.model.parameters()]
    finally:
        trainer.close()
    return samples, m, forwards, params


@pytest.mark.parametrize("optimizer_steps", [1, 2])
def test_grpo_update_on_the_engine_logprobs(tmp_path, optimizer_steps):
    """With the mode on the training forward's log-probs are the engine's bit for bit: the gate
    ``sampling/sampling_logp_difference/max`` is exactly 0.0 and the rollout IS weights exactly 1, and with two
    optimizer steps per rollout the old-log-prob forward is not run (the engine's log-probs are the old ones). The
    update is the mode-off one up to the log-prob rounding (the same samples, loss, gradient norm)."""
    extra = [f"train.sequences_per_optimizer_step={16 // optimizer_steps}"]
    on, m_on, forwards_on, params_on = grpo_update(tmp_path, True, *extra)
    off, m_off, forwards_off, params_off = grpo_update(tmp_path, False, *extra)
    assert [s.completion_ids for s in on] == [s.completion_ids for s in off]
    assert m_on["sampling/sampling_logp_difference/max"] == 0.0
    assert m_on["sampling/importance_sampling_ratio/min"] == m_on["sampling/importance_sampling_ratio/max"] == 1.0
    assert m_on["optimizer_steps"] == m_off["optimizer_steps"] == optimizer_steps
    assert forwards_on == [] and forwards_off == (["old_logprobs"] if optimizer_steps > 1 else [])
    # the log-probs differ by fp32 rounding between the modes (the tiny model's ~1e-6), the update with them
    assert m_off["sampling/sampling_logp_difference/max"] < 1e-4
    assert m_on["loss"] == pytest.approx(m_off["loss"], rel=1e-4, abs=1e-6)
    assert m_on["grad_norm"] == pytest.approx(m_off["grad_norm"], rel=1e-3)
    lr = 3e-4  # the tiny recipe's: an Adam step moves a parameter by at most ~lr per optimizer step
    assert max((a - b).abs().max().item() for a, b in zip(params_on, params_off)) <= 2 * lr * optimizer_steps


@pytest.mark.parametrize("recipe", [None, "moe-tiny"])
def test_activation_checkpointing_recomputes_on_the_invariant_ops(tmp_path, recipe):
    """``train.activation_checkpointing`` with the mode on: the backward's recompute runs on the invariant ops as the
    forward did, so it recomputes the very values (an MoE router, without replay, the same experts) and the update
    equals the one without checkpointing bit for bit: the same loss, gradient norm and parameters after. (Run
    outside the mode, the recompute's attention saved other tensors than the forward's and the backward raised.)"""
    extra = ["train.sequences_per_optimizer_step=16",
             *(["model.moe.router_replay=false", "model.moe.replay_gap=false"] if recipe else [])]
    plain, m_plain, _, params_plain = grpo_update(tmp_path / "plain", True, *extra, recipe=recipe)
    ckpt, m_ckpt, _, params_ckpt = grpo_update(tmp_path / "ckpt", True, *extra, "train.activation_checkpointing=true",
                                               recipe=recipe)
    assert [s.completion_ids for s in ckpt] == [s.completion_ids for s in plain]
    assert m_ckpt["sampling/sampling_logp_difference/max"] == 0.0
    assert (m_ckpt["loss"], m_ckpt["grad_norm"]) == (m_plain["loss"], m_plain["grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(params_ckpt, params_plain))


def test_moe_grpo_update_on_the_engine_logprobs(tmp_path):
    """The moe-tiny recipe (Qwen3-MoE, router replay, the gap without replay measured) with the mode on, one optimizer
    step per rollout: the gate ``sampling/sampling_logp_difference/max`` is exactly 0.0, the rollout IS weights
    exactly 1, no replayed token's fresh top-k differs from the record (the weights are the sampler's: the update's
    forwards all come before its step), and the policy's log-probs without replay are the engine's too (0.0)."""
    _, m, _, _ = grpo_update(tmp_path, True, "train.sequences_per_optimizer_step=16", recipe="moe-tiny")
    assert m["sampling/sampling_logp_difference/max"] == 0.0
    assert m["sampling/importance_sampling_ratio/min"] == m["sampling/importance_sampling_ratio/max"] == 1.0
    assert m["moe/replay_mismatch"] == 0.0
    assert m["moe/no_replay_logp_difference/max"] == 0.0
    assert m["optimizer_steps"] == 1


@needs_peft
def test_lora_dropout_in_the_adapter_is_refused():
    """LoRA dropout set in the adapter itself (a ``model.lora.path`` adapter's ``adapter_config.json``, which the
    config's ``model.lora.dropout`` check cannot see) is refused by the trainer's check; the engine, which applies no
    dropout, accepts it; an adapter without dropout passes both."""
    from fastgrpo.models.batch_invariant import check_model

    for dropout in (0.0, 0.3):
        adapted = random_lora(tiny_model("qwen2"), 0, dropout=dropout)
        enable_packed_attention(adapted)
        GenerationEngine(adapted, eos_token_ids=[], batch_invariant=True)
        if dropout:
            with pytest.raises(ValueError, match="applies dropout in training"):
                check_model(adapted, "fastgrpo_varlen")
        else:
            check_model(adapted, "fastgrpo_varlen")


def test_config_refusals():
    from fastgrpo.config import load_config

    for overrides, name in [(["algorithm=dpo"], "algorithm"),
                            (["model.lora={r: 4, dropout: 0.1}"], "model.lora.dropout")]:
        with pytest.raises(ValueError, match=name):
            load_config(overrides=["numerics.batch_invariant=true", *overrides])
