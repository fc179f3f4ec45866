"""Write a full Hugging Face model with a LoRA checkpoint's adapters merged in::

    python -m fastgrpo.export_merged runs/lora-tiny-.../checkpoints/step_00000150 merged/
    python -m fastgrpo.export_merged CKPT OUT --dtype float32

``CKPT``: a PEFT adapter directory (a fastgrpo LoRA checkpoint, or any ``adapter_config.json`` +
``adapter_model.safetensors`` whose ``base_model_name_or_path`` is a local directory). Every targeted weight
becomes ``W' = round(W + s · B A)``: base and adapters read exactly (upcast to fp32), the product and the sum in
fp32, rounded once to ``--dtype`` (default: the base's own dtype from its ``config.json``). Nothing is merged into a
low-precision tensor step by step (PEFT's ``merge_and_unload`` on a bf16 model adds a bf16 delta to bf16 weights,
two roundings). ``OUT`` gets ``config.json``, ``model.safetensors`` and the checkpoint's tokenizer:
``AutoModelForCausalLM.from_pretrained(OUT)`` loads it. Memory: the base in fp32 (4 bytes a parameter) plus the
output dtype's copy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fastgrpo.models.loading import DTYPES


def export_merged(checkpoint: str, out: str, dtype: str | None = None) -> Path:
    """Merge ``checkpoint``'s adapters into its base (module docstring) and save the full model in ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastgrpo.config import ModelConfig
    from fastgrpo.models.loading import load_model
    from fastgrpo.models.lora import adapter_base, is_adapter_dir, merged_state_dict

    if not is_adapter_dir(checkpoint):
        raise ValueError(f"CKPT {checkpoint!r} is not a PEFT adapter directory (no adapter_config.json, or a full "
                         "model)")
    base_path = adapter_base(checkpoint)
    if dtype is None:
        saved = json.loads((Path(base_path) / "config.json").read_text())
        dtype = saved.get("dtype") or saved.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    model, _ = load_model(ModelConfig(path=checkpoint, dtype="float32"), torch.device("cpu"))
    merged = merged_state_dict(model, DTYPES[dtype])
    del model
    full = AutoModelForCausalLM.from_pretrained(base_path, dtype=DTYPES[dtype])
    result = full.load_state_dict(merged, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"CKPT {checkpoint}: the merged weights do not match the base (missing "
                         f"{result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]})")
    out_dir = Path(out)
    full.save_pretrained(out_dir)
    tok_dir = checkpoint if (Path(checkpoint) / "tokenizer_config.json").is_file() else base_path
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="merge a LoRA checkpoint into its base: a full HF model")
    parser.add_argument("checkpoint", help="PEFT adapter directory (a fastgrpo LoRA checkpoint)")
    parser.add_argument("out", help="output directory of the merged model")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the base's dtype)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    print(f"merged model: {export_merged(args.checkpoint, args.out, args.dtype)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
