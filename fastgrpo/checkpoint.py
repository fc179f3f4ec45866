"""Checkpoints: Hugging Face-format weights plus the trainer's state, written atomically, resumed in place.

Layout of ``run_dir/checkpoints/step_{step:08d}/``::

    config.json, generation_config.json   the model config (HF ``save_pretrained``)
    model.safetensors                     the full weights (sharded files + index for very large models)
    tokenizer.json, tokenizer_config.json …
    trainer_state.pt                      {"step", "world_size", "trainer_state", "optimizer", "scheduler",
                                          "masters"}; the optimizer state keyed by parameter name (see below)
    rng_rank{r}.pt                        python / numpy / torch CPU / CUDA RNG states of rank r
    state_rank{r}.pt                      the trainer's own state of rank r (``rank_state``; e.g. async GRPO's
                                          sequences in flight), when given
    COMPLETE                              marker, written last (JSON: step, world size, time)

so ``AutoModelForCausalLM.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)`` load it directly.

Atomicity: everything is written into ``checkpoints/.tmp-step_{step:08d}/``, fsynced, the marker written last,
then the directory is renamed (``os.replace``, atomic on POSIX). A crash at any point leaves the previous complete
checkpoint as ``latest_checkpoint``; stale temporary directories are removed by the next save.

Distributed: every rank must call ``save_checkpoint`` / ``load_checkpoint`` (FSDP2 gathers are collectives).
Rank 0 writes the model, tokenizer and ``trainer_state.pt``; each rank writes its own ``rng_rank{r}.pt``. Under
FSDP2 the model and optimizer state are gathered *full* on rank 0's CPU (``get_model_state_dict`` /
``get_optimizer_state_dict`` with ``full_state_dict=True, cpu_offload=True``) and scattered back on load with
``broadcast_from_rank0=True``. The optimizer state is always stored in that full, name-keyed form
(``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``, names from the user's module), so a
checkpoint resumes under any strategy (DDP ↔ FSDP2) and world size, at the cost of rank 0 holding the full state in
host memory while saving. The run directory must be on a file system every rank sees (one node).

Mixed precision (``fastgrpo.precision``): ``model.safetensors`` holds the compute dtype (``dtype``, bf16) that HF
loads, and ``"masters"`` the full fp32 master weights by parameter name (``MasterAdamW``'s, or the FSDP2 sharded
fp32 parameters gathered): a resume loads the masters, and the compute weights are rounded from them, so it
continues bit for bit. Without masters (fp32 training, or an HF bf16 model) ``"masters"`` is None and the weights
come from the safetensors.

LoRA (``model.lora``, :mod:`fastgrpo.models.lora`): instead of the full weights, PEFT's ``adapter_model.safetensors`` +
``adapter_config.json`` (the adapters in the compute dtype; ``PeftModel.from_pretrained(base, dir)`` loads them, and
``base_model_name_or_path`` names the base's directory); ``"masters"`` and the optimizer state hold the adapters'
alone. The frozen base is never written here (it is ``model.path``, or ``<run dir>/base`` for the tiny model).

Loading copies values into the existing parameters (``load_state_dict`` copies in place): the co-located
generation engine holds those very tensors, so no ``Parameter`` is ever replaced.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fastgrpo.distributed import (
    DistState,
    barrier,
    fqn_prefix,
    fsdp_root,
    full_state_dict,
    get_rank,
    get_world_size,
    unwrap_model,
)
from fastgrpo.models.lora import adapter_names, is_lora, read_adapter
from fastgrpo.models.saving import module_keys, save_model
from fastgrpo.precision import MasterAdamW

CHECKPOINT_DIR = "checkpoints"
MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.pt"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint at ``step``: ``step_00000042``."""
    return f"step_{step:08d}"


def _rank_world(state: DistState | None) -> tuple[int, int]:
    if state is not None:
        return state.rank, state.world_size
    return get_rank(), get_world_size()


def _check_plain(obj, where: str) -> None:
    """Raise ``ValueError`` unless ``obj`` reloads with ``torch.load(weights_only=True)``."""
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise ValueError(f"{where} has a key of type {type(k).__name__}; use str or int keys")
            _check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
        return
    raise ValueError(f"{where} is a {type(obj).__name__}; trainer_state holds only python numbers, strings, "
                     f"None, tensors, lists, tuples and dicts (convert numpy values with float()/int())")


def _rng_state() -> dict:
    np_state = np.random.get_state(legacy=False)
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"], "key": np_state["state"]["key"].tolist(),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": cuda,  # the current device's generator (each rank drives one GPU)
    }


def _set_rng_state(rng: dict) -> None:
    random.setstate(rng["python"])
    n = rng["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"], "has_gauss": n["has_gauss"], "gauss": n["gauss"],
                         "state": {"key": np.asarray(n["key"], dtype=np.uint32), "pos": n["pos"]}})
    torch.set_rng_state(rng["torch_cpu"])
    if rng["torch_cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["torch_cuda"])


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _param_names(optimizer: torch.optim.Optimizer, inner: nn.Module) -> list[list[str]]:
    """The parameter names (``inner.named_parameters()``) of every optimizer param group, in order."""
    names = {id(p): n for n, p in inner.named_parameters()}
    if isinstance(optimizer, MasterAdamW):  # it holds fp32 masters: name them after their module parameters
        names.update({id(m): names.get(id(p)) for m, p in zip(optimizer.masters, optimizer.model_params)})
    groups = []
    for g in optimizer.param_groups:
        missing = [tuple(p.shape) for p in g["params"] if names.get(id(p)) is None]
        if missing:
            raise ValueError(f"optimizer holds parameters that are not in model (shapes {missing[:3]})")
        groups.append([names[id(p)] for p in g["params"]])
    return groups


def _optimizer_to_named(optimizer: torch.optim.Optimizer, inner: nn.Module) -> dict:
    """``optimizer.state_dict()`` with parameter names instead of positions (the format of
    ``get_optimizer_state_dict(full_state_dict=True)``): resumable under any strategy and world size."""
    sd = optimizer.state_dict()
    flat = [n for group in _param_names(optimizer, inner) for n in group]
    return {"state": {flat[i]: s for i, s in sd["state"].items()},
            "param_groups": [{**g, "params": [flat[i] for i in g["params"]]} for g in sd["param_groups"]]}


def _named_to_optimizer(named: dict, optimizer: torch.optim.Optimizer, inner: nn.Module, path: Path) -> dict:
    """The inverse of ``_optimizer_to_named`` for ``optimizer``'s own param order (positions are per group)."""
    current = _param_names(optimizer, inner)
    saved = named["param_groups"]
    if len(saved) != len(current) or any(set(s["params"]) != set(c) for s, c in zip(saved, current)):
        raise ValueError(f"path {path}: the optimizer's parameter groups differ from the saved ones")
    state, groups, pos = {}, [], 0
    for s, names in zip(saved, current):
        ids = list(range(pos, pos + len(names)))
        for i, n in zip(ids, names):
            if n in named["state"]:
                state[i] = named["state"][n]
        groups.append({**s, "params": ids})
        pos += len(names)
    return {"state": state, "param_groups": groups}


def _prefixed(named: dict, prefix: str) -> dict:
    return {"state": {prefix + k: v for k, v in named["state"].items()},
            "param_groups": [{**g, "params": [prefix + n for n in g["params"]]} for g in named["param_groups"]]}


def _unprefixed(named: dict, prefix: str) -> dict:
    n = len(prefix)
    return {"state": {k[n:]: v for k, v in named["state"].items()},
            "param_groups": [{**g, "params": [p[n:] for p in g["params"]]} for g in named["param_groups"]]}


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    model: nn.Module,
    tokenizer=None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler=None,
    trainer_state: Mapping | None = None,
    keep_last: int | None = 3,
    state: DistState | None = None,
    dtype: torch.dtype | None = None,
    rank_state: Mapping | None = None,
) -> Path:
    """Write ``run_dir/checkpoints/step_{step:08d}/`` atomically and return its path (on every rank).

    ``trainer_state``: the trainer's own resumable state (step, data position, counters …) as python numbers,
    strings, tensors, lists and dicts; it comes back from ``load_checkpoint``. ``keep_last``: how many complete
    checkpoints to keep (older ones are deleted, never the one just written); ``None`` keeps all. A checkpoint
    already at this step is replaced. ``dtype``: the compute dtype the safetensors are written in (None: the
    parameters' own); FSDP2's fp32 sharded parameters behind a bf16 compute dtype, like ``MasterAdamW``'s masters,
    are also saved in fp32 as ``"masters"``. ``rank_state``: this rank's own resumable state (the same kinds of
    values as ``trainer_state``), written by each rank to ``state_rank{r}.pt``. Every rank must call this (FSDP2
    gathers are collectives).
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    trainer_state = dict(trainer_state or {})
    _check_plain(trainer_state, "trainer_state")
    if rank_state is not None:
        _check_plain(rank_state, "rank_state")
    rank, world = _rank_world(state)
    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    final = ckpt_dir / checkpoint_name(step)
    tmp = ckpt_dir / f"{_TMP_PREFIX}{final.name}"

    # Collectives first, on every rank: the full weights and optimizer state (FSDP2 gathers; else local views).
    inner, fsdp = unwrap_model(model), fsdp_root(model)
    model_sd = full_state_dict(model, state) if fsdp is not None else None
    optim_sd = None
    if optimizer is not None:
        if fsdp is not None and optimizer.state:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            optim_sd = get_optimizer_state_dict(fsdp, optimizer,
                                                options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            optim_sd = _unprefixed(optim_sd, fqn_prefix(fsdp, inner)) if rank == 0 else None
        elif rank == 0:  # not sharded, or no step taken yet (the DCP helper would take a fake one)
            optim_sd = _optimizer_to_named(optimizer, inner)
    masters = None  # fp32 values behind lower-precision compute weights: name -> full tensor on the CPU
    if rank == 0 and isinstance(optimizer, MasterAdamW):
        names = {id(p): n for n, p in inner.named_parameters()}
        masters = {names[id(p)]: m.detach().cpu() for p, m in zip(optimizer.model_params, optimizer.masters)}
    if rank == 0 and model_sd is not None and is_lora(inner):  # the adapters alone (the base is frozen, not saved)
        model_sd = {n: model_sd[n] for n in adapter_names(inner)}
    if masters is None and rank == 0 and model_sd is not None and dtype is not None:
        if any(v.is_floating_point() and v.dtype != dtype for v in model_sd.values()):
            masters = model_sd
            model_sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model_sd.items()}

    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.iterdir():  # leftovers of a crashed save
            if stale.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    barrier()  # the temporary directory exists before any rank writes into it
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank_state is not None:
        torch.save(dict(rank_state), tmp / f"state_rank{rank}.pt")
    if rank == 0:
        save_model(model, tmp, model_sd, dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        payload = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": world,
            "trainer_state": {**trainer_state, "step": step},
            "optimizer": optim_sd,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "masters": masters,
        }
        torch.save(payload, tmp / TRAINER_STATE)
    barrier()  # every rank's RNG (and state) file is on disk
    if rank == 0:
        _fsync_tree(tmp)
        marker = {"step": step, "world_size": world, "time": time.time()}
        with open(tmp / MARKER, "w") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # re-saving a step (a crash between the renames leaves the older checkpoints)
            trash = ckpt_dir / f"{_TRASH_PREFIX}{final.name}"
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        if keep_last is not None:
            _prune(ckpt_dir, keep_last, keep=final)
    barrier()  # the checkpoint is visible to every rank before anyone returns
    return final


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / MARKER).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _prune(root: Path, keep_last: int, keep: Path) -> None:
    complete = _complete_checkpoints(root)
    for _, path in complete[:-keep_last]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``run_dir/checkpoints``, oldest step first."""
    return [p for _, p in _complete_checkpoints(Path(run_dir) / CHECKPOINT_DIR)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step (temporary and unmarked directories ignored), or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    import safetensors.torch

    single = path / "model.safetensors"
    if single.is_file():
        return safetensors.torch.load_file(str(single), device="cpu")
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        raise ValueError(f"path {path} has no model.safetensors (nor a sharded index)")
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        sd.update(safetensors.torch.load_file(str(path / name), device="cpu"))
    return sd


def _read_weights(path: Path, inner: nn.Module) -> dict[str, torch.Tensor]:
    """The saved weights by ``inner``'s parameter names: the adapters' for a LoRA model, else the full model's."""
    return read_adapter(path, inner) if is_lora(inner) else module_keys(_read_safetensors(path), inner)


def _complete_tied(sd: dict[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
    """Add entries for tied parameters (one tensor, several names) that the file stores once."""
    by_param: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(name)
    for names in by_param.values():
        present = [n for n in names if n in sd]
        if present:
            for n in names:
                sd.setdefault(n, sd[present[0]])
    return sd


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler=None,
    state: DistState | None = None,
    restore_rng: bool = True,
) -> dict:
    """Load a checkpoint into the existing ``model`` (in place), ``optimizer`` and ``scheduler``; return the
    trainer state saved with it (it includes ``"step"``).

    The weights are copied into the current parameters (never replaced); the model may be wrapped (DDP, FSDP2,
    compiled) and must have the saved architecture (missing or unexpected weights raise ``ValueError``). With
    ``restore_rng`` each rank restores the RNG states it saved; a rank absent from the checkpoint (the world size
    changed) keeps its current RNG state, with a warning. The returned dict's ``"rank_state"`` is this rank's
    ``rank_state`` as saved, or None (none saved, or not for this rank). Every rank must call this.
    """
    path = Path(path)
    if not (path / MARKER).is_file():
        raise ValueError(f"path {path} is not a complete checkpoint (no {MARKER} marker)")
    rank, _ = _rank_world(state)
    inner, fsdp = unwrap_model(model), fsdp_root(model)
    # Under FSDP2 only rank 0 reads the optimizer tensors: the others map the file and never touch them.
    payload = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True,
                         mmap=fsdp is not None and rank != 0)
    saved_optim = payload["optimizer"]
    masters = payload.get("masters")  # fp32 masters when saved under mixed precision: they win over the safetensors
    if optimizer is not None and saved_optim is None:
        raise ValueError(f"path {path} holds no optimizer state (saved with optimizer=None)")

    if fsdp is not None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        prefix = fqn_prefix(fsdp, inner)
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        weights = masters if masters is not None else (_read_weights(path, inner) if rank == 0 else None)
        sd = {prefix + k: v for k, v in _complete_tied(dict(weights), inner).items()} if rank == 0 else {}
        set_model_state_dict(fsdp, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                strict=not is_lora(inner)))
        if optimizer is not None and saved_optim["state"]:
            osd = _prefixed(saved_optim, prefix) if rank == 0 else {}
            set_optimizer_state_dict(fsdp, optimizer, optim_state_dict=osd, options=opts)
        elif optimizer is not None:  # saved before any step: hyper-parameters only, no tensors to scatter
            optimizer.load_state_dict(_named_to_optimizer(saved_optim, optimizer, inner, path))
    else:
        sd = _complete_tied(dict(masters) if masters is not None else _read_weights(path, inner), inner)
        try:
            result = inner.load_state_dict(sd, strict=False)  # copies (rounded to the parameters' dtype) in place
        except RuntimeError as e:  # shape mismatches
            raise ValueError(f"path {path} does not match the model: {e}") from None
        missing = result.missing_keys
        if is_lora(inner):  # the frozen base is not in a LoRA checkpoint
            missing = sorted(set(missing) & set(adapter_names(inner)))
        if missing or result.unexpected_keys:
            raise ValueError(f"path {path} does not match the model: missing {missing[:5]}, "
                             f"unexpected {result.unexpected_keys[:5]}")
        if optimizer is not None:
            optimizer.load_state_dict(_named_to_optimizer(saved_optim, optimizer, inner, path))
        if isinstance(optimizer, MasterAdamW):  # the masters exactly (or, without any, the loaded weights upcast)
            names = {id(p): n for n, p in inner.named_parameters()}
            optimizer.load_masters(sd if masters is not None else None, names)
    if scheduler is not None:
        if payload["scheduler"] is None:
            raise ValueError(f"path {path} holds no scheduler state (saved with scheduler=None)")
        scheduler.load_state_dict(payload["scheduler"])
    if restore_rng:
        rng_file = path / f"rng_rank{rank}.pt"
        if rng_file.is_file():
            _set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True))
        else:
            warnings.warn(f"{rng_file.name} not in {path} (saved with world size {payload['world_size']}): "
                          f"rank {rank} keeps its current RNG state", stacklevel=2)
    own = path / f"state_rank{rank}.pt"
    rank_state = torch.load(own, map_location="cpu", weights_only=True) if own.is_file() else None
    barrier()
    return {**payload["trainer_state"], "rank_state": rank_state}
