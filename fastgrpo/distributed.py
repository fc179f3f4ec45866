"""torch.distributed plumbing for ``torchrun``: process-group start-up, model wrapping, collectives.

fastgrpo scales out with torchrun only. One process (plain ``python fastgrpo/train.py``) needs no process group
and every function here is then a no-op or the identity, so the trainer calls them unconditionally::

    state = init_distributed()                       # reads RANK / LOCAL_RANK / WORLD_SIZE set by torchrun
    model = wrap_model(model, state, "ddp", forward=packed_forward)   # DDP (gloo / nccl) or FSDP2 ("fsdp2")
    for i, mb in enumerate(microbatches):
        with gradient_sync(model, enabled=i == len(microbatches) - 1):  # one all-reduce per step
            loss_fn(model(mb)).backward()
    metrics = reduce_metrics(local_metrics)          # one collective for the whole dict
    print0(f"step {step}: reward {metrics['reward/mean']:.3f}")
    destroy()

Launch::

    torchrun --standalone --nproc_per_node 2 fastgrpo/train.py     # 2 processes (CPU: gloo, GPU: nccl)

Training computation must go through the wrapped model's call (DDP arms its all-reduce and FSDP2 gathers the root's
weights there): give a custom training forward as ``wrap_model(..., forward=fn)`` rather than calling submodules
of the inner model.

Parameter sharing with the co-located generation engine: DDP keeps the module's ``Parameter`` objects (it copies
rank 0's values into them at construction), so an engine built on ``unwrap_model(model)`` sees every optimizer
update. FSDP2 (``fully_shard``) replaces each parameter by a sharded ``DTensor`` parameter; the engine must be built
after wrapping and read full weights inside ``unshard()`` / ``reshard()`` of the FSDP modules. With a bf16 model the
sharded parameters are fp32 masters and ``unshard()`` gathers bf16 copies: the engine reads those, the same tensors
a training forward would use (:mod:`fastgrpo.precision`).

Mixed precision (``model.dtype`` bf16) under DDP or one process: the module keeps bf16 parameters and the optimizer
(:class:`fastgrpo.precision.MasterAdamW`) fp32 masters; gradients are then all-reduced in fp32 by the optimizer, not
by DDP (micro-batches run under ``no_sync``): see :func:`fastgrpo.precision.accumulate`.

Host↔device synchronisations are marked ``# sync:`` with the reason.
"""

from __future__ import annotations

import builtins
import gc
import os
import zlib
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STRATEGIES = ("ddp", "fsdp2", "none")
REDUCE_OPS = ("sum", "mean", "max", "min")
# Metric-name suffixes that choose their own reduction in ``reduce_metrics`` (a per-rank max stays a max).
SUFFIX_OPS = {"/max": "max", "/min": "min", "/sum": "sum"}


@dataclass
class DistState:
    """Where this process sits in the torchrun job."""

    rank: int
    """Global rank, 0 … world_size-1 (``RANK``)."""
    local_rank: int
    """Rank on this node (``LOCAL_RANK``): picks the GPU, ``cuda:{local_rank}``."""
    world_size: int
    """Number of processes (``WORLD_SIZE``)."""
    device: torch.device
    """The device this rank computes on."""
    backend: str | None
    """``"gloo"`` (CPU), ``"nccl"`` (CUDA), or ``None`` for one process without a process group."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group is running (more than one process)."""
        return self.backend is not None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer (set by torchrun)") from None


def _resolve_device(device: str | torch.device, local_rank: int) -> torch.device:
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available (use device='cpu' or 'auto')")
        if dev.index is None:
            dev = torch.device("cuda", local_rank)
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {dev} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type != "cpu":
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return dev


def init_distributed(device: str | torch.device = "auto", *, timeout_s: float | None = None) -> DistState:
    """Start the process group from torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``).

    ``device``: ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` (→ ``cuda:{local_rank}``) or
    ``"cuda:N"``. With ``WORLD_SIZE`` unset or 1 no process group is created (``backend=None``). Otherwise the
    backend is nccl on CUDA (the device is bound to the group, so barriers know their GPU) and gloo on CPU.
    ``timeout_s`` sets the collective timeout (torch's default when None). Calling it again returns the state
    of the running group.
    """
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise ValueError(f"inconsistent torchrun environment: RANK={rank} LOCAL_RANK={local_rank} "
                         f"WORLD_SIZE={world_size}")
    dev = _resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size == 1:
        return DistState(rank=0, local_rank=local_rank, world_size=1, device=dev, backend=None)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dist.is_initialized():
        running = dist.get_backend()
        if running != backend:
            raise ValueError(f"a {running} process group is already running; device={device!r} needs {backend}")
    else:
        kwargs = {}
        if timeout_s is not None:
            import datetime

            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            kwargs["device_id"] = dev
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
    return DistState(rank=rank, local_rank=local_rank, world_size=world_size, device=dev, backend=backend)


def _running() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """Global rank: the process group's, else torchrun's ``RANK`` (before ``init_distributed``), else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _env_int("RANK", 0)


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0 (and for a single process)."""
    return get_rank() == 0


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only (flushed, so torchrun's interleaved output stays in order)."""
    if is_main_process():
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


def barrier() -> None:
    """Wait for every rank (no-op for one process)."""
    if _running():
        dist.barrier()


def _collective_device() -> torch.device:
    # nccl only moves CUDA tensors; gloo only CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_op(op: str, name: str = "op") -> str:
    if op not in REDUCE_OPS:
        raise ValueError(f"{name} must be one of {REDUCE_OPS}, got {op!r}")
    return op


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place and return it: ``op`` in sum / mean / max / min.

    ``mean`` is a sum divided by the world size (gloo has no AVG). No-op for one process. The tensor must live on
    the backend's device (CUDA for nccl, CPU for gloo).
    """
    _check_op(op)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not _running():
        return tensor
    red = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    dist.all_reduce(tensor, op=red[op])
    if op == "mean":
        tensor.div_(dist.get_world_size())
    return tensor


def _key_op(key: str, default: str, ops: Mapping[str, str] | None) -> str:
    if ops is not None and key in ops:
        return _check_op(ops[key], f"ops[{key!r}]")
    for suffix, suffix_op in SUFFIX_OPS.items():
        if key.endswith(suffix):
            return suffix_op
    return default


def reduce_metrics(
    metrics: Mapping[str, float | int | torch.Tensor], *, op: str = "mean", ops: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Reduce a dict of scalars across ranks with one collective; returns python floats in sorted key order.

    Each key is reduced with ``ops[key]`` when given, else by its suffix (``/max`` → max, ``/min`` → min,
    ``/sum`` → sum), else with ``op``. ``mean`` is the unweighted mean of the per-rank values (give counts as
    ``/sum`` keys and divide yourself when ranks hold different numbers of items). Every rank must pass the same
    keys (checked: a mismatch raises ``ValueError`` on every rank, also when their numbers of keys differ).
    Implementation: two all-gathers, whatever the ops: each rank's ``[checksum of the key names, K]`` (so that ranks
    that disagree raise before a gather of unequal sizes, which gloo and NCCL cannot do), then all ranks' values as
    one ``[world, K]`` float64 tensor, reduced locally. Values may be python numbers or 0-d tensors on any device.
    """
    _check_op(op)
    keys = sorted(metrics)
    key_ops = [_key_op(k, op, ops) for k in keys]
    values = []
    for k in keys:
        v = metrics[k]
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise ValueError(f"metrics[{k!r}] must be a scalar, got a tensor of shape {tuple(v.shape)}")
            v = v.detach().reshape(())
        elif not isinstance(v, (int, float)):
            raise ValueError(f"metrics[{k!r}] must be a number or a 0-d tensor, got {type(v).__name__}")
        values.append(v)
    if not _running():
        device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
        # sync: one read-back of all the values together (the caller wants floats for logging).
        return dict(zip(keys, _stack(values, device).tolist()))
    # The key names' checksum and count first: ranks that disagree on the keys fail loudly, not in the gather.
    header = torch.tensor([float(zlib.crc32("\0".join(keys).encode())), float(len(keys))], dtype=torch.float64,
                          device=_collective_device())
    headers = [torch.empty_like(header) for _ in range(dist.get_world_size())]
    dist.all_gather(headers, header)
    # sync: two numbers per rank, read once per call (the values' gather needs to know they agree).
    if any(not torch.equal(h, header.cpu()) for h in torch.stack(headers).cpu()):
        raise ValueError(f"metrics must have the same keys on every rank; rank {dist.get_rank()} has {keys}")
    if not keys:
        return {}
    local = _stack(values, _collective_device())  # [K]
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    table = torch.stack(gathered)  # [world, K]
    reducers = {"sum": lambda c: c.sum(), "mean": lambda c: c.mean(), "max": lambda c: c.max(),
                "min": lambda c: c.min()}
    # sync: the reduced metrics are read back once per call, for logging.
    return dict(zip(keys, torch.stack([reducers[o](table[:, j]) for j, o in enumerate(key_ops)]).tolist()))


def _stack(values: list, device: torch.device) -> torch.Tensor:
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack([
        v.to(device=device, dtype=torch.float64) if isinstance(v, torch.Tensor)
        else torch.tensor(float(v), dtype=torch.float64, device=device)
        for v in values
    ])


def broadcast_object(obj, src: int = 0):
    """Return rank ``src``'s picklable ``obj`` on every rank (identity for one process)."""
    if not _running():
        return obj
    box = [obj if dist.get_rank() == src else None]
    # sync: pickled bytes travel through a device tensor under nccl; called at set-up and per-step decisions only.
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: HF's ``_no_split_modules`` classes, else ``*.layers`` lists."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names] if names else []
    if not layers:
        for name, m in model.named_modules():
            if isinstance(m, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks"):
                layers.extend(m)
    return layers


class ForwardWrapper(nn.Module):
    """Runs ``fn(module, *args, **kwargs)`` as its forward, so DDP / FSDP2 see a custom training forward.

    DDP arms its gradient all-reduce, and FSDP2 gathers the root's parameters, only in the wrapped module's
    ``forward``: a training step that calls submodules directly (``model.get_decoder()(...)`` for the last hidden
    state, then the LM head weight in a fused loss) would silently skip the all-reduce under DDP and read sharded
    weights under FSDP2. Wrapping that computation as ``fn`` makes it the forward.
    """

    def __init__(self, module: nn.Module, fn: Callable[..., Any]):
        super().__init__()
        self.module = module
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(self.module, *args, **kwargs)


def wrap_model(
    model: nn.Module,
    state: DistState,
    strategy: str = "ddp",
    *,
    forward: Callable[..., Any] | None = None,
    mp_policy=None,
    reshard_after_forward: bool = True,
    find_unused_parameters: bool = False,
    whole: nn.Module | None = None,
) -> nn.Module:
    """Wrap ``model`` (already on ``state.device``) for data-parallel training.

    - ``"ddp"``: ``DistributedDataParallel`` (``device_ids=[local_rank]`` on CUDA); gradients are averaged over
      ranks during backward, so a per-rank mean loss on equal shards gives the full-batch mean's gradient.
      Rank 0's parameter values are copied into the other ranks' parameters (same objects) at construction.
    - ``"fsdp2"``: ``fully_shard`` on every decoder layer, then on the root; ``mp_policy`` is an optional
      ``torch.distributed.fsdp.MixedPrecisionPolicy``. By default a model in a low precision (bf16) is upcast in
      place to fp32 sharded parameters (the fp32 master weights) with ``param_dtype`` = its dtype (bf16 all-gather,
      forward and backward) and ``reduce_dtype=float32`` (see :mod:`fastgrpo.precision`); an fp32 model stays fp32.
      Frozen parameters (a LoRA base, ``fastgrpo.models.lora``) are not upcast: they stay sharded in the compute dtype.
      Rank 0's values of the trainable parameters are broadcast first, as DDP copies them (fresh adapters or heads
      differ per rank otherwise; the frozen weights are loaded alike everywhere).
      ``reshard_after_forward`` frees gathered layer weights after forward (ZeRO-3) or keeps them (ZeRO-2).
      Every forward all-gathers, so all ranks must run the same number of forwards per step.
    - ``"none"``: the model unchanged.

    ``whole``: a submodule that runs a data-dependent number of times per forward (a VLM's vision tower: once per
    distinct image set of a micro-batch, so a rank without images never runs it): sharded block by block, its
    all-gathers would not pair up between ranks. FSDP2 leaves its frozen parameters out (``ignored_params``:
    replicated in their dtype, no collective, no master) and puts its trainable ones in the root's group (gathered
    once per forward with the embeddings and the head, reduce-scattered with them: a forward that does not run it
    must still give its trainable parameters a gradient, zero, as ``fastgrpo.models.vlm`` does).

    ``forward``: ``fn(model, *args, **kwargs)`` to run when the wrapped model is called, instead of
    ``model.forward`` (see :class:`ForwardWrapper`); the trainer passes its packed hidden-state forward and
    returns the LM head weight from it. Gradients are synchronised only for work done through this call.
    With one process the model is returned unchanged (apart from ``forward``) whatever the strategy.
    ``unwrap_model`` gives ``model`` back in every case.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if forward is not None and not callable(forward):
        raise ValueError(f"forward must be callable, got {type(forward).__name__}")
    for name, p in model.named_parameters():
        if p.device != state.device:
            raise ValueError(f"model parameter {name} is on {p.device}, expected {state.device} "
                             f"(move the model before wrapping it)")
        break
    inside = set(whole.modules()) if whole is not None else set()
    layers = [m for m in _decoder_layers(model) if m not in inside]
    if forward is not None:
        model = ForwardWrapper(model, forward)
    if strategy == "none" or state.world_size == 1:
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [state.device.index] if state.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=find_unused_parameters)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(state.device.type, (state.world_size,))
    for p in model.parameters():  # rank 0's values everywhere, as DDP copies them: a fresh LoRA adapter or score
        if p.requires_grad:  # head is drawn from each rank's own seed, and the shards would mix the draws
            dist.broadcast(p.data, src=0)
    if mp_policy is None:
        low = {p.dtype for p in model.parameters() if p.is_floating_point()} - {torch.float32}
        if len(low) > 1:
            raise ValueError(f"model parameters mix dtypes {sorted(map(str, low))}; give mp_policy explicitly")
        if low:  # fp32 sharded parameters (the optimizer's masters), gathered in the compute dtype
            if all(p.requires_grad for p in model.parameters()):
                model.float()
            else:  # a frozen base (LoRA) stays in the compute dtype: only the trainable parameters get masters
                for p in model.parameters():
                    if p.requires_grad:
                        p.data = p.data.float()
            mp_policy = MixedPrecisionPolicy(param_dtype=low.pop(), reduce_dtype=torch.float32)
        else:
            mp_policy = MixedPrecisionPolicy()
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": mp_policy}
    for layer in layers:
        fully_shard(layer, **kwargs)
    # The root (embeddings, final norm, LM head) stays gathered from forward to backward: backward needs it at
    # once, and a fused loss reads the LM head weight outside the forward.
    ignored = {p for m in inside for p in m.parameters(recurse=False) if not p.requires_grad}
    fully_shard(model, **{**kwargs, "reshard_after_forward": False}, ignored_params=ignored or None)
    return model


def _chain(model: nn.Module) -> list[nn.Module]:
    """``model`` and the modules it wraps, outermost first (DDP, torch.compile, ForwardWrapper)."""
    from torch.nn.parallel import DistributedDataParallel

    chain = [model]
    while True:
        m = chain[-1]
        if isinstance(m, (DistributedDataParallel, ForwardWrapper)):
            chain.append(m.module)
        elif hasattr(m, "_orig_mod") and isinstance(m._orig_mod, nn.Module):  # torch.compile
            chain.append(m._orig_mod)
        else:
            return chain


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under the DDP / ``torch.compile`` / ``ForwardWrapper`` layers (FSDP2 shards in place)."""
    return _chain(model)[-1]


def fsdp_root(model: nn.Module) -> nn.Module | None:
    """The outermost FSDP2 ``fully_shard`` module in ``model``'s wrapper chain, or None (not FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return next((m for m in _chain(model) if isinstance(m, FSDPModule)), None)


def is_fsdp(model: nn.Module) -> bool:
    """True when ``model`` is (or wraps) an FSDP2 ``fully_shard`` root."""
    return fsdp_root(model) is not None


@contextmanager
def full_weights(model: nn.Module):
    """Under FSDP2, gather every sharded module's full parameters for the block (generation reads them); otherwise
    nothing to do. Memory: the whole model's parameters in their dtype on every rank while the block runs."""
    root = fsdp_root(model)
    if root is None:
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    shards = [m for m in root.modules() if isinstance(m, FSDPModule)]
    for m in shards:
        m.unshard()
    try:
        yield
    finally:
        for m in shards:
            m.reshard()


def fqn_prefix(root: nn.Module, inner: nn.Module) -> str:
    """The name prefix of ``inner``'s parameters inside ``root`` (``"module."`` under a ForwardWrapper)."""
    for name, m in root.named_modules():
        if m is inner:
            return f"{name}." if name else ""
    raise ValueError("inner is not a submodule of root")


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool = True):
    """Context in which backward passes synchronise gradients (``enabled``) or only accumulate them locally.

    For gradient accumulation over micro-batches: run every micro-batch's forward *and backward* inside
    ``gradient_sync(model, enabled=is_last_microbatch)``. DDP (``no_sync``) then communicates once per step, so
    ranks may hold different numbers of micro-batches; FSDP2 (``set_requires_gradient_sync``) skips the
    reduce-scatter but still all-gathers in every forward, so there the counts must agree (take the max with
    ``all_reduce(n, "max")`` and run empty micro-batches). A no-op for unwrapped models.
    """
    from torch.nn.parallel import DistributedDataParallel

    if enabled:
        yield
        return
    chain = _chain(model)
    ddp = next((m for m in chain if isinstance(m, DistributedDataParallel)), None)
    root = fsdp_root(model)
    if ddp is not None:
        with ddp.no_sync():
            yield
    elif root is not None:
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)
    else:
        yield


def full_state_dict(model: nn.Module, state: DistState | None = None) -> dict[str, torch.Tensor] | None:
    """The unsharded state dict of ``unwrap_model(model)`` on rank 0 (``None`` elsewhere); every rank must call it.

    FSDP2: gathered to CPU with ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` (a collective),
    keys relative to the user's module. Otherwise its own ``state_dict()``: live views of the parameters on
    their device, no copy (clone before changing the weights if you keep it).
    """
    rank = state.rank if state is not None else get_rank()
    inner = unwrap_model(model)
    root = fsdp_root(model)
    if root is None:
        return inner.state_dict() if rank == 0 else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    prefix = fqn_prefix(root, inner)
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def destroy() -> None:
    """Tear the process group down (no-op when none is running).

    Unreachable objects are collected first: FSDP2 modules live in reference cycles and, through their DTensor
    parameters and device mesh, keep the process group's backend and the work handles of their last collectives
    alive after their last reference is gone, until a garbage-collector pass. Left to the interpreter's exit, the
    backend would be destroyed (its gloo worker threads joined, tensors held by its work freed) while Python is
    being torn down, which can abort the process. Callers drop their references to wrapped models first.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
