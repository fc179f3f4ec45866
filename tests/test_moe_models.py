"""Qwen3-MoE and Qwen2-MoE in training (``fastgrpo.models.moe``, ``fastgrpo.algorithms.moe``) against transformers'
own models.

References: transformers' Qwen3-MoE / Qwen2-MoE run per sequence with its eager experts (a loop over experts) and SDPA
attention, in fp32 and fp64; its ``aux_loss`` (``load_balancing_loss_func`` on a padded batch with the attention
mask); router replay spelled out in the test (weights ``p[ids]``, over ``Σ p[ids]`` when ``norm_topk_prob``, from the
current router's fp32 softmax). Qwen2-MoE's cases have a shared expert, q/k/v biases, ``norm_topk_prob`` False and
``decoder_sparse_step`` 2.

Tolerances (flash-attn's rule, ``checks.assert_flash``): the packed forward with the grouped experts against the fp64
model within twice the fp32 model's own error plus ``16 · eps32 · max|ref|``; the two fp32 computations differ only
in summation order. Routing is discrete: every case first checks that the fp32 and fp64 routers choose the same
experts by a margin (``assert_decisive`` on the gap between the K-th and (K+1)-th probabilities), else the case, not
the code, must change.
"""

import copy
import math

import pytest
import torch
from checks import EPS32, assert_decisive, assert_flash, one_thread  # noqa: F401  (one_thread: autouse)

from fastgrpo.algorithms.batch import Sample
from fastgrpo.algorithms.forward import packed_forward
from fastgrpo.algorithms.moe import METRICS
from fastgrpo.algorithms.update import PolicyUpdate
from fastgrpo.config import LoRAConfig, ModelConfig, MoEConfig, load_config
from fastgrpo.distributed import init_distributed, wrap_model
from fastgrpo.engine.engine import GenerationEngine
from fastgrpo.models.loading import enable_activation_checkpointing, load_model
from fastgrpo.models.moe import EXPERTS_IMPLEMENTATION, MoERouting, enable_moe, moe_blocks
from fastgrpo.models.packing import pack

VOCAB = 96
ROUTER_MARGIN = 1e-5  # fp32 and fp64 probabilities differ by ~1e-7 here: a gap this wide cannot flip


def tiny_moe(seed=0, *, arch="qwen3_moe", layers=3, experts=8, top_k=2, mlp_only=(1,), init=0.3, act="silu"):
    """A random tiny MoE causal LM (fp32, eval mode) with fastgrpo's experts and routing hooks: a Qwen3-MoE (top-k
    renormalised), or a Qwen2-MoE with a shared expert of width 24 and MoE every second layer (``mlp_only`` unused)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, num_experts=experts,
                  num_experts_per_tok=top_k, max_position_embeddings=64, initializer_range=init, hidden_act=act)
    torch.manual_seed(seed)
    if arch == "qwen2_moe":
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**common, shared_expert_intermediate_size=24, decoder_sparse_step=2))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, head_dim=8, norm_topk_prob=True,
                                                   mlp_only_layers=list(mlp_only)))
    model.eval()
    enable_moe(model)
    return model


def hf_reference(model, dtype):
    """transformers' own model on the same weights: eager experts, SDPA attention, in ``dtype``."""
    ref = copy.deepcopy(model).to(dtype)
    ref.zero_grad(set_to_none=True)
    ref.set_experts_implementation("eager")
    ref.set_attn_implementation("sdpa")
    return ref


def hf_aux_loss(ref, seqs):
    """transformers' ``aux_loss`` (``load_balancing_loss_func``) of ``seqs`` as one right-padded batch with its
    attention mask: the real tokens only."""
    T = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (T - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs])
    return ref(ids, attention_mask=mask, output_router_logits=True).aux_loss


def sequences(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def assert_routing_decisive(model, seqs):
    """Every token's K-th and (K+1)-th router probabilities differ by ``ROUTER_MARGIN`` (fp64 model)."""
    K = model.config.num_experts_per_tok
    with torch.no_grad():
        for s in seqs:
            out = hf_reference(model, torch.float64).model(torch.tensor([s]), output_router_logits=True)
            for z in out.router_logits:
                top = z.softmax(-1).topk(K + 1, -1).values
                assert_decisive("router K-th − (K+1)-th probability", top[:, K - 1] - top[:, K], [0.0], ROUTER_MARGIN)


def packed_hidden(model, seqs, routing=None):
    b = pack(seqs)
    return packed_forward(model, b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen, moe_routing=routing)[0]


def test_the_tiny_model_becomes_a_qwen3_moe_with_the_configured_layers():
    cfg = ModelConfig(tiny_num_layers=4, moe=MoEConfig(tiny_num_experts=4, tiny_num_experts_per_tok=3,
                                                       tiny_decoder_sparse_step=2, tiny_mlp_only_layers=[3]))
    model, _ = load_model(cfg, torch.device("cpu"))
    assert model.config.model_type == "qwen3_moe" and model.config.norm_topk_prob
    assert [i for i, _ in moe_blocks(model)] == [1]  # (i + 1) % 2 == 0, and layer 3 keeps its dense MLP
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION
    assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 3
    dense, _ = load_model(ModelConfig(), torch.device("cpu"))
    assert dense.config.model_type == "qwen2"


def test_the_tiny_model_becomes_a_qwen2_moe_with_a_shared_expert():
    moe = MoEConfig(tiny_num_experts=4, tiny_decoder_sparse_step=2, tiny_mlp_only_layers=[1],
                    tiny_shared_expert_intermediate_size=40)
    cfg = ModelConfig(tiny_num_layers=4, moe=moe)
    model, _ = load_model(cfg, torch.device("cpu"))
    c = model.config
    assert c.model_type == "qwen2_moe" and not c.norm_topk_prob and c.qkv_bias
    assert [i for i, _ in moe_blocks(model)] == [3]  # layer 1 would be one ((1 + 1) % 2 == 0) but keeps its MLP
    block = dict(moe_blocks(model))[3]
    assert block.shared_expert.gate_proj.out_features == 40 and block.experts.gate_up_proj.shape == (4, 128, 64)
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION


QWEN2_MOE = dict(arch="qwen2_moe", layers=4)  # MoE at layers 1 and 3, a shared expert, q/k/v biases, top-k as is


@pytest.mark.parametrize("kind", [dict(mlp_only=(1,)), dict(mlp_only=()), QWEN2_MOE],
                         ids=["dense-between", "all-moe", "qwen2-moe"])
def test_packed_forward_with_grouped_experts_equals_transformers_per_sequence(kind):
    model = tiny_moe(seed=3, **kind)
    seqs = sequences([7, 1, 12])
    assert_routing_decisive(model, seqs)
    h_NH = packed_hidden(model, seqs)
    up_NH = torch.randn(h_NH.shape, generator=torch.Generator().manual_seed(5))
    (h_NH * up_NH).sum().backward()
    refs = {}
    for dtype in (torch.float32, torch.float64):
        ref = hf_reference(model, dtype)
        ref.zero_grad()
        h = torch.cat([ref.model(torch.tensor([s])).last_hidden_state[0] for s in seqs])
        (h * up_NH.to(dtype)).sum().backward()
        refs[dtype] = (h.detach(), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None})
    (h32, g32), (h64, g64) = refs[torch.float32], refs[torch.float64]
    assert_flash("hidden", h_NH.detach(), h64, h32, 16 * EPS32 * h64.abs().max().item())
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(g64)
    for n, g in grads.items():
        assert_flash(n, g, g64[n], g32[n], 16 * EPS32 * max(g64[n].abs().max().item(), 1e-6))


def replay_reference(model, seqs, replay_NLK):
    """transformers' model per sequence with each MoE layer's router forced to the replayed ids (E: its own), the
    weights from the current logits (R3 as the paper defines it); returns the last hidden states ``[N, H]``, the
    model, and the router's own top-K ids in that forward ``[N, L_moe, K]``."""
    ref = hf_reference(model, torch.float32)
    E = model.config.num_experts
    hidden, own, start = [], [], 0
    for s in seqs:
        ids = replay_NLK[start : start + len(s)].long()
        start += len(s)
        handles, fresh = [], []
        for i, (_, block) in enumerate(moe_blocks(ref)):
            def forced(router, args, out, want=ids[:, i], fresh=fresh):
                logits, _, chosen_by_router = out
                fresh.append(chosen_by_router)
                chosen = torch.where(want < E, want, chosen_by_router)
                p = torch.softmax(logits.float(), -1).gather(1, chosen)
                w = p / p.sum(-1, keepdim=True) if model.config.norm_topk_prob else p
                return logits, w.to(logits.dtype), chosen
            handles.append(block.gate.register_forward_hook(forced))
        hidden.append(ref.model(torch.tensor([s])).last_hidden_state[0])
        own.append(torch.stack(fresh, 1))
        for h in handles:
            h.remove()
    return torch.cat(hidden), ref, torch.cat(own)


@pytest.mark.parametrize("kind", [{}, QWEN2_MOE], ids=["qwen3-moe", "qwen2-moe"])
def test_replay_routes_each_token_to_the_recorded_experts(kind):
    model = tiny_moe(seed=4, **kind)
    seqs = sequences([9, 5])
    N, L, K, E = 14, 2, 2, model.config.num_experts
    g = torch.Generator().manual_seed(2)
    replay = torch.stack([torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(L)]) for _ in range(N)])
    replay[[4, 13]] = E  # no record: routed afresh
    routing = MoERouting(replay.to(torch.uint8))
    h_NH = packed_hidden(model, seqs, routing)
    h_NH.sum().backward()
    ref_NH, ref, fresh_NLK = replay_reference(model, seqs, replay)
    ref_NH.sum().backward()
    torch.testing.assert_close(h_NH, ref_NH, atol=16 * EPS32 * ref_NH.abs().max().item(), rtol=0)
    for (_, block), (_, ref_block) in zip(moe_blocks(model), moe_blocks(ref)):
        g_router, ref_g = block.gate.weight.grad, ref_block.gate.weight.grad
        assert g_router.abs().max() > 0  # the router learns through the replayed experts' weights
        torch.testing.assert_close(g_router, ref_g, atol=16 * EPS32 * ref_g.abs().max().item(), rtol=0)
    # the mismatch count: replayed token-layers whose router, in the replayed forward, chose another top-K set
    recorded = replay[:, :, 0] < E
    differ = (fresh_NLK.sort(-1).values != replay.sort(-1).values).any(-1) & recorded
    assert (int(routing.differ), int(routing.compared)) == (int(differ.sum()), int(recorded.sum()))


def test_activation_checkpointing_recomputes_with_the_replayed_experts():
    """The recompute of a checkpointed layer must route as its forward did: same loss and gradients as without
    checkpointing (a recompute that routed afresh would give other gradients)."""
    seqs = sequences([8, 6])
    g = torch.Generator().manual_seed(7)
    replay = torch.stack([torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(2)]) for _ in range(14)])
    grads = []
    for checkpointing in (False, True):
        model = tiny_moe(seed=5).train()
        if checkpointing:
            enable_activation_checkpointing(model)
        h_NH = packed_hidden(model, seqs, MoERouting(replay.to(torch.uint8)))
        (h_NH**2).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n, g0 in grads[0].items():
        torch.testing.assert_close(grads[1][n], g0, atol=4 * EPS32 * g0.abs().max().item(), rtol=0)


def test_load_balancing_loss_equals_transformers_aux_loss_over_real_tokens():
    """Packed (no padding) against transformers' padded batch with its attention mask: the same real tokens."""
    model = tiny_moe(seed=6)
    seqs = sequences([11, 4, 7])
    routing = MoERouting(keep_logits=True)
    packed_hidden(model, seqs, routing)
    got = routing.aux_loss(model.config.num_experts, model.config.num_experts_per_tok)
    with torch.no_grad():
        want = hf_aux_loss(hf_reference(model, torch.float32), seqs)
    torch.testing.assert_close(got.detach(), want, atol=64 * EPS32 * want.abs().item(), rtol=0)


def grpo_samples(model, seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, c = torch.randint(0, VOCAB, (5 + i,), generator=g).tolist(), torch.randint(0, VOCAB, (4,), generator=g)
        out.append(Sample(p, c.tolist(), [-2.0] * 4, advantage=float(i % 3) - 1.0))
    return out


def test_grpo_update_adds_the_aux_loss_as_trl_does():
    """``loss = policy + coef · mean over micro-batches of aux`` (TRL's ``coef · aux / gradient accumulation``): against
    a run with coef 0 on the same samples, the logged loss grows by ``coef · moe/aux_loss`` and the router weights'
    gradient by ``coef / M · ∇ Σ aux``, the aux of each micro-batch transformers' own on its padded sequences."""
    coef = 0.37
    cfg = load_config("moe-tiny", overrides=["train.max_tokens_per_microbatch=24", "train.max_grad_norm=0",
                                             "model.moe.router_replay=false", "model.moe.replay_gap=false"])
    state = init_distributed("cpu")
    runs = []
    for c in (0.0, coef):
        cfg.model.moe.router_aux_loss_coef = c
        model, _ = load_model(cfg.model, state.device, seed=0)
        wrapped = wrap_model(model, state, "none", forward=packed_forward)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        samples = grpo_samples(model)
        m = PolicyUpdate(cfg, wrapped, opt, sched, None, state.device, 1).run(
            samples, beta=0.0, epsilon_high=None, max_new_tokens=4)
        runs.append((m, {n: p.grad.clone() for n, p in model.named_parameters()}, model))
    (m0, g0, _), (m1, g1, model) = runs
    assert math.isnan(m0[METRICS[0]]) and m1[METRICS[0]] > 0  # coef 0: no aux loss (TRL's aux_loss_enabled)
    assert m1["loss"] - m0["loss"] == pytest.approx(coef * m1[METRICS[0]], abs=64 * EPS32 * abs(m1["loss"]))
    from fastgrpo.models.packing import plan_microbatches

    ref = hf_reference(model, torch.float32)
    plan = plan_microbatches([len(s.tokens) for s in samples], 24)
    aux = sum(hf_aux_loss(ref, [samples[i].tokens for i in group]) for group in plan)
    (coef * aux / len(plan)).backward()
    for (_, block), (_, ref_block) in zip(moe_blocks(model), moe_blocks(ref)):
        name = next(n for n, p in model.named_parameters() if p is block.gate.weight)
        want = ref_block.gate.weight.grad
        torch.testing.assert_close(g1[name] - g0[name], want, atol=64 * EPS32 * g1[name].abs().max().item(), rtol=0)


def test_refused_at_start_up_with_their_names(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    mixtral = MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               num_local_experts=2, num_experts_per_tok=1))
    mixtral.save_pretrained(tmp_path / "mixtral")
    from fastgrpo.models.loading import build_tiny_tokenizer

    build_tiny_tokenizer().save_pretrained(tmp_path / "mixtral")
    with pytest.raises(ValueError, match="'mixtral' is a mixture-of-experts architecture"):
        load_model(ModelConfig(path=str(tmp_path / "mixtral")), torch.device("cpu"))
    moe = MoEConfig(tiny_num_experts=4)
    for target in ("experts", "gate", "gate_up_proj"):
        cfg = ModelConfig(moe=moe, lora=LoRAConfig(target_modules=["q_proj", target]))
        with pytest.raises(ValueError, match=rf"model.lora.target_modules \['{target}'\]: the router"):
            load_model(cfg, torch.device("cpu"))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        from fastgrpo.models.moe import check_moe

        check_moe(tiny_moe(act="gelu"), ModelConfig())
    dense, tok = load_model(ModelConfig(), torch.device("cpu"))
    with pytest.raises(ValueError, match="'qwen2' has no MoE layers"):
        GenerationEngine(dense, eos_token_ids=[0], record_routing=True)
    for overrides, match in [
        (["algorithm=dpo", "model.moe.router_replay=true"], "model.moe.router_replay is for algorithm grpo"),
        (["model.moe.router_replay=false", "model.moe.replay_gap=true"], "model.moe.replay_gap needs"),
        (["model.moe.tiny_mlp_only_layers=[2]"], r"model.moe.tiny_mlp_only_layers must be layer indices in \[0, 2\)"),
        (["model.moe.tiny_num_experts_per_tok=9"], "model.moe.tiny_num_experts_per_tok must be <= "),
        (["model.moe.router_aux_loss_coef=-1"], "model.moe.router_aux_loss_coef must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            load_config("moe-tiny", overrides=overrides)


@pytest.mark.parametrize("shared", [0, 40], ids=["qwen3-moe-attention", "qwen2-moe-attention-and-shared-expert"])
def test_lora_on_the_attention_and_the_shared_expert_of_an_moe_model(shared):
    """Adapters on q/k/v/o of a Qwen3-MoE model, and on those and the MLP projections of a Qwen2-MoE model (its
    shared experts' and its dense layer's gate/up/down): the engine's log-probs equal transformers' teacher-forced
    forward of the adapted model, and the packed training forward gives the adapters their gradients."""
    from test_generation import assert_logprobs_match_hf

    from fastgrpo.engine.engine import SamplingParams

    mlp = ["gate_proj", "up_proj", "down_proj"] if shared else []
    cfg = ModelConfig(tiny_initializer_range=0.3, tiny_num_layers=3,
                      moe=MoEConfig(tiny_num_experts=4, tiny_mlp_only_layers=[1],
                                    tiny_shared_expert_intermediate_size=shared),
                      lora=LoRAConfig(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", *mlp]))
    model, _ = load_model(cfg, torch.device("cpu"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # B = 0 at the start: make the adapters count
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if "lora_A" in n and ".mlp." in n}
    want = {f"model.layers.{i}.mlp.shared_expert.{m}" for i in (0, 2) for m in mlp}
    assert adapted == want | {f"model.layers.1.mlp.{m}" for m in mlp}  # the experts and the router never
    prompts = sequences([5, 3])
    out = GenerationEngine(model, eos_token_ids=[], max_batch_size=4).generate(
        prompts, SamplingParams(n=2, max_new_tokens=6, seed=0))
    for p, group in zip(prompts, out):
        for c in group:
            assert_logprobs_match_hf(model, p, c.token_ids, c.logprobs)
    model.train()
    packed_hidden(model, [p + c.token_ids for p, g in zip(prompts, out) for c in g]).sum().backward()
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora_A" in n]
    assert lora_grads and all(g is not None and g.abs().max() > 0 for g in lora_grads)


@pytest.mark.parametrize("shared", [0, 64], ids=["qwen3-moe", "qwen2-moe"])
def test_a_grpo_step_on_the_moe_tiny_recipe_replays_and_logs(tmp_path, shared):
    """The trainer end to end on the moe-tiny recipe (smaller; as a Qwen2-MoE too): the engine records the routing,
    every sample carries it (prompt + completion rows), and the step logs the MoE metrics: the aux loss, the replay
    mismatch (a fraction), and the gap without replay next to the one with it."""
    from fastgrpo.config import stage_settings
    from fastgrpo.trainer import Trainer

    cfg = load_config("moe-tiny", overrides=[
        "grpo.num_prompts_per_step=4", "grpo.num_generations=4", "rollout.max_new_tokens=6", "sft.warmup_steps=0",
        "grpo.mask_zero_std_groups=false", "reward.num_workers=0", "eval.at_start=false", "eval.at_end=false",
        "logging.progress_bar=false", f"logging.output_dir={tmp_path}",
        f"model.moe.tiny_shared_expert_intermediate_size={shared}"])
    trainer = Trainer(cfg)
    try:
        captured = {}
        rollout = trainer.algorithm.rollout

        def spy(indices, settings):
            captured["samples"], m = rollout(indices, settings)
            return captured["samples"], m

        trainer.algorithm.rollout = spy
        m = trainer.algorithm.step(trainer.sampler.next(trainer.algorithm.rows_per_step), stage_settings(cfg, 0))
    finally:
        trainer.close()
    samples = captured["samples"]
    assert len(samples) == 16 and all(s.routing.shape == (len(s.tokens), 2, 2) for s in samples)
    assert all((s.routing[-1] == 8).all() and (s.routing[:-1] < 8).all() for s in samples)
    assert m["moe/aux_loss"] > 0 and 0.0 <= m["moe/replay_mismatch"] <= 1.0
    for name in ("moe/no_replay_logp_difference", "sampling/sampling_logp_difference"):
        assert 0.0 <= m[f"{name}/mean"] <= m[f"{name}/max"] < 1e-3  # fp32: rounding apart


def test_moe_update_metrics_are_the_closed_forms():
    """``moe/no_replay_logp_difference``: mean and max of ``|fresh − sampler|`` over the trained tokens of every
    micro-batch; ``moe/replay_mismatch``: differing over compared token-layers, summed; ``moe/aux_loss``: the mean of
    the micro-batches' aux losses; then reset (NaN where nothing was measured)."""
    from types import SimpleNamespace

    from fastgrpo.algorithms.moe import GAP_METRICS, MoEUpdate

    cfg = load_config("moe-tiny")
    upd = MoEUpdate(cfg, SimpleNamespace(config=SimpleNamespace(router_aux_loss_coef=0.01, num_experts=4,
                                                                num_experts_per_tok=2)))
    g = torch.Generator().manual_seed(3)
    fresh, samp, masks = [], [], []
    for n in (7, 5):
        f, s, m = torch.randn(n, generator=g), torch.randn(n, generator=g), (torch.rand(n, generator=g) > 0.4).float()
        upd.no_replay_gap(f, SimpleNamespace(mask=m, sample_logprobs=s))
        fresh, samp, masks = fresh + [f], samp + [s], masks + [m]
    for differ, compared in ((3, 10), (1, 6)):
        upd.aux_term(SimpleNamespace(differ=torch.tensor(differ), compared=torch.tensor(compared), keep_logits=False),
                     2.0)
    d = (torch.cat(fresh) - torch.cat(samp)).abs()[torch.cat(masks) != 0]
    m = upd.metrics()
    assert m[GAP_METRICS[0]] == pytest.approx(d.mean().item(), rel=1e-6)
    assert m[GAP_METRICS[1]] == pytest.approx(d.max().item(), rel=1e-6)
    assert m[METRICS[1]] == pytest.approx(4 / 16) and math.isnan(m[METRICS[0]])
    assert all(math.isnan(v) for v in upd.metrics().values())  # reset


def test_frozen_routers_get_no_gradient():
    cfg = ModelConfig(moe=MoEConfig(tiny_num_experts=4, freeze_router=True))
    model, _ = load_model(cfg, torch.device("cpu"))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}
