"""Writing a model's weights in Hugging Face format: ``save_pretrained`` for an HF model, PEFT's adapter files for a
LoRA model, ``model.safetensors`` alone for a plain module. Used by checkpoints (:mod:`fastgrpo.checkpoint`) and by
the tiny model's LoRA base (:func:`fastgrpo.models.loading.load_model`).

``save_pretrained`` writes some models' weights under their original checkpoints' names, which are not the modules'
(Qwen2.5-VL: ``model.visual.*`` as ``visual.*``, ``model.language_model.*`` as ``model.*``), so that vLLM and older
transformers read the files; :func:`module_keys` maps such names back when a checkpoint is resumed."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fastgrpo.distributed import unwrap_model
from fastgrpo.models.lora import is_lora, save_adapter


def save_model(model: nn.Module, out: Path, sd: dict | None, dtype: torch.dtype | None = None) -> None:
    """HF ``save_pretrained`` (safetensors); a plain module gets ``model.safetensors`` alone. ``dtype``: the
    weights' dtype for ``config.json`` (HF reads the dtype of the parameters, fp32 shards under FSDP2)."""
    inner = unwrap_model(model)
    if is_lora(inner):
        save_adapter(inner, out, sd, dtype)
        return
    if hasattr(inner, "save_pretrained"):
        from transformers.utils import logging as hf_logging

        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a "Writing model shards" bar at every checkpoint is noise in run logs
        try:
            inner.save_pretrained(out, state_dict=sd)
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        if dtype is not None and hasattr(inner, "config"):
            inner.config.dtype = str(dtype).removeprefix("torch.")
            inner.config.to_json_file(out / "config.json")
        return
    import safetensors.torch

    sd = dict(sd if sd is not None else inner.state_dict())
    seen: set[tuple] = set()
    for k in list(sd):  # tied weights: one name per tensor (load_checkpoint restores the aliases)
        t = sd[k]
        key = (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if key in seen:
            del sd[k]
        seen.add(key)
    # safetensors refuses tensors that share memory: copies (a plain module is small; HF models take the path above)
    safetensors.torch.save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()},
                                str(out / "model.safetensors"), metadata={"format": "pt"})


def module_keys(sd: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``sd`` (weights as ``save_pretrained`` wrote them) keyed by ``model``'s own parameter names: transformers'
    renaming on save (``revert_weight_conversion``) applied to the model's state dict gives each file name's
    parameter. Renamings only: a key no parameter renames to stays as it is (a merging converter's, or a plain
    module's)."""
    inner = unwrap_model(model)
    if not hasattr(inner, "save_pretrained"):
        return sd
    from transformers.core_model_loading import revert_weight_conversion

    own = inner.state_dict()
    name_of = {id(t): n for n, t in own.items()}
    renamed = {k: name_of[id(t)] for k, t in revert_weight_conversion(inner, dict(own)).items() if id(t) in name_of}
    return {renamed.get(k, k): v for k, v in sd.items()}


def converted_weights(path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights ``save_pretrained`` wrote to ``path`` as ``model``'s own parameters, through transformers'
    loading conversion (merges such as a mixture-of-experts model's per-expert tensors into the fused ones): a model
    of ``unwrap_model(model)``'s class loaded from ``path`` on the CPU, its state dict."""
    inner = unwrap_model(model)
    loaded = type(inner).from_pretrained(str(path), dtype="auto", device_map="cpu")
    return loaded.state_dict()
