"""Mixture-of-experts models in training: Qwen3-MoE (``model_type`` "qwen3_moe") and Qwen2-MoE ("qwen2_moe"), their
experts on fastgrpo's grouped GEMMs, the router's load-balancing loss, router replay, and what fastgrpo refuses.

A Qwen3-MoE decoder layer is attention then, in place of the dense MLP, transformers' ``Qwen3MoeSparseMoeBlock``:
the router ``mlp.gate`` (``Qwen3MoeTopKRouter``: logits ``z = x W_rᵀ`` ``[T, E]``, fp32 softmax, top-K,
renormalised when ``norm_topk_prob``) and the experts ``mlp.experts`` (``Qwen3MoeExperts``: ``gate_up_proj``
``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``, one fused parameter each), no shared expert. Layers listed in
``mlp_only_layers``, or whose ``i + 1`` is not a multiple of ``decoder_sparse_step``, keep a dense MLP.
A Qwen2-MoE layer (``Qwen2MoeSparseMoeBlock``) has the same router and experts (``norm_topk_prob`` False by default
there: the top-K probabilities are the weights as they are) plus a shared expert that every token goes through, a
dense SwiGLU MLP ``mlp.shared_expert`` of width ``I_s = shared_expert_intermediate_size`` scaled by a sigmoid gate::

    out = Σ_k w_k y_{e_k}(x) + σ(x w_sᵀ) · (silu(x G_sᵀ) ⊙ x U_sᵀ) D_sᵀ        w_s: mlp.shared_expert_gate [1, H]

and q/k/v projections with biases (``qkv_bias``). The shared expert is three ``nn.Linear`` and the gate a fourth:
transformers runs them as they are, the routed part on the grouped experts below.

- **Experts.** :func:`enable_moe` selects ``fastgrpo_grouped`` in transformers' experts interface
  (``config._experts_implementation``; registered when this module is imported, next to the attention interface's
  ``fastgrpo_varlen``): the block's own router runs, then ``fastgrpo.kernels.moe.moe_experts`` (Triton grouped GEMMs
  on CUDA, per-expert products on CPU). Memory per MoE layer and micro-batch of T tokens (S = T·K pairs): the kernel
  saves the gate/up pre-activations ``[S, 2I]`` for backward, nothing of size ``[T, E, ·]``.
- **Routing of one packed forward** (:class:`MoERouting`): the object rides along the decoder call as the keyword
  ``moe_routing``. transformers hands the keyword to every decoder layer (activation checkpointing binds it into the
  layer's recompute) and the layer passes it on to its attention; a forward pre-hook there takes it out and arms the
  layer's router, which runs right after, in the same layer call (or recompute). The router's forward hook then keeps
  its logits for the load-balancing loss (the first call per layer: a recompute adds nothing) and, with replay ids,
  routes each token to the recorded experts.
- **Router replay (R3).** ``replay [N, L_moe, K]``: the experts the generation engine chose for each token
  (``Completion.routing``). The block uses those ids, and their weights are recomputed from the current router:
  ``w_k = p[e_k]`` (``p = softmax(z)`` in fp32), divided by ``Σ_j p[e_j]`` when ``norm_topk_prob``, so the router's
  gradient flows through ``p`` as the paper defines it (a shared expert runs as it does without replay). A token
  without a record (id E: the sequence's last token, which the engine never fed) is routed afresh. Counted per
  forward: token-layers compared and those whose fresh top-K set differs from the replayed one.
- **numerics.batch_invariant.** In a forward on the invariant ops (``fastgrpo.kernels.batch_invariant.active``) the
  router's hook replaces its weights and ids by ``fastgrpo.kernels.batch_invariant_moe.route`` of its logits (which
  the overrides made exact), replay's weights are ``route``'s at the replayed ids, and the experts interface runs
  ``batch_invariant_moe.experts``: the functions the engine's mode-on decoder calls, so the engine's routing record is
  the trainer's own routing and replaying it changes no bit. A checkpointed layer's recompute (in the backward,
  outside the forward scope) routes on PyTorch's kernels.
- **Load-balancing loss.** transformers' ``load_balancing_loss_func`` over the kept logits of every MoE layer
  (``fastgrpo.kernels.moe.load_balancing_loss``): every token of a packed micro-batch is real (no padding), so no mask.
- **Refused at start-up**, naming what: another mixture-of-experts architecture (Mixtral, gpt-oss, DeepSeek, ...:
  ``model_type`` not in ``MOE_MODEL_TYPES``), an activation other than SiLU (the kernel's SwiGLU), and LoRA on the
  router or the experts: PEFT adapts fused 3-D expert parameters only through ``target_parameters`` (its
  ``ParamWrapper`` materialises the whole ``ΔW = B·A`` of every expert, ``[E, 2I, H]``, at each forward), which the
  engine's unmerged LoRA and the grouped-GEMM kernel do not read. A shared expert's projections are ``nn.Linear``:
  ``gate_proj`` / ``up_proj`` / ``down_proj`` targets adapt them (with the dense layers' MLPs), as the attention's.

Tensor names carry their shape: N packed tokens, T tokens, E experts, K experts per token, L_moe MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from fastgrpo.config import ModelConfig
from fastgrpo.kernels import batch_invariant_moe
from fastgrpo.kernels.batch_invariant import active
from fastgrpo.kernels.moe import load_balancing_loss, moe_experts

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
EXPERTS_IMPLEMENTATION = "fastgrpo_grouped"
ROUTING_KWARG = "moe_routing"  # the decoder call's keyword that carries a MoERouting
# config attributes that make a model a mixture of experts (transformers' names across architectures)
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
LORA_MOE_TARGETS = ("experts", "gate", "gate_up_proj", "router")  # module names of the router and the experts
_ARMED = "_fastgrpo_routing"  # the router's attribute: (routing, MoE layer index) for the call that runs next


def grouped_experts_forward(experts, hidden_states, top_k_index, top_k_weights):
    """transformers' experts-interface function: ``Qwen3MoeExperts.forward`` on ``moe_experts`` (``[T, H]`` in and
    out; the ids come from the block's router, so they are not checked by a host read). The Triton kernels on CUDA,
    the per-expert torch path on CPU (under ``TRITON_INTERPRET=1`` too: the interpreter is for the kernels' tests).
    In a ``numerics.batch_invariant`` forward: ``fastgrpo.kernels.batch_invariant_moe.experts``, the engine's."""
    if active():
        return batch_invariant_moe.experts(hidden_states, experts.gate_up_proj, experts.down_proj, top_k_index,
                                           top_k_weights)
    return moe_experts(hidden_states, experts.gate_up_proj, experts.down_proj, top_k_index, top_k_weights,
                       check_ids=False, kernel=hidden_states.is_cuda)


ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, grouped_experts_forward)


def num_experts(config) -> int:
    """Experts per MoE layer of a transformers config (0: a dense model)."""
    return max((int(getattr(config, f, 0) or 0) for f in EXPERT_COUNT_FIELDS), default=0)


def is_moe(model) -> bool:
    """True for a model (or its config) with mixture-of-experts layers."""
    return num_experts(getattr(model, "config", model)) > 0


def moe_blocks(model) -> list[tuple[int, torch.nn.Module]]:
    """``(layer index, block)`` of every sparse MoE block of an MoE causal LM (``model.model.layers``), in layer order;
    the position in this list is the block's MoE layer index (the middle axis of ``replay``)."""
    layers = model.get_decoder().layers
    return [(i, layer.mlp) for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]


def tiny_moe_model(cfg: ModelConfig, common: dict):
    """The built-in tiny model as an MoE causal LM: ``common`` (the tiny model's vocabulary, sizes and token ids) and
    ``cfg.moe.tiny_*`` (experts, top-k, expert width, sparse step, dense layers): a Qwen3-MoE (top-k renormalised), or
    with ``tiny_shared_expert_intermediate_size`` > 0 a Qwen2-MoE with that shared expert (its defaults: q/k/v biases,
    top-k not renormalised); random weights from torch's current generator."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    m = cfg.moe
    moe = dict(num_experts=m.tiny_num_experts, num_experts_per_tok=m.tiny_num_experts_per_tok,
               moe_intermediate_size=m.tiny_moe_intermediate_size, decoder_sparse_step=m.tiny_decoder_sparse_step,
               mlp_only_layers=list(m.tiny_mlp_only_layers))
    if m.tiny_shared_expert_intermediate_size:
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(
            **common, **moe, shared_expert_intermediate_size=m.tiny_shared_expert_intermediate_size))
    config = Qwen3MoeConfig(**common, **moe, head_dim=cfg.tiny_hidden_size // cfg.tiny_num_heads, norm_topk_prob=True)
    return Qwen3MoeForCausalLM(config)


def check_moe(model, cfg: ModelConfig) -> None:
    """Refuse (``ValueError`` naming it) a mixture-of-experts model fastgrpo cannot run, and LoRA targets on its router
    or experts (module docstring); nothing for a dense model."""
    config = model.config
    if not is_moe(config):
        return
    kind = config.model_type
    if kind not in MOE_MODEL_TYPES:
        raise ValueError(f"model.path {cfg.path!r}: model_type {kind!r} is a mixture-of-experts architecture fastgrpo "
                         f"does not run (its MoE support: {list(MOE_MODEL_TYPES)})")
    if config.hidden_act != "silu":
        raise ValueError(f"model.path {cfg.path!r}: hidden_act {config.hidden_act!r}: the experts' kernel computes "
                         "SwiGLU (silu) only")
    lora = cfg.lora
    refused = [t for t in (lora.target_modules if lora is not None else []) if t.split(".")[-1] in LORA_MOE_TARGETS]
    if refused:
        raise ValueError(
            f"model.lora.target_modules {refused}: the router (mlp.gate) and the experts (mlp.experts.gate_up_proj "
            f"[E, 2I, H], mlp.experts.down_proj [E, H, I], fused 3-D parameters) of a {kind} model cannot be LoRA "
            "targets: PEFT adapts fused expert parameters only through target_parameters (its ParamWrapper adds the "
            "whole B·A of every expert to the weight at each forward), which the engine's unmerged LoRA and the "
            "grouped-GEMM kernel do not read; adapt the attention projections (and the dense layers' and shared "
            "expert's MLPs: gate_proj, up_proj, down_proj)")


def enable_moe(model) -> None:
    """Run ``model``'s MoE blocks on the grouped-GEMM experts and install the routing hooks (module docstring); a
    dense model is left as it is."""
    if not is_moe(model):
        return
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    blocks = dict(moe_blocks(model))
    index = {layer: i for i, layer in enumerate(blocks)}
    for li, layer in enumerate(model.get_decoder().layers):
        router = blocks[li].gate if li in blocks else None
        layer.self_attn.register_forward_pre_hook(partial(_arm_router, router, index.get(li)), with_kwargs=True)
        if router is not None:
            router.register_forward_hook(_route)


def freeze_routers(model) -> None:
    """``model.moe.freeze_router``: every MoE block's router weight stops training (no gradient, no optimizer state)."""
    for _, block in moe_blocks(model):
        block.gate.weight.requires_grad_(False)


def _arm_router(router, index, attn, args, kwargs):
    """Attention pre-hook: take the call's ``MoERouting`` out of the keywords (the attention function never sees it)
    and hand it to this layer's router, which runs next (None: a call without one; the router routes as it is)."""
    routing = kwargs.pop(ROUTING_KWARG, None)
    if router is not None:
        setattr(router, _ARMED, None if routing is None else (routing, index))
    return args, kwargs


def _route(router, args, output):
    """Router forward hook: in a ``numerics.batch_invariant`` forward the weights and ids of the router's logits by
    ``fastgrpo.kernels.batch_invariant_moe.route`` (the engine's), then the armed routing's ids and weights in place of
    those (:meth:`MoERouting.route`)."""
    if active():
        logits_NE = output[0]
        output = (logits_NE, *batch_invariant_moe.route(logits_NE, router.top_k, router.norm_topk_prob))
    armed = getattr(router, _ARMED, None)
    if armed is None:
        return output
    setattr(router, _ARMED, None)
    routing, index = armed
    return routing.route(index, router, *output)


class MoERouting:
    """The routing of one packed forward of an MoE model (module docstring).

    Args:
        replay: ``[N, L_moe, K]`` integer expert ids per packed token and MoE layer (E: none recorded, route afresh),
            or None (every token routed by the router).
        keep_logits: keep each MoE layer's router logits ``[N, E]`` for :meth:`aux_loss`.
    """

    def __init__(self, replay: torch.Tensor | None = None, keep_logits: bool = False):
        self.replay = replay
        self.keep_logits = keep_logits
        self.logits: dict[int, torch.Tensor] = {}  # MoE layer index -> [N, E], the first call's
        self.seen: set[int] = set()
        self.differ = self.compared = None  # device scalars: replayed token-layers whose fresh top-K differs, all

    def route(self, index: int, router, logits_NE, weights_NK, ids_NK):
        """The router's output ``(logits, weights, ids)`` for MoE layer ``index``: with replay, the recorded ids and
        their weights from the current logits; the logits kept (``keep_logits``) at the layer's first call."""
        first = index not in self.seen
        self.seen.add(index)
        if first and self.keep_logits:
            self.logits[index] = logits_NE
        if self.replay is None:
            return None
        E = logits_NE.shape[-1]
        want_NK = self.replay[:, index].long()
        ids_NK_replay = torch.where(want_NK < E, want_NK, ids_NK)  # no record: the router's own choice
        if first:  # the recompute of an activation-checkpointed layer counts nothing twice
            recorded_N = want_NK[:, 0] < E
            differ_N = (ids_NK.sort(-1).values != ids_NK_replay.sort(-1).values).any(-1) & recorded_N
            self.differ = differ_N.sum() + (0 if self.differ is None else self.differ)
            self.compared = recorded_N.sum() + (0 if self.compared is None else self.compared)
        if active():  # numerics.batch_invariant: the weights the engine gave these ids
            w_NK, _ = batch_invariant_moe.route(logits_NE, router.top_k, router.norm_topk_prob, ids_NK_replay)
            return logits_NE, w_NK, ids_NK_replay
        probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float32)
        w_NK = probs_NE.gather(1, ids_NK_replay)
        if router.norm_topk_prob:
            w_NK = w_NK / w_NK.sum(dim=-1, keepdim=True)
        return logits_NE, w_NK.to(logits_NE.dtype), ids_NK_replay

    def aux_loss(self, num_experts: int, top_k: int) -> torch.Tensor:
        """transformers' ``load_balancing_loss_func`` over the kept logits of every MoE layer (no mask: a packed
        micro-batch has no padding)."""
        return load_balancing_loss([self.logits[i] for i in sorted(self.logits)], num_experts, top_k)


def replay_routing(routing: torch.Tensor | None) -> MoERouting | None:
    """A :class:`MoERouting` that replays ``routing`` ``[N, L_moe, K]`` (None: None, the router's own routing)."""
    return None if routing is None else MoERouting(replay=routing)


@dataclass(frozen=True)
class MoEShape:
    """What the memory plan (``fastgrpo.plan``) needs of a mixture-of-experts model: per MoE layer E experts of width
    I, top-K, a shared expert of width I_s (Qwen2-MoE; 0: none), and the counts below (c: bytes of the compute dtype,
    H: hidden size)."""

    experts: int
    top_k: int
    intermediate: int
    layers: int
    """MoE layers (the others are dense)."""
    norm_topk_prob: bool
    aux_loss_coef: float
    """The model config's router_aux_loss_coef."""
    shared_intermediate: int = 0
    """The shared expert's width I_s (Qwen2-MoE's shared_expert_intermediate_size; 0: no shared expert)."""

    def inactive_params(self, hidden: int) -> int:
        """Expert parameters a token does not use: ``(E − K) · 3·H·I`` per MoE layer (the shared expert and its gate
        are always active)."""
        return self.layers * (self.experts - self.top_k) * 3 * hidden * self.intermediate

    def saved_bytes_per_token(self, c: int, hidden: int) -> int:
        """What an MoE block's packed training forward saves for backward per token, in place of a dense MLP's
        ``4·c·I``: the router's fp32 softmax ``4·E``, its top-K ids (int64), with ``norm_topk_prob`` the fp32 top-K
        values and their sum, the routing weights (compute dtype and fp32), the experts' gate/up pre-activations
        ``2·c·K·I`` (``fastgrpo.kernels.moe``); a shared expert adds a dense MLP's ``4·c·I_s``, its output ``c·H``
        and its gate's sigmoid ``c`` (the product's two operands)."""
        K = self.top_k
        norm = 4 + 4 * K if self.norm_topk_prob else 0
        shared = c * (4 * self.shared_intermediate + hidden + 1) if self.shared_intermediate else 0
        return 4 * self.experts + norm + (8 + c + 4) * K + 2 * c * K * self.intermediate + shared

    def routing_bytes_per_token(self) -> int:
        """The kernel's routing kept for backward besides autograd's saved tensors: per (token, expert) pair its sort
        order (int64), token and position (int32)."""
        return 16 * self.top_k

    def transient_bytes_per_token(self, c: int, hidden: int) -> int:
        """The block's largest buffers of a pass, per token: the experts' ``[S, 2I]``, ``[S, I]`` and ``[S, H]`` with
        S = K·T, or the shared expert's gate, up and product ``3·c·I_s`` next to the experts' output ``c·H``."""
        return max(c * self.top_k * (3 * self.intermediate + hidden), c * (3 * self.shared_intermediate + hidden))

    def replay_bytes_per_token(self) -> int:
        """A token's router replay record: L_moe · K ids (``fastgrpo.engine.moe``: uint8 up to 255 experts)."""
        return self.layers * self.top_k * (1 if self.experts <= 255 else 2)


def moe_shape(model) -> MoEShape | None:
    """The :class:`MoEShape` of a causal LM (any device, meta included); None for a dense one."""
    blocks = moe_blocks(model) if is_moe(model) and model.config.model_type in MOE_MODEL_TYPES else []
    if not blocks:
        return None
    config = model.config
    return MoEShape(experts=config.num_experts, top_k=config.num_experts_per_tok,
                    intermediate=config.moe_intermediate_size, layers=len(blocks),
                    norm_topk_prob=bool(config.norm_topk_prob), aux_loss_coef=float(config.router_aux_loss_coef),
                    shared_intermediate=int(getattr(config, "shared_expert_intermediate_size", 0) or 0))
