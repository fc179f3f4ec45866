"""The per-``generate`` memory of the engine: the KV page pool (``_KVCache``) and, on the eager (CPU) path, the row
cache and reused step buffers (``_Workspace``), with the ``_Run`` steps that size the workspace and refresh its rows
from the pages (``_RowCacheSteps``). Which sequence owns which row and pages is the scheduler's
(``fastgrpo.engine.scheduler``); this file only copies K/V where the block tables say.

**Choices made per host.** Whether the CPU step runs a weight group's products (the LM head, the MLP, the stacked
q/k/v) on copies packed for MKL's GEMM or as plain products is measured, not assumed: packing, which saved an
Intel Xeon about 5% of a call per group (paired A/B 0.95-0.97), made bench_generation's call 28% slower on an AMD
EPYC (issue 39). On the first call for a model's shapes, dtype, thread count and row count, each group's packed and
plain products, with what reads their output, are timed (:func:`_time_groups`, once per process: at
bench_generation's sizes 0.44 s at 1 thread and 1.8 s at 2 on a shared 2-core AMD EPYC at load ~3, a few times less
on a quiet host) and the faster kept (``_packed_groups``; ``engine.last_stats``: ``cpu_packed``, ``cpu_packed_by``,
``cpu_product_ms``).
``FASTGRPO_CPU_PACKED=0|1|auto`` or ``GenerationEngine(cpu_packed=False|True)`` forces it (benchmarks, tests).
Still fixed, each chosen from A/B runs on one Intel host: the packing bounds below (``PACKED_WEIGHTS_*``: under
4 MiB a pack per call costs more than it saves, a cost the timing does not see), o_proj never packed, the plain
products as ``W xᵀ`` into feature-major buffers (``engine_forward._linear_t``), the row cache's attention layout
(the G query heads of a kv head as G rows of one SDPA over the contiguous row, ``masked_attention``), the fp32 LM
head's chunk off CUDA (``LM_HEAD_CHUNK``), and the training forward's CPU attention padding rule
(``kernels/varlen_attention.PAD_FACTOR``: one padded SDPA when it costs at most 3x the per-sequence arithmetic).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from fastgrpo.engine.forward import _EAGER_OPS, mkl_packed_gemm
from fastgrpo.engine.sampling import SamplingParams, _sample


@dataclass
class _KVCache:
    """The per-``generate`` memory (freed when generate returns): the KV page pool, head-major (a page's keys of
    one kv head are contiguous: a row refresh copies whole blocks, and the CUDA kernel reads 64 × D contiguous
    values per page and head), keys and values of all layers in one tensor (a row refresh or flush moves both, for
    every layer, in one indexed copy), and, on the eager (CPU) path, the row cache and the step's reused buffers."""

    kv: torch.Tensor  # [L, 2, Hkv, pages, page_size, D]: [:, 0] keys, [:, 1] values
    work: _Workspace | None = None

    @property
    def k(self) -> torch.Tensor:
        return self.kv[:, 0]  # [L, Hkv, pages, page_size, D]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, 1]

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's pools as ``[pages, page_size, Hkv, D]`` views (the decode-attention API's layout)."""
        return self.kv[layer, 0].permute(1, 2, 0, 3), self.kv[layer, 1].permute(1, 2, 0, 3)

    def write(self, layer: int, slot_N: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor) -> None:
        """K/V of N tokens into flat slots ``page · page_size + offset`` of the layer's pool."""
        Hkv, D = self.kv.shape[2], self.kv.shape[-1]
        self.kv[layer, 0].view(Hkv, -1, D)[:, slot_N] = k_NHD.transpose(0, 1)
        self.kv[layer, 1].view(Hkv, -1, D)[:, slot_N] = v_NHD.transpose(0, 1)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V of pages ``src`` into pages ``dst``."""
        self.kv[:, :, :, dst] = self.kv[:, :, :, src]


PACKED_ENV = "FASTGRPO_CPU_PACKED"  # 0: never pack, 1: pack every group the step can, auto (the default): timed
PACKED_GROUPS = ("lm_head", "mlp", "qkv")  # the weight groups the CPU step may pack (``_weight_groups``)
# ``auto`` times the packed products only when the groups' weights hold this many bytes in all. Below the lower
# bound a pack (allocated per call and row count) costs more than the products it speeds: the demo's 130K-parameter
# model generated 8% slower packed on an Intel Xeon. Above the upper one the packs' memory (about three times the
# weights) is not spent.
PACKED_WEIGHTS_MIN_BYTES = 4 << 20
PACKED_WEIGHTS_MAX_BYTES = 256 << 20
_DRAW = SamplingParams()  # the draw timed after the LM head: temperature 1, no top-k/top-p
PACKED_TIMING_ROUNDS = 5  # runs of each side, the fastest kept (a shared machine adds time, never removes it)
# A group is packed only when its packed products are at least this much faster: a smaller difference is within what
# the timing varies between processes on a shared host (AMD EPYC here, 2 threads: the MLP's 6.06 vs 6.12 ms packed vs
# plain in one process, with the whole call 7% slower with it packed in the same run), and a near tie goes to the
# plain products (no packs' memory, no packing per call).
PACKED_MIN_GAIN = 0.05
# (group, its weights' shapes and biases, dtype, threads, rows) -> (packed, plain) seconds, for this process
_product_times: dict[tuple, tuple[float, float]] = {}


def packed_setting(cpu_packed: bool | None) -> bool | None:
    """Whether the CPU step packs its weights: the engine's ``cpu_packed`` when given, else ``FASTGRPO_CPU_PACKED``
    (``0`` False, ``1`` True, ``auto`` or unset None: timed per host, ``_packed_groups``)."""
    if cpu_packed is not None:
        return cpu_packed
    value = os.environ.get(PACKED_ENV, "auto")
    if value not in ("0", "1", "auto"):
        raise ValueError(f"{PACKED_ENV}={value!r}: expected 0, 1 or auto")
    return None if value == "auto" else value == "1"


def _weight_groups(e) -> dict[str, list]:
    """The modules of each weight group the CPU step may pack: the LM head; every layer's gate, up and down; every
    layer's q, k and v (one product on their weights stacked, ``_qkv_rows``)."""
    mlp = [m for layer in e.layers for m in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    qkv = [m for layer in e.layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)]
    return {"lm_head": [e.model.lm_head], "mlp": mlp, "qkv": qkv}


def product_seconds(group: str, packed: bool, run: Callable[[], object]) -> float:
    """Wall time of one ``run()``: the ``packed`` or plain products of weight group ``group`` (named so that a test
    can stand in a fake clock)."""
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def _group_step(e, group: str, h_RH: torch.Tensor, u_R: torch.Tensor, work: _Workspace):
    """One decode step's products of weight group ``group`` on rows ``h``, through ``work`` as the step runs them,
    with what reads their output: the layout differs (row-major packed, feature-major plain), and so does the
    reader's speed. The LM head's logits: one draw at temperature 1 (uniforms ``u``; on an Intel Xeon the packed
    head's row-major logits took the call's sampling from 93 to 68 ms). Every layer's MLP, then the residual add
    and norm of its output; every layer's q/k/v (row-major either way)."""
    if group == "lm_head":
        return _sample(e._lm_head(h_RH, work), _DRAW, None, u_R)
    if group == "mlp":
        norm = e.model.model.norm
        return [_EAGER_OPS.add_rms_norm(h_RH, e._mlp(_EAGER_OPS, layer.mlp, h_RH, work), norm.weight,
                                        norm.variance_epsilon) for layer in e.layers]
    return [e._qkv_rows(layer.self_attn, h_RH, work) for layer in e.layers]


def _time_groups(e, groups: list[str], R: int, device: torch.device, dtype: torch.dtype) -> dict[str, tuple]:
    """{group: (packed, plain) seconds} of the weight groups' products for ``R`` rows: random rows, one untimed run
    of each (the packing, the buffers' first touch), then ``PACKED_TIMING_ROUNDS`` rounds, each running every group
    packed then every group plain, the fastest run of each kept (:func:`product_seconds`). In that order a group's
    weights come cache-cold, as in the step: every other weight and pack passes through the caches between two
    runs of the same product (on an Intel Xeon the MLP's products took 1.0x packed timed back to back, 0.8x in the
    step)."""
    gen = torch.Generator(device).manual_seed(0)
    h_RH = torch.randn(R, e.model.config.hidden_size, generator=gen, device=device, dtype=dtype)
    u_R = torch.rand(R, generator=gen, device=device, dtype=torch.float64)
    runs = {}
    for packed in (True, False):
        work = _Workspace(None, **_step_buffers(e, R, device, dtype, frozenset(groups if packed else ())))
        for group in groups:
            runs[group, packed] = functools.partial(_group_step, e, group, h_RH, u_R, work)
            runs[group, packed]()
    best = dict.fromkeys(runs, math.inf)
    for _ in range(PACKED_TIMING_ROUNDS):
        for (group, packed), run in runs.items():
            best[group, packed] = min(best[group, packed], product_seconds(group, packed, run))
    return {group: (best[group, True], best[group, False]) for group in groups}


def _packed_groups(e, R: int, device: torch.device, dtype: torch.dtype) -> tuple[frozenset, dict]:
    """The weight groups the CPU step runs packed for ``R`` rows, and how that was decided (``last_stats``:
    ``cpu_packed`` {group: packed}, ``cpu_packed_by`` "unavailable" (not fp32 without autocast, or no MKL), "forced"
    (:func:`packed_setting`), "size" (auto, outside ``PACKED_WEIGHTS_*``), "timed" or "cached" (auto: measured in
    this call, or earlier in the process), ``cpu_product_ms`` {group: (packed, plain) ms} when measured). A group
    is packed when its packed products took at most ``1 - PACKED_MIN_GAIN`` of the plain ones' time."""
    groups = _weight_groups(e)
    weights = [m.weight for modules in groups.values() for m in modules]
    setting = packed_setting(e._cpu_packed)
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
        for g, seconds in (_time_groups(e, new, R, device, dtype) if new else {}).items():
            _product_times[keys[g]] = seconds
        by = "timed" if new else "cached"
        ms = {g: tuple(t * 1e3 for t in _product_times[key]) for g, key in keys.items()}
        packed = frozenset(g for g, (t_packed, t_plain) in ms.items() if t_packed <= (1 - PACKED_MIN_GAIN) * t_plain)
    return packed, dict(cpu_packed={g: g in packed for g in PACKED_GROUPS}, cpu_packed_by=by, cpu_product_ms=ms)


def _step_buffers(e, R: int, device: torch.device, dtype: torch.dtype, packed: frozenset) -> dict:
    """The products' part of a ``_Workspace`` without autocast: the reused buffers of the groups not ``packed`` (the
    MLP's activations and output, the LM head's fp32 logits) and, when any group is, the dict of their packs."""
    inter = e.layers[0].mlp.gate_proj.out_features
    mlp, head = "mlp" not in packed, "lm_head" not in packed
    return dict(
        gate=torch.empty(R * inter, device=device, dtype=dtype) if mlp else None,
        up=torch.empty(R * inter, device=device, dtype=dtype) if mlp else None,
        down=torch.empty(R * e.model.config.hidden_size, device=device, dtype=dtype) if mlp else None,
        logits=torch.empty(R * e.vocab_size, device=device) if head else None,
        packs={} if packed else None,
        packed=packed,
    )


class _Workspace(NamedTuple):
    """The eager (CPU) decode step's memory besides the pages.

    **Row cache.** Its attention reads each row's keys laid out contiguously, ``kv_rows[layer, row, 0, :, :len]``, not
    a fresh gather of the row's pages at every layer and step (which copies the whole live K/V once more per step and
    was the largest cost of a CPU step). A row whose sequence changed (admitted, moved by compaction, recomputed
    after a preemption, resumed after a turn) is loaded from its pages through the block table; a decode step then
    writes its token's K/V to the row only, and the K/V a row holds past the position it was loaded at
    (``_Run.row_from``) go to the sequence's pages when it leaves the row keeping them (moved by compaction, paused
    at a turn's end: :meth:`_RowCacheSteps._flush_rows`). So the pages hold a sequence's K/V whenever a row is
    loaded from them or a prefill reads them, and a step pays no scattered page write per layer (6% of
    bench_generation's CPU call). Memory: a static cache for the rows (``L · R · Hkv · max_pages · page_size · D``
    keys and as many values), kept only when it holds no more tokens than the KV budget; otherwise every layer
    gathers its rows' pages at every step (``paged_decode_attention_torch``, slower) and writes each token's K/V to
    its page.

    **Products.** fp32 with MKL, the weight groups in ``packed`` (the LM head, the MLP, the stacked q/k/v: chosen
    per host, see the module docstring) run on copies of their weights packed for MKL's GEMM at the step's row
    count (``packs``: module -> {rows: packed weight}, filled on first use by
    :func:`~fastgrpo.engine.forward._packed_linear`, at most two row counts kept per weight; an attention module ->
    its q/k/v weights stacked, their bias, their packs), so at most about three times those weights' bytes, freed
    with the workspace: the packs always match the weights of this call.
    The step writes the MLP activations and logits of the groups not packed into reused buffers instead of fresh
    tensors, as the feature-major products of ``_linear_t``. Neither under autocast (the products are not cast)."""

    kv_rows: torch.Tensor | None  # [L, R, 2, Hkv, max_pages · page_size, D]; None: attention through the pages
    gate: torch.Tensor | None = None  # [R · intermediate]: the MLP's gate projection, then its activation
    up: torch.Tensor | None = None  # [R · intermediate]
    down: torch.Tensor | None = None  # [R · H]: the MLP's output
    logits: torch.Tensor | None = None  # [R · V] fp32
    packs: dict | None = None  # module -> {rows: its weight packed for MKL}; attention -> (q/k/v stacked, bias, packs)
    packed: frozenset = frozenset()  # the groups of PACKED_GROUPS whose products run packed


class _RowCacheSteps:
    """The ``_Run`` steps of the CPU row cache (a mixin of ``fastgrpo.engine.engine._Run``)."""

    def _workspace(self, R: int, max_keys: int) -> _Workspace:
        """The eager decode step's row cache and buffers for ``R`` rows of at most ``max_keys`` keys (see
        :class:`_Workspace`): by default the row cache only when it holds no more tokens than the KV budget
        (``R · max_keys ≤ max_total_tokens``: the eager path's K/V stays within twice the budget); no activation
        buffers under autocast; the weight groups packed as chosen for this host (``_packed_groups``, reported in
        ``self.products``)."""
        e, dev, dt = self.e, self.device, self.dtype
        shape = (len(e.layers), R, 2, e.num_kv_heads, max_keys, e.head_dim)
        rows = R * max_keys <= self.budget if e._row_cache is None else e._row_cache
        packed, self.products = _packed_groups(e, R, dev, dt)
        autocast = dt != next(e.model.parameters()).dtype
        products = {} if autocast else _step_buffers(e, R, dev, dt, packed)
        # zeroed: never-written keys stay finite (their weight is 0 in P V, and 0 · NaN would be NaN)
        return _Workspace(torch.zeros(shape, device=dev, dtype=dt) if rows else None, **products)

    def _refresh_rows(self, work: _Workspace, cache: _KVCache, n_pages: int) -> None:
        """Copy into the row cache, from the pages, every running row whose sequence is not the one it holds; its
        K/V from its current position on will be the row's alone (``row_from``)."""
        rows = [row for row, seq in enumerate(self.sched.rows) if self.row_owner[row] is not seq]
        self.row_owner[len(self.sched.rows) :] = [None] * (len(self.row_owner) - len(self.sched.rows))
        if not rows:
            return
        idx = torch.tensor(rows, device=self.device)
        for row, pos in zip(rows, self.st.pos[idx].tolist()):
            self.row_owner[row] = self.sched.rows[row]
            self.row_from[row] = pos
        pages_NP = self.st.table[idx, :n_pages].long()
        L, _, Hkv, _, ps, D = cache.kv.shape
        T = n_pages * ps
        kv = cache.kv[:, :, :, pages_NP]  # [L, 2, Hkv, N, P, page_size, D]
        work.kv_rows[:, idx, :, :, :T] = kv.permute(0, 3, 1, 2, 4, 5, 6).reshape(L, len(rows), 2, Hkv, T, D)

    def _flush_rows(self, cache: _KVCache, held: list) -> None:
        """Write to their pages (through the rows' block tables) the K/V that rows hold only in the row cache:
        positions ``[row_from, pos)`` of each ``(row, sequence)`` in ``held`` whose row was loaded for that sequence
        (one admitted since the last load has decoded nothing there: its K/V are all in its pages), every layer in
        one indexed copy; a no-op without a row cache."""
        work = cache.work
        rows = [row for row, seq in held if self.row_owner[row] is seq]
        if work is None or work.kv_rows is None or not rows:
            return
        row_N, pos_N = [], []
        for row, end in zip(rows, self.st.pos[rows].tolist()):
            row_N += [row] * (end - self.row_from[row])
            pos_N += range(self.row_from[row], end)
            self.row_from[row] = end
        if not row_N:
            return
        L, _, Hkv, _, ps, D = cache.kv.shape
        r, p = torch.tensor(row_N, device=self.device), torch.tensor(pos_N, device=self.device)
        slot_N = self.st.table[r, p // ps].long() * ps + p % ps
        cache.kv.view(L, 2, Hkv, -1, D)[:, :, :, slot_N] = work.kv_rows[:, r, :, :, p].permute(1, 2, 3, 0, 4)
