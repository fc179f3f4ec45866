"""The eager (CPU) decode step's memory besides the pages (``Workspace``: the row cache and the products' reused
buffers and MKL packs), the products that use it (``linear_t``: ``W xᵀ`` into a feature-major buffer;
``packed_linear``: MKL's GEMM on a packed weight), and the per-host choice between them (``packed_groups``).

**Choices made per host.** Whether the CPU step runs a weight group's products (the LM head, the MLP, the stacked
q/k/v) on copies packed for MKL's GEMM or as plain products is measured, not assumed: packing helps some hosts and
slows others (issue 39; the figures: bench/bench_generation.py ``--cpu-packed 0,1,auto``, docs/benchmarks.md). On
the first call for a model's shapes, dtype, thread count and row count, each group's packed and plain products,
with what reads their output, are timed (:func:`time_groups`, once per process) and the faster kept
(:func:`packed_groups`; ``engine.last_stats``: ``cpu_packed``, ``cpu_packed_by``, ``cpu_product_ms``).
``FASTGRPO_CPU_PACKED=0|1|auto`` or ``GenerationEngine(cpu_packed=False|True)`` forces it (benchmarks, tests).
Still fixed, each chosen from A/B runs on one Intel host: the packing bounds below (``PACKED_WEIGHTS_*``: under
4 MiB a pack per call costs more than it saves, a cost the timing does not see), o_proj never packed, the plain
products as ``W xᵀ`` into feature-major buffers (:func:`linear_t`), the row cache's attention layout (the G query
heads of a kv head as G rows of one SDPA over the contiguous row, ``masked_attention``), the fp32 LM head's chunk
off CUDA (``fastgrpo.engine.forward.LM_HEAD_CHUNK``), and the training forward's CPU attention padding rule
(``kernels/varlen_attention.PAD_FACTOR``: one padded SDPA when it costs at most 3x the per-sequence arithmetic).
The list with where each lives: ``docs/architecture.md`` ("The engine").

The forward pieces timed here are those of ``fastgrpo.engine.forward.ModelForward`` (passed in as ``forward``).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from fastgrpo.engine.ops import EAGER_OPS
from fastgrpo.engine.sampling import SamplingParams, sample_tokens

PACKED_ENV = "FASTGRPO_CPU_PACKED"  # 0: never pack, 1: pack every group the step can, auto (the default): timed
PACKED_GROUPS = ("lm_head", "mlp", "qkv")  # the weight groups the CPU step may pack (``weight_groups``)
# ``auto`` times the packed products only when the groups' weights hold this many bytes in all. Below the lower
# bound a pack (allocated per call and row count) costs more than the products it speeds (measured on the demo's
# 130K-parameter model). Above the upper one the packs' memory (about three times the weights) is not spent.
PACKED_WEIGHTS_MIN_BYTES = 4 << 20
PACKED_WEIGHTS_MAX_BYTES = 256 << 20
_DRAW = SamplingParams()  # the draw timed after the LM head: temperature 1, no top-k/top-p
PACKED_TIMING_ROUNDS = 5  # runs of each side, the fastest kept (a shared machine adds time, never removes it)
# A group is packed only when its packed products are at least this much faster: a smaller difference is within what
# the timing varies between processes on a shared host, and a near tie goes to the plain products (no packs'
# memory, no packing per call).
PACKED_MIN_GAIN = 0.05
# (group, its weights' shapes and biases, dtype, threads, rows) -> (packed, plain) seconds, for this process
_product_times: dict[tuple, tuple[float, float]] = {}


def packed_setting(cpu_packed: bool | None) -> bool | None:
    """Whether the CPU step packs its weights: the engine's ``cpu_packed`` when given, else ``FASTGRPO_CPU_PACKED``
    (``0`` False, ``1`` True, ``auto`` or unset None: timed per host, :func:`packed_groups`)."""
    if cpu_packed is not None:
        return cpu_packed
    value = os.environ.get(PACKED_ENV, "auto")
    if value not in ("0", "1", "auto"):
        raise ValueError(f"{PACKED_ENV}={value!r}: expected 0, 1 or auto")
    return None if value == "auto" else value == "1"


def weight_groups(forward) -> dict[str, list]:
    """The modules of each weight group the CPU step may pack: the LM head; every dense layer's gate, up and down;
    every layer's q, k and v (one product on their weights stacked, ``ModelForward.qkv_rows``)."""
    layers = forward.layers
    mlp = [m for layer in dense_mlp_layers(forward) for m in (layer.mlp.gate_proj, layer.mlp.up_proj,
                                                                layer.mlp.down_proj)]
    qkv = [m for layer in layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)]
    return {"lm_head": [forward.model.lm_head], "mlp": mlp, "qkv": qkv}


def dense_mlp_layers(forward) -> list:
    """The layers whose MLP is dense (a mixture-of-experts model's sparse blocks run ``fastgrpo.engine.moe``)."""
    return [layer for layer in forward.layers if hasattr(layer.mlp, "gate_proj")]


def product_seconds(group: str, packed: bool, run: Callable[[], object]) -> float:
    """Wall time of one ``run()``: the ``packed`` or plain products of weight group ``group`` (named so that a test
    can stand in a fake clock)."""
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def group_step(forward, group: str, h_RH: torch.Tensor, u_R: torch.Tensor, work: Workspace):
    """One decode step's products of weight group ``group`` on rows ``h``, through ``work`` as the step runs them,
    with what reads their output: the layout differs (row-major packed, feature-major plain), and so does the
    reader's speed. The LM head's logits: one draw at temperature 1 (uniforms ``u``; the sampler reads row-major
    logits faster). Every layer's MLP, then the residual add and norm of its output; every layer's q/k/v (row-major
    either way)."""
    if group == "lm_head":
        return sample_tokens(forward.lm_head(h_RH, work), _DRAW, None, u_R)
    if group == "mlp":
        norm = forward.inner.norm
        return [EAGER_OPS.add_rms_norm(h_RH, forward.mlp(EAGER_OPS, layer.mlp, h_RH, work), norm.weight,
                                       norm.variance_epsilon) for layer in dense_mlp_layers(forward)]
    return [forward.qkv_rows(layer.self_attn, h_RH, work) for layer in forward.layers]


def time_groups(forward, groups: list[str], R: int, device: torch.device, dtype: torch.dtype) -> dict[str, tuple]:
    """{group: (packed, plain) seconds} of the weight groups' products for ``R`` rows: random rows, one untimed run
    of each (the packing, the buffers' first touch), then ``PACKED_TIMING_ROUNDS`` rounds, each running every group
    packed then every group plain, the fastest run of each kept (:func:`product_seconds`). In that order a group's
    weights come cache-cold, as in the step: every other weight and pack passes through the caches between two
    runs of the same product (timed back to back, a packed product looks slower than it is in the step)."""
    gen = torch.Generator(device).manual_seed(0)
    h_RH = torch.randn(R, forward.inner.config.hidden_size, generator=gen, device=device, dtype=dtype)
    u_R = torch.rand(R, generator=gen, device=device, dtype=torch.float64)
    runs = {}
    for packed in (True, False):
        work = Workspace(None, **step_buffers(forward, R, device, dtype, frozenset(groups if packed else ())))
        for group in groups:
            runs[group, packed] = functools.partial(group_step, forward, group, h_RH, u_R, work)
            runs[group, packed]()
    best = dict.fromkeys(runs, math.inf)
    for _ in range(PACKED_TIMING_ROUNDS):
        for (group, packed), run in runs.items():
            best[group, packed] = min(best[group, packed], product_seconds(group, packed, run))
    return {group: (best[group, True], best[group, False]) for group in groups}


def packed_groups(forward, cpu_packed: bool | None, R: int, device: torch.device,
                  dtype: torch.dtype) -> tuple[frozenset, dict]:
    """The weight groups the CPU step runs packed for ``R`` rows, and how that was decided (``last_stats``:
    ``cpu_packed`` {group: packed}, ``cpu_packed_by`` "unavailable" (not fp32 without autocast, or no MKL), "forced"
    (:func:`packed_setting` of the engine's ``cpu_packed``), "size" (auto, outside ``PACKED_WEIGHTS_*``), "timed" or
    "cached" (auto: measured in this call, or earlier in the process), ``cpu_product_ms`` {group: (packed, plain)
    ms} when measured). A group is packed when its packed products took at most ``1 - PACKED_MIN_GAIN`` of the
    plain ones' time."""
    groups = weight_groups(forward)
    weights = [m.weight for modules in groups.values() for m in modules]
    setting = packed_setting(cpu_packed)
    ms = {}
    fp32 = dtype == torch.float32 and all(w.dtype == dtype for w in weights)  # and so no autocast
    if device.type != "cpu" or not fp32 or not mkl_packed_gemm():
        packed, by = frozenset(), "unavailable"
    elif setting is not None:
        packed, by = frozenset(PACKED_GROUPS if setting else ()), "forced"
    elif not PACKED_WEIGHTS_MIN_BYTES <= sum(w.numel() * w.element_size() for w in weights) <= PACKED_WEIGHTS_MAX_BYTES:
        packed, by = frozenset(), "size"
    else:
        keys = {g: (g, tuple((tuple(m.weight.shape), m.bias is not None) for m in modules), dtype,
                    torch.get_num_threads(), R) for g, modules in groups.items()}
        new = [g for g, key in keys.items() if key not in _product_times]
        for g, seconds in (time_groups(forward, new, R, device, dtype) if new else {}).items():
            _product_times[keys[g]] = seconds
        by = "timed" if new else "cached"
        ms = {g: tuple(t * 1e3 for t in _product_times[key]) for g, key in keys.items()}
        packed = frozenset(g for g, (t_packed, t_plain) in ms.items() if t_packed <= (1 - PACKED_MIN_GAIN) * t_plain)
    return packed, dict(cpu_packed={g: g in packed for g in PACKED_GROUPS}, cpu_packed_by=by, cpu_product_ms=ms)


def step_buffers(forward, R: int, device: torch.device, dtype: torch.dtype, packed: frozenset) -> dict:
    """The products' part of a ``Workspace`` without autocast: the reused buffers of the groups not ``packed`` (the
    MLP's activations and output, the LM head's fp32 logits) and, when any group is, the dict of their packs."""
    inter = max((layer.mlp.gate_proj.out_features for layer in dense_mlp_layers(forward)), default=0)
    mlp, head = "mlp" not in packed, "lm_head" not in packed
    return dict(
        gate=torch.empty(R * inter, device=device, dtype=dtype) if mlp else None,
        up=torch.empty(R * inter, device=device, dtype=dtype) if mlp else None,
        down=torch.empty(R * forward.inner.config.hidden_size, device=device, dtype=dtype) if mlp else None,
        logits=torch.empty(R * forward.vocab_size, device=device) if head else None,
        packs={} if packed else None,
        packed=packed,
    )


def make_workspace(forward, R: int, max_keys: int, budget: int, row_cache: bool | None, cpu_packed: bool | None,
                   device: torch.device, dtype: torch.dtype) -> tuple[Workspace, dict]:
    """The eager decode step's row cache and buffers for ``R`` rows of at most ``max_keys`` keys (see
    :class:`Workspace`), and how its products were chosen (the ``last_stats`` entries of :func:`packed_groups`).
    The row cache exists when ``row_cache`` says so, by default (None) only when it holds no more tokens than the
    KV budget (``R · max_keys ≤ budget``: the eager path's K/V stays within twice the budget; with
    ``numerics.batch_invariant`` the value grids kept beside it add up to the row cache's own bytes again:
    ``fastgrpo.engine.batch_invariant.KeptValueGrids``); no activation buffers under autocast."""
    shape = (len(forward.layers), R, 2, forward.num_kv_heads, max_keys, forward.head_dim)
    rows = R * max_keys <= budget if row_cache is None else row_cache
    packed, products = packed_groups(forward, cpu_packed, R, device, dtype)
    autocast = dtype != next(forward.model.parameters()).dtype
    buffers = {} if autocast else step_buffers(forward, R, device, dtype, packed)
    # zeroed: never-written keys stay finite (their weight is 0 in P V, and 0 · NaN would be NaN)
    return Workspace(torch.zeros(shape, device=device, dtype=dtype) if rows else None, **buffers), products


class Workspace(NamedTuple):
    """The eager (CPU) decode step's memory besides the pages.

    **Row cache.** Its attention reads each row's keys laid out contiguously, ``kv_rows[layer, row, 0, :, :len]``, not
    a fresh gather of the row's pages at every layer and step (which copies the whole live K/V once more per step and
    was the largest cost of a CPU step). A row whose sequence changed (admitted, moved by compaction, recomputed
    after a preemption, resumed after a turn) is loaded from its pages through the block table; a decode step then
    writes its token's K/V to the row only, and the K/V a row holds past the position it was loaded at
    (``fastgrpo.engine.cache.RowCache.loaded_at``) go to the sequence's pages when it leaves the row keeping them
    (moved by compaction, paused at a turn's end: :meth:`~fastgrpo.engine.cache.RowCache.flush`). So the pages hold
    a sequence's K/V whenever a row is loaded from them or a prefill reads them, and a step pays no scattered page
    write per layer. Memory: a static cache for the rows (``L · R · Hkv · max_pages · page_size · D`` keys and as
    many values), kept only when it holds no more tokens than the KV budget; otherwise every layer gathers its rows'
    pages at every step (``paged_decode_attention_torch``, slower) and writes each token's K/V to its page.

    **Products.** fp32 with MKL, the weight groups in ``packed`` (the LM head, the MLP, the stacked q/k/v: chosen
    per host, see the module docstring) run on copies of their weights packed for MKL's GEMM at the step's row
    count (``packs``: module -> {rows: packed weight}, filled on first use by :func:`packed_linear`, at most two row
    counts kept per weight; an attention module -> its q/k/v weights stacked, their bias, their packs), so at most
    about three times those weights' bytes, freed with the workspace: the packs always match the weights of this
    call. The step writes the MLP activations and logits of the groups not packed into reused buffers instead of
    fresh tensors, as the feature-major products of :func:`linear_t`. Neither under autocast (the products are not
    cast)."""

    kv_rows: torch.Tensor | None  # [L, R, 2, Hkv, max_pages · page_size, D]; None: attention through the pages
    gate: torch.Tensor | None = None  # [R · intermediate]: the MLP's gate projection, then its activation
    up: torch.Tensor | None = None  # [R · intermediate]
    down: torch.Tensor | None = None  # [R · H]: the MLP's output
    logits: torch.Tensor | None = None  # [R · V] fp32
    packs: dict | None = None  # module -> {rows: its weight packed for MKL}; attention -> (q/k/v stacked, bias, packs)
    packed: frozenset = frozenset()  # the groups of PACKED_GROUPS whose products run packed


def linear_t(x_MK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None, out: torch.Tensor):
    """``F.linear(x, weight, bias)`` for 2-D ``x``, computed as ``W xᵀ`` into the flat buffer ``out`` (``[N, M]``,
    contiguous) and returned as its ``[M, N]`` view, feature-major (strides (1, M)).

    For a few rows (decode: M = the batch) MKL's product is faster with the weight as the long operand (measured by
    bench/bench_generation.py), and the buffer saves a fresh allocation per step. Elementwise ops and the next
    product take the view as it is (``x`` may itself be such a view: ``xᵀ`` is then contiguous). This is the path
    where the workspace packs nothing (:func:`packed_linear` otherwise)."""
    M, N = x_MK.shape[0], weight_NK.shape[0]
    y_NM = torch.mm(weight_NK, x_MK.t(), out=out[: N * M].view(N, M))
    if bias_N is not None:
        y_NM += bias_N[:, None]
    return y_NM.t()


@functools.cache
def mkl_packed_gemm() -> bool:
    """Whether this torch has MKL's packed-weight GEMM ops (``torch.ops.mkl``, those inductor's CPU weight freezing
    calls): x86 builds with MKL."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def packed_linear(x_MK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None, packs: dict):
    """``F.linear(x, weight, bias)`` (fp32, CPU) by MKL's GEMM on a copy of the weight packed into its kernel's
    layout for ``M`` rows (``packs[M]``, packed on first use; the two most recent kept), row-major ``[M, N]``.

    For the decode step's LM head, MLP and stacked q/k/v (``ModelForward.qkv_rows``): its logits are row-major, so
    the sampler's reductions over the vocabulary run on contiguous rows, and the packed layout helps most where the
    weights come cache-cold, as in the step. o_proj gained nothing measurable, so it stays unpacked (figures:
    docs/benchmarks.md). Values: MKL's products, within fp32 rounding of ``F.linear`` (tested). A pack costs one
    pass over the weight and ~its bytes, and is valid only while the weight is unchanged (the workspace's packs live
    for one ``generate`` call)."""
    M = x_MK.shape[0]
    packed = packs.pop(M, None)
    if packed is None:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight_NK, M)
        if len(packs) >= 2:
            del packs[next(iter(packs))]  # the least recently used
    packs[M] = packed
    return torch.ops.mkl._mkl_linear(x_MK, packed, weight_NK, bias_N, M)
