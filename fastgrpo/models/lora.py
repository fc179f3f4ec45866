"""LoRA on the co-located engine: PEFT's adapters on a frozen base, read unmerged by generation and training alike.

A targeted linear module ``y = x Wᵀ + b`` becomes PEFT's ``lora.Linear``::

    y = x Wᵀ + b + s · (x Aᵀ) Bᵀ        A [r, in], B [out, r], s = alpha / r (rsLoRA: alpha / sqrt(r))

with ``B = 0`` at the start (the policy is the base). The base ``W``, ``b`` stay frozen in the compute dtype
(``model.dtype``), bit for bit what was loaded: nothing is ever merged into them. The adapters are in the compute
dtype too (PEFT's ``autocast_adapter_dtype`` off), so they go through the same mixed-precision path as a full
fine-tune's weights (:class:`fastgrpo.precision.MasterAdamW`: fp32 masters and AdamW state, of the adapters only).

- **Generation** (``fastgrpo.engine.forward``) computes ``x Wᵀ + b`` and then ``x Aᵀ`` then ``· Bᵀ`` per targeted
  projection over the running rows (:func:`lora_terms`: the modules' live adapters, read at the start of every
  ``generate`` call; inside one, and so inside its CUDA graphs, they do not change). Extra cost per token:
  ``2 · r · (in + out)`` flops per projection, ``2 · p`` in all: r = 64 on the seven projections of Qwen2.5-7B is
  0.32 GFLOP against the base's 15 (2%), and the adapters' weights are read once per step (323 MB in bf16).
- **The reference** (β > 0, DPO) is the same model with its adapters disabled (:func:`adapters_disabled`): no
  second model in memory.
- **Dropout** (``model.lora.dropout``, default 0) acts in training forwards only: generation and the no-grad
  forwards run in eval mode. With dropout on, the training forward is not the sampler's distribution and the
  on-policy ratio is not 1.
- **Refused** at start-up (the unmerged path computes exactly the vanilla update above): DoRA, ``bias`` other than
  "none", ``lora_bias``, ``modules_to_save``, trainable tokens, and the LM head or the embeddings as targets (the
  fused losses read the head's weight directly). rsLoRA is supported (it only changes ``s``).
- **Vision-language models** (``fastgrpo.models.vlm``): the targets are the language model's projections only; the
  vision tower (whose MLPs are named ``gate_proj`` / ``up_proj`` / ``down_proj`` too) is excluded
  (:func:`vision_exclusion`) and stays frozen, and an adapter file that adapts it is refused.

Memory (P base parameters, c bytes of the compute dtype, p adapter parameters): ``c · P`` for the base (no master,
no AdamW state, no gradient) and ``(c + 4 + 8 + 4) · p`` for the adapters (weight, master, AdamW m and v, fp32
gradient); r = 64 on all seven projections of Qwen2.5-7B is p = 161M.

Files: a checkpoint holds PEFT's ``adapter_model.safetensors`` + ``adapter_config.json`` (``PeftModel.from_pretrained``
loads them; ``base_model_name_or_path`` is a directory with the base: ``model.path``, or for the built-in tiny model
``<run dir>/base``, written once); ``python -m fastgrpo.export_merged`` writes a merged full model.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from fastgrpo.config import LORA_REFUSED_TARGETS, LoRAConfig
from fastgrpo.models.vlm import tower_prefix

ADAPTER = "default"  # PEFT's adapter name: the only adapter fastgrpo makes
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PeftModel's name of the wrapped model in its state dict (and in the files)
BASE_DIR = "base"  # <run dir>/base: the built-in tiny model's base, saved once for base_model_name_or_path


def peft_lora_config(cfg: LoRAConfig, exclude: str | None = None):
    """The ``peft.LoraConfig`` of ``model.lora`` (task CAUSAL_LM, bias none, vanilla LoRA); ``exclude``: PEFT's
    ``exclude_modules`` regex (a VLM's vision tower: :func:`vision_exclusion`)."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
                      use_rslora=cfg.use_rslora, bias="none", task_type="CAUSAL_LM", exclude_modules=exclude)


def vision_exclusion(model: nn.Module) -> str | None:
    """For a vision-language model, a regex (PEFT's ``exclude_modules``, matched in full against module names) for
    every module of its vision tower, so that LoRA adapts the language model's projections only: the default targets
    ``gate_proj`` / ``up_proj`` / ``down_proj`` name the tower's MLPs too (Qwen2.5-VL: ``model.visual.blocks.*.mlp``),
    and the engine reads adapters of the language model alone. None for a causal LM."""
    prefix = tower_prefix(model)
    return None if prefix is None else re.escape(prefix) + r"(\..*)?"


def check_peft_config(pc, where: str) -> None:
    """Refuse (``ValueError`` naming the field) what the unmerged engine does not compute (module docstring)."""
    if type(pc).__name__ != "LoraConfig":
        raise ValueError(f"{where}: a {type(pc).__name__} adapter, only LoRA is supported")
    refusals = [
        ("use_dora", bool(getattr(pc, "use_dora", False)), "DoRA"),
        ("bias", getattr(pc, "bias", "none") != "none", "bias other than 'none'"),
        ("lora_bias", bool(getattr(pc, "lora_bias", False)), "a bias on B"),
        ("modules_to_save", bool(getattr(pc, "modules_to_save", None)), "modules_to_save (full copies)"),
        ("trainable_token_indices", bool(getattr(pc, "trainable_token_indices", None)), "trainable tokens"),
    ]
    for name, bad, what in refusals:
        if bad:
            raise ValueError(f"{where}.{name}={getattr(pc, name)!r}: {what} is not supported (the engine reads base "
                             f"+ vanilla LoRA unmerged)")
    targets = pc.target_modules
    names = [targets] if isinstance(targets, str) else list(targets or [])
    refused = [t for t in names if any(r in t for r in LORA_REFUSED_TARGETS)]
    if refused:
        raise ValueError(f"{where}.target_modules={names!r}: the LM head and the embeddings cannot be targets (the "
                         f"fused losses read the head's weight directly)")


def apply_lora(model: nn.Module, cfg: LoRAConfig, base_path: str) -> nn.Module:
    """Inject ``model.lora``'s adapters (fresh, or ``cfg.path``'s) into ``model`` in place and freeze the base;
    returns ``model`` itself (a Hugging Face causal LM whose targeted projections are PEFT ``lora.Linear``s)."""
    try:
        from peft import PeftModel, get_peft_model
    except ImportError:
        raise ValueError("model.lora needs peft >= 0.17: pip install -e '.[lora]'") from None

    if cfg.path:
        from peft import PeftConfig

        check_peft_config(PeftConfig.from_pretrained(cfg.path), f"model.lora.path {cfg.path}: {ADAPTER_CONFIG}")
        peft = PeftModel.from_pretrained(model, cfg.path, adapter_name=ADAPTER, is_trainable=True,
                                         autocast_adapter_dtype=False)
    else:
        pc = peft_lora_config(cfg, vision_exclusion(model))
        check_peft_config(pc, "model.lora")
        peft = get_peft_model(model, pc, adapter_name=ADAPTER, autocast_adapter_dtype=False)
    peft.peft_config[ADAPTER].base_model_name_or_path = base_path  # what the saved adapter_config.json names
    inner = peft.get_base_model()  # the model itself, its projections replaced; it keeps .peft_config
    for name, p in inner.named_parameters():
        p.requires_grad_(f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name)
    check_modules(inner)
    return inner


def is_lora(model: nn.Module) -> bool:
    """True when ``model`` (unwrapped) carries PEFT adapters."""
    return isinstance(getattr(model, "peft_config", None), dict)


def unwrap_peft(model: nn.Module) -> nn.Module:
    """A ``PeftModel``'s wrapped model (the same modules); any other model unchanged."""
    peft = sys.modules.get("peft")  # peft not imported: no PeftModel exists
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model


def _lora_layers(model: nn.Module):
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def check_modules(model: nn.Module) -> None:
    """Refuse adapters the unmerged engine does not compute: anything but vanilla LoRA on ``nn.Linear``, a LoRA
    layer on the LM head or the embedding, a bias on B, a LoRA layer in a VLM's vision tower."""
    if "peft" not in sys.modules:
        return
    tower = tower_prefix(unwrap_peft(model))
    for name, m in _lora_layers(model):
        if tower is not None and f".{tower}." in f".{name}":
            raise ValueError(f"model: the LoRA layer {name} adapts the vision tower ({tower}): LoRA adapts the "
                             "language model's projections only")
        if any(name.split(".")[-1] == r for r in LORA_REFUSED_TARGETS):
            raise ValueError(f"model: the LoRA layer {name} adapts the LM head or the embedding: not supported")
        if not isinstance(m.get_base_layer(), nn.Linear):
            hint = (" (PEFT adapts a mixture-of-experts model's fused experts for the names gate_proj / up_proj / "
                    "down_proj, whatever exclude_modules says: set model.lora.target_modules=[q_proj,k_proj,v_proj,"
                    "o_proj])" if name.endswith("mlp.experts") else "")
            raise ValueError(f"model: the LoRA layer {name} adapts a {type(m.get_base_layer()).__name__}: only "
                             f"nn.Linear projections are supported{hint}")
        if getattr(m, "lora_variant", None):
            raise ValueError(f"model: the LoRA layer {name} is a variant ({sorted(m.lora_variant)}: DoRA, ...): "
                             "not supported")
        if any(getattr(m, "lora_bias", {}).values()):
            raise ValueError(f"model: the LoRA layer {name} has a bias on B (lora_bias): not supported")


def lora_terms(module: nn.Module) -> tuple:
    """The live adapters of a projection: ``((A [r, in], B [out, r], s), ...)`` for each active, unmerged adapter;
    ``()`` for a plain ``nn.Linear``, a merged adapter (the base weight holds it) or disabled adapters."""
    lora_A = getattr(module, "lora_A", None)
    if lora_A is None or module.disable_adapters or module.merged:
        return ()
    return tuple((lora_A[a].weight, module.lora_B[a].weight, module.scaling[a]) for a in module.active_adapters
                 if a in lora_A)


@contextmanager
def adapters_disabled(model: nn.Module):
    """The base model for the block: every LoRA layer of ``model`` (unwrapped or not) computes ``x Wᵀ + b`` alone.
    The reference of β > 0 and of DPO without a second model in memory."""
    layers = [m for _, m in _lora_layers(model)]
    was = [m.disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True  # PEFT's enable_adapters(False) also flips requires_grad: keep it as it is
    try:
        yield
    finally:
        for m, w in zip(layers, was):
            m._disable_adapters = w


def adapter_names(model: nn.Module) -> list[str]:
    """The adapters' parameter names in ``model`` (its trainable parameters)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def to_file_key(name: str) -> str:
    """Module parameter name → PEFT's file key (``model.layers.0.self_attn.q_proj.lora_A.default.weight`` →
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def save_adapter(model: nn.Module, out: Path, sd: dict[str, torch.Tensor] | None, dtype: torch.dtype | None) -> None:
    """``adapter_model.safetensors`` (the adapters in ``dtype``, PEFT's keys) and ``adapter_config.json``.
    ``sd``: the full state dict (FSDP2's gathered one) or None (the module's own)."""
    import safetensors.torch

    sd = sd if sd is not None else dict(model.named_parameters())
    tensors = {}
    for n in adapter_names(model):
        t = sd[n].detach()
        tensors[to_file_key(n)] = t.to("cpu", dtype=dtype or t.dtype, copy=True).contiguous()
    safetensors.torch.save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = copy.copy(model.peft_config[ADAPTER])
    config.inference_mode = True  # as PeftModel.save_pretrained writes it
    config.save_pretrained(str(out))


def read_adapter(path: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """``path``'s adapter weights keyed by ``model``'s parameter names."""
    import safetensors.torch

    saved = safetensors.torch.load_file(str(Path(path) / ADAPTER_WEIGHTS), device="cpu")
    names = {to_file_key(n): n for n in adapter_names(model)}
    if set(saved) != set(names):
        raise ValueError(f"path {path}: its adapters {sorted(set(saved) - set(names))[:3]} / the model's "
                         f"{sorted(set(names) - set(saved))[:3]} do not match")
    return {names[k]: v for k, v in saved.items()}


def is_adapter_dir(path: str) -> bool:
    """A PEFT adapter directory (``adapter_config.json``, no ``config.json`` of a full model)."""
    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").is_file()


def adapter_base(path: str) -> str:
    """The base model directory an adapter names (``base_model_name_or_path``)."""
    base = json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise ValueError(f"model.path {path}: an adapter whose base_model_name_or_path {base!r} is not a directory")
    return base


@torch.no_grad()
def merged_state_dict(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base's state dict (its own names) with every adapter merged: ``W' = round(W + s · B A)`` computed in
    fp32 and rounded once to ``dtype``."""
    sd = {}
    layers = dict(_lora_layers(model))
    for name, t in model.state_dict().items():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        if owner and owner in layers and leaf == "weight":
            w = t.float()
            for A, B, s in lora_terms(layers[owner]):
                w = w + s * (B.float() @ A.float())
            t = w
        sd[name.replace(".base_layer.", ".")] = t.to(dtype) if t.is_floating_point() else t
    return sd


