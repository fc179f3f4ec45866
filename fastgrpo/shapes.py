"""The shapes the memory plan (``fastgrpo.plan``) is built from: a model's counts and dimensions read from a
meta-device instance (``ModelShape``: dense, mixture-of-experts, or a VLM with its vision tower), and the bytes per
token its training saves (activations, the loss workspace, LoRA). The formulas are stated in ``fastgrpo.plan``'s
module docstring.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from fastgrpo.config import Config, ModelConfig
from fastgrpo.kernels.linear_logprobs import FWD_CONFIGS, TORCH_CHUNK_N, TORCH_CHUNK_V
from fastgrpo.kernels.utils import DEFAULT_NUM_SMS
from fastgrpo.kernels.vocab_tiles import PROGRAMS_PER_SM
from fastgrpo.models.moe import MoEShape, moe_shape
from fastgrpo.models.vlm import TINY_VLM, VLM_MODEL_TYPES, add_vision_tokens, build_tiny_vlm, text_config, tower_dims

PER_TOKEN_LOSS_BYTES = 48  # fp32 per-token vectors of the loss: log-probs, LSE, entropy, old log-probs, mask, ...
# the fused loss's forward tile (tokens, vocabulary) in bf16 / fp16, its largest: it sets the vocabulary splits
TRITON_LOSS_TILE = FWD_CONFIGS[2][0][:2]
SPLIT_PROGRAMS = PROGRAMS_PER_SM * DEFAULT_NUM_SMS  # the forward's target program count on an H100 / H200


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: counts and dimensions (read from a meta-device instance)."""

    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    qk_norm: bool
    layer_params: int
    """Parameters of one decoder layer (their mean when layers differ: an MoE model's dense layers)."""
    moe: MoEShape | None = None
    """A mixture-of-experts model's experts (None: dense)."""
    vision: ModelShape | None = None
    """A VLM's vision tower (``fastgrpo.models.vlm.tower_dims``: blocks as layers, patches as tokens), else None."""
    tied: bool = False
    """The LM head is the input embedding (``tie_word_embeddings``)."""
    patch: int = 0  # a vision tower's patch side (px), patches merged per side, and pixel values per patch
    merge: int = 1
    patch_values: int = 0

    @property
    def active_params(self) -> int:
        """Parameters one token's forward reads: all but the experts its router does not choose."""
        return self.params - (self.moe.inactive_params(self.hidden) if self.moe else 0)

    def frozen_bytes(self, c: int, nproc: int, fsdp: bool) -> int:
        """A frozen copy in the compute dtype per GPU: whole, or (fsdp2) its shard, its root and two layers."""
        root = self.params - self.layers * self.layer_params
        return c * (self.params // nproc + root + 2 * self.layer_params) if fsdp else c * self.params

    def forward_bytes(self, c: int, tokens: int) -> int:
        """One packed no-grad forward over ``tokens`` tokens: one layer's working set and the final hidden state."""
        qk = (self.heads + 2 * self.kv_heads) * self.head_dim
        return tokens * c * (3 * self.hidden + qk + 3 * self.intermediate) + c * tokens * self.hidden


def model_shape(cfg: Config) -> ModelShape:
    """Build ``cfg.model`` on the meta device (no weights) and read its shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastgrpo.models.loading import build_tiny_model, build_tiny_tokenizer

    with torch.device("meta"):
        if cfg.model.path == "tiny":
            return shape_of(build_tiny_model(cfg.model, build_tiny_tokenizer()))
        if cfg.model.path == TINY_VLM:
            return shape_of(build_tiny_vlm(cfg.model, add_vision_tokens(build_tiny_tokenizer())))
        hf = AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        if hf.model_type in VLM_MODEL_TYPES:  # the vision tower's weights count; the text model's shape is read
            from transformers import AutoModelForImageTextToText

            return shape_of(AutoModelForImageTextToText.from_config(hf))
        return shape_of(AutoModelForCausalLM.from_config(hf, trust_remote_code=cfg.model.trust_remote_code))


def teacher_shape(cfg: Config) -> ModelShape:
    """The distillation teacher's :class:`ModelShape`: ``distill.teacher_path``'s model when it exists, else the
    model of ``distill.teacher_recipe`` (which would train it there)."""
    from fastgrpo.algorithms.distill import teacher_dir, teacher_recipe_config

    d = cfg.distill
    path = teacher_dir(d.teacher_path)
    if path is not None:
        model = ModelConfig(path=str(path), dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    elif d.teacher_recipe:
        model = teacher_recipe_config(d.teacher_recipe).model
    else:
        raise ValueError(f"distill.teacher_path {d.teacher_path!r} holds no model (config.json) to plan for")
    return model_shape(dataclasses.replace(cfg, model=model))


def judge_shapes(cfg: Config) -> list[ModelShape]:
    """The :class:`ModelShape` of each of ``reward.judges`` (causal LMs, from their config.json)."""
    return [model_shape(dataclasses.replace(cfg, model=ModelConfig(
        path=j.path, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code))) for j in cfg.reward.judges]


def reward_model_shapes(cfg: Config) -> list[ModelShape]:
    """The :class:`ModelShape` of each of ``reward.models`` (built on the meta device from its config.json)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from fastgrpo.algorithms.reward_models import reward_model_dir

    out = []
    for spec in cfg.reward.models:
        hf = AutoConfig.from_pretrained(reward_model_dir(spec.path), trust_remote_code=cfg.model.trust_remote_code)
        with torch.device("meta"):
            out.append(shape_of(AutoModelForSequenceClassification.from_config(
                hf, trust_remote_code=cfg.model.trust_remote_code)))
    return out


def shape_of(model) -> ModelShape:
    """The :class:`ModelShape` of a Hugging Face causal LM, sequence classifier or VLM (any device, meta included)."""
    c = text_config(model)  # a VLM's language model
    layer = model.get_decoder().layers[0]
    heads = c.num_attention_heads
    dims = tower_dims(model)
    head = model.get_output_embeddings()
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()), layers=c.num_hidden_layers, hidden=c.hidden_size,
        heads=heads, kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, intermediate=c.intermediate_size,
        vocab=c.vocab_size, qk_norm=hasattr(layer.self_attn, "q_norm"),
        layer_params=sum(p.numel() for p in model.get_decoder().layers.parameters()) // c.num_hidden_layers,
        moe=moe_shape(model), vision=dims and ModelShape(**dims),
        tied=head is not None and head.weight is model.get_input_embeddings().weight)


def vision_pass_bytes(s: ModelShape, c: int, tokens: int) -> int:
    """One no-grad pass of ``s``'s vision tower over the patches of ``tokens`` image tokens: their pixel values
    (fp32), one block's working set and last hidden state (:meth:`ModelShape.forward_bytes` over the patches), the
    merged embeddings ``c·tokens·h``."""
    patches = s.vision.merge**2 * tokens
    return 4 * s.vision.patch_values * patches + s.vision.forward_bytes(c, patches) + c * tokens * s.hidden


def lora_dims(s: ModelShape, intermediate: int | None = None) -> dict[str, tuple[int, int]]:
    """``(in, out)`` features of each projection LoRA may target (``model.lora.target_modules``); the MLP's of width
    ``intermediate`` (None: the dense MLP's)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    i = s.intermediate if intermediate is None else intermediate
    return {"q_proj": (s.hidden, q), "k_proj": (s.hidden, kv), "v_proj": (s.hidden, kv), "o_proj": (q, s.hidden),
            "gate_proj": (s.hidden, i), "up_proj": (s.hidden, i), "down_proj": (i, s.hidden)}


def lora_params(s: ModelShape, cfg: Config) -> int:
    """Adapter parameters of ``model.lora`` (0 without it): ``r · (in + out)`` per targeted projection and layer. In
    an MoE model the MLP targets adapt the dense layers' MLPs and the MoE layers' shared experts (width I_s; none
    without one: the experts are never targets, ``fastgrpo.models.moe.check_moe``)."""
    lora = cfg.model.lora
    if lora is None:
        return 0
    dims = lora_dims(s)
    unknown = [t for t in lora.target_modules if t not in dims]
    if unknown:
        raise ValueError(f"model.lora.target_modules: the plan knows {sorted(dims)}, not {unknown}")
    moe_layers, width = (s.moe.layers, s.moe.shared_intermediate) if s.moe else (0, 0)
    shared = lora_dims(s, width)

    def per_target(t: str) -> int:  # in + out features, summed over the layers that hold projection t
        if t not in ("gate_proj", "up_proj", "down_proj"):
            return s.layers * sum(dims[t])
        return (s.layers - moe_layers) * sum(dims[t]) + (moe_layers * sum(shared[t]) if width else 0)

    return lora.r * sum(per_target(t) for t in lora.target_modules)


def layer_saved_bytes_per_token(s: ModelShape, c: int, moe_layer: bool = False) -> int:
    """``A``: bytes one decoder layer's packed forward saves for backward, per token (module docstring); an MoE
    layer's block saves ``MoEShape.saved_bytes_per_token`` in place of the dense MLP's ``4·c·I``."""
    qk = (s.heads + s.kv_heads) * s.head_dim
    qk_norm = (4 + c) * qk + 4 * (s.heads + s.kv_heads) if s.qk_norm else 0
    mlp = s.moe.saved_bytes_per_token(c, s.hidden) if moe_layer else 4 * c * s.intermediate
    return 2 * (4 * s.hidden + 4 + 2 * c * s.hidden) + qk_norm + c * 2 * qk + 4 * s.heads + mlp


def activation_bytes(s: ModelShape, c: int, tokens: int, checkpointing: bool, lora_per_layer: int = 0,
                     router_logits: bool = False) -> int:
    """Activations of one micro-batch of ``tokens`` tokens, at the start of its backward (module docstring);
    ``lora_per_layer``: LoRA's change of a layer's bytes per token (module docstring). An MoE model's MoE layers
    keep their block's bytes and the kernel's routing (``MoEShape``), and ``router_logits`` (the load-balancing
    loss) each MoE layer's ``[T, E]`` router logits until the loss."""
    m = s.moe
    per_layer = layer_saved_bytes_per_token(s, c) + lora_per_layer
    per_moe = 0 if m is None else layer_saved_bytes_per_token(s, c, True) + lora_per_layer + m.routing_bytes_per_token()
    moe_layers = 0 if m is None else m.layers
    once = 4 * s.hidden + 4 + 2 * c * s.hidden + 2 * c * s.head_dim + PER_TOKEN_LOSS_BYTES
    once += c * m.experts * m.layers if m is not None and router_logits else 0
    transient = max(c * (2 * s.intermediate + 2 * s.hidden), m.transient_bytes_per_token(c, s.hidden) if m else 0)
    layers = (s.layers - moe_layers) * per_layer + moe_layers * per_moe
    kept = s.layers * c * s.hidden + max(per_layer, per_moe) if checkpointing else layers
    return tokens * (kept + once + transient)


def loss_workspace_bytes(s: ModelShape, c: int, tokens: int, kernel: bool, frozen_head: bool = False) -> int:
    """The fused loss's backward workspace (``kernel``: the Triton path; else the chunked torch path);
    ``frozen_head`` (LoRA): no ``[V, H]`` gradient accumulator nor its cast."""
    V, H = s.vocab, s.hidden
    head = 0 if frozen_head else V
    out = 4 * head * H + 4 * tokens * H + c * tokens * H + (c * (head + tokens) * H if c < 4 else 0)
    if kernel:
        block_n, block_v = TRITON_LOSS_TILE
        n_tiles = math.ceil(tokens / block_n)
        splits = min(math.ceil(V / block_v), max(1, math.ceil(SPLIT_PROGRAMS / n_tiles)))
        return out + 16 * splits * tokens
    rows, cols = min(tokens, TORCH_CHUNK_N), min(V, TORCH_CHUNK_V)
    return out + 4 * (2 * rows * cols + rows * H)  # two reused chunk buffers and the fp32 chunk of h
