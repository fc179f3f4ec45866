"""Batch-invariant numerics (``numerics.batch_invariant``): ops whose value for a row depends on that row's data
alone, never on how many rows share the call, where the row sits, the product's shape, or the code path a
library picks for that shape. The generation engine and the trainer's packed forward both run them, so a token's
log-prob is the same number, bit for bit, whether it was sampled in a batched decode or scored in a packed forward.

**Why it holds (exact products).** A BLAS's result depends on its blocking: measured on this code's hosts, MKL's
AVX-512 sgemm gives a row the same bits at every position of a fixed ``[T, K] x [K, N]`` shape, but its AVX2 path
(the one AMD EPYC hosts run) does not, whatever the orientation, and single-row (gemv) and batched calls differ
from both. So the products here do not rest on a BLAS property: each operand is put on a power-of-two grid, and
the product is then computed exactly, so every order of summation gives the same number.

For ``y = x Wᵀ`` with ``x [M, K]``, ``W [N, K]``: row ``m`` of ``x`` is rounded to ``x̃_m = 2^(e_m − b) ·
round(x_m · 2^(b − e_m))`` where ``2^e_m > max|x_m|`` (``e_m``: the exponent of the row's largest entry), and
``W``'s row ``n`` alike with ``e'_n``. The integers have at most ``b`` bits, so with ``2b + ⌈log₂ K⌉ ≤ 53``
(:func:`product_bits`) every product and every partial sum of ``Σ_k x̃_mk w̃_nk`` is an integer below ``2^53``
times ``2^(e_m + e'_n − 2b)``: exact in fp64, whatever the order, the blocking, FMA or not. fp64 GEMM computes
it (``torch.mm`` on the rounded operands held in fp64), and the one rounding is the final cast to the output
dtype. ``b`` is 23 at K = 64, 21 at K = 1536, 19 at K = 18944: the
rounding of the operands costs an error of at most ``2^-b (max|x_m| Σ_k|w_nk| + max|w_n| Σ_k|x_mk|)``, the size
of fp32 GEMM's own error (tests: against an fp64 reference with that bound).

The other reductions are made exact the same way: a row's mean of squares (RMSNorm) sums its terms on a grid of
``53 − ⌈log₂ n⌉`` bits below its largest (:func:`last_dim_mean`); the LM head's ``Σ exp`` sums per vocabulary
tile on a fixed grid (:func:`vocab_tile_stats`), and the tiles combine in one fixed order; an MoE router's
softmax divides by such an exact sum (:func:`softmax`). The elementwise ops
(``+ − × ÷``, ``round``, the conversions) are correctly rounded, the same in a SIMD lane and in scalar code; the
transcendental ones the forward uses (fp32 ``exp``, ``cos``, ``sin``, ``rsqrt``; fp64 ``exp``, ``log``) are
position-independent in this torch build on AVX-512, AVX2 and the default ISA (checked at start-up by
:func:`self_check`), while torch's fp32 ``silu`` / ``sigmoid`` are not (their scalar tail differs from the vector
body: 161 of 70,000 elements moved): :func:`silu` is ``x / (1 + exp(−x))`` from the ops above, :func:`sigmoid`
``1 / (1 + exp(−x))``.

**Where the ops run.** :func:`invariant_ops` registers them in place of PyTorch's CPU and CUDA kernels of ``aten::mm``,
``addmm``, ``bmm``, ``silu``, ``sigmoid``, ``_softmax`` and ``mean.dim`` (a ``torch.library`` registration,
counted: the last exit removes it); inside :func:`invariant_forward` (the trainer's forward through the Hugging Face
modules; the engine calls the ops directly) those kernels compute the invariant values, outside it they call
PyTorch's own (``.out`` overloads: the same kernels), so autograd's backward of the forward runs the fast products.
Attention is ``fastgrpo.kernels.batch_invariant_attention``, an MoE block's router and experts
``fastgrpo.kernels.batch_invariant_moe``; the LM head and log-probs are :func:`linear_logprobs` (trainer) and
:func:`logsumexp_tiles` (engine).

**On CUDA** the same functions run on CUDA tensors, and what makes them exact holds there unchanged: no step rests on
a kernel's summation order (every partial sum of an fp64 product of grid operands is exact, so cuBLAS's DGEMM gives
the same bits in any blocking, split-K or not; the other sums are exact or fixed loops of adds), the elementwise ops
are correctly rounded, and the transcendental ones must be position-independent on the device, which
:func:`self_check` verifies there (:func:`device_checked`: once per device and process, before the overrides are
registered). Two things are CUDA-specific: ``cumsum`` along the last dim is a tree scan whose association depends on
the number of rows (and one row takes CUB's scan), so the LM head's tiles are summed by :func:`ordered_sum`; and the
attention's running sum over big blocks is a ``cumsum`` over a middle dim, which CUDA computes left to right per
column (checked by :func:`self_check`).

Cost: an fp64 GEMM is about twice an fp32 one on AVX-512, and about 15x a bf16 one on an H100 / H200 (FP64 tensor
cores, about 60-67 TFLOP/s against about 990; a GPU without full-rate fp64 runs it at 1/64 of fp32's rate: a warning
at start-up), plus the grids: seven elementwise passes over an activation (:func:`to_grid`; the q, k and v
projections share their input's, as the gate and up do), none over a weight once its grid is kept
(:func:`keep_weight_grids`: made once per weight version and shared by the engine's call and the training forwards of
that version). Memory: the fp64 integer copy of an operand, 2x its fp32 bytes (the kept grids: 2x the fp32 weights,
4x bf16 ones; for DeepSeek-R1-Distill-Qwen-1.5B bf16 that is about 12 GiB, read by every decode step: about 3.8 ms at
an H100's 3.35 TB/s against about 1 ms for the bf16 weights). The attention costs more at long contexts
(``batch_invariant_attention``: about 4.3 KB of fp64 temporaries a key and row at the 1.5B heads, 18 GB a layer for
256 rows of 16K keys, and about 100K small ops a decode step there): from the bytes and the ops counted, about
0.1 s a decode step at 64 rows of 4K keys and about 1 s at 256 rows of 16K, against the weight grids' 3.8 ms
(estimates, not measured on a GPU). Which is why the mode is for verifying on-policy numerics on small and
mid-size models, not yet for the 1.5B run's speed; a persistent Triton matmul on the bf16 tensor cores with one
fixed tile schedule and no split-K (and an attention kernel over the fixed key blocks) is the cheaper path, future
work.

Shape legend: M rows, K reduced dim, N output columns, V vocabulary, C vocabulary tiles.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings

import torch

FP64_BITS = 53  # significand bits of fp64: integers below 2^53 are exact
VOCAB_TILE = 2048  # vocabulary columns per tile of the LM head's log-sum-exp (engine and trainer alike)
TILE_EXP_BITS = FP64_BITS - 11  # exp(z − m_c) ≤ 1 on a grid of 2^-42: 2048 of them sum exactly
INVARIANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # activations the overrides compute for
FP32_EXPONENT = 0x7F800000  # the exponent field of an fp32's bits: 2^⌊log₂ |x|⌋ once the rest is cleared
FP32_NORMAL = 0x00800000  # the bits of 2^-126, the smallest normal fp32
FP32_TOP = 0x7F000000  # the bits of 2^127: a slice holding inf or NaN takes the top binade's grid (c stays finite)
FULL_RATE_FP64 = ((6, 0), (7, 0), (8, 0), (9, 0), (10, 0))  # CUDA capabilities with fp64 at half fp32's rate or more

_local = threading.local()  # .active (a forward on the invariant ops), .last_input (_shared_input_grid's entry)
_registry = {"lib": None, "refs": 0}
CHECKED_DEVICES: set[str] = set()  # the devices whose self_check passed in this process (device_checked)
_kept_storages: dict[int, int] = {}  # storage address of a kept parameter -> open keep_weight_grids scopes
_kept_grids: dict[tuple, tuple] = {}  # (address, shape, strides, dtype) of a kept weight view -> (version, view, grid)


def product_bits(k: int) -> int:
    """Grid bits of each operand of a product over ``k`` terms: ``⌊(53 − ⌈log₂ k⌉) / 2⌋`` (exact sums)."""
    return (FP64_BITS - math.ceil(math.log2(max(k, 1)))) // 2


def to_grid(x: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """``x`` rounded onto a per-slice grid along ``dim`` (fp64): ``x̃ = u · round(x / u)`` (half to even) with the
    unit ``u = 2^(e − bits)``, ``2^(e−1) ≤ max|x| < 2^e`` over the slice (``e ≥ −125``: a slice below fp32's normal
    range takes that grid), so ``x̃ / u`` is an integer of at most ``bits`` bits (plus sign). ``x``: fp32, bf16 or
    fp16. A slice holding ±inf or NaN takes the grid of ``e = 128`` (fp32's top binade): those entries stay what they
    are and the finite ones round onto it, as PyTorch's sums would keep an inf (an unbounded ``c`` made the whole
    slice NaN).

    In seven passes: ``f = 2^(e−1)`` is ``max|x|``'s fp32 exponent bits (a mask), and adding then subtracting
    ``c = 1.5 · 2^52 · u`` rounds ``x`` (in fp64) to a multiple of ``u``: ``c + x`` lies in ``[2^52 u, 2^53 u)``,
    whose spacing is ``u``, and both steps are single correctly rounded fp64 operations (the second exact)."""
    top = x.abs().amax(dim, keepdim=True).float().view(torch.int32).bitwise_and_(FP32_EXPONENT).clamp_(
        min=FP32_NORMAL, max=FP32_TOP)
    c = top.view(torch.float32).double().mul_(1.5 * 2.0 ** (FP64_BITS - bits))  # 1.5 · 2^52 · u, u = 2f · 2^-bits
    return x.double().add_(c).sub_(c)


def grid_values(x: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`to_grid` over the last dim, in ``x``'s own dtype (exact for ``bits`` ≤ 24 in fp32, and in bf16: an
    entry of more than 8 significant bits is already on the grid): keys stored on their grid."""
    return to_grid(x, -1, min(bits, 24)).to(x.dtype)


def exact_matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *, bias: torch.Tensor | None = None,
                 a_grid: torch.Tensor | None = None, b_grid: torch.Tensor | None = None, alpha: float = 1.0,
                 beta: float = 1.0) -> torch.Tensor:
    """``alpha · (a @ b) + beta · bias`` cast to ``out_dtype``, the product exact on the operands' grids (rows of
    ``a [..., M, K]``, columns of ``b [..., K, N]``; module docstring): each entry depends on its row of ``a`` and
    column of ``b`` alone. ``a_grid`` / ``b_grid``: the operands' grids when the caller has them (an input shared by
    several products, a kept weight). The fp64 result ``[..., M, N]`` is the one temporary (8 bytes an entry) besides
    the grids."""
    bits = product_bits(a.shape[-1])
    a_tilde = a_grid if a_grid is not None else to_grid(a, -1, bits)
    b_tilde = b_grid if b_grid is not None else to_grid(b, -2, bits)
    out = torch.matmul(a_tilde, b_tilde)  # exact: every partial sum is on the grid, below 2^53 units
    if alpha != 1.0:
        out.mul_(alpha)
    if bias is not None:
        out.add_(bias, alpha=beta)
    return out.to(out_dtype)


def input_grid(x_MK: torch.Tensor) -> torch.Tensor:
    """The grid of ``x``'s rows as the left operand of :func:`exact_matmul` over its last dim."""
    return to_grid(x_MK, -1, product_bits(x_MK.shape[-1]))


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x / (1 + exp(−x))`` in fp32 (cast back to ``x``'s dtype): correctly rounded ops and ``exp``, so an
    element's value does not depend on where it sits (torch's fp32 silu kernel does: module docstring)."""
    xf = x.float()
    denominator = torch.neg(xf).exp_().add_(1.0)
    return torch.div(xf, denominator, out=denominator).to(x.dtype)  # in place: elementwise, no other reader


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(−x))`` in fp32 (cast back to ``x``'s dtype), for the reason :func:`silu` is: torch's fp32
    sigmoid kernel gives an element a value that depends on where it sits (a Qwen2-MoE shared expert's gate)."""
    denominator = torch.neg(x.float()).exp_().add_(1.0)
    return denominator.reciprocal_().to(x.dtype)


def ordered_sum(x_TK: torch.Tensor) -> torch.Tensor:
    """``((x_0 + x_1) + x_2) + …`` over the last dim, left to right (``[T]``): a fixed order whatever the shape and
    the device (one elementwise add per term)."""
    total = x_TK[..., 0]
    for k in range(1, x_TK.shape[-1]):
        total = total + x_TK[..., k]
    return total


def exact_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dim (keepdim, fp64): the row's terms on a grid of ``53 − ⌈log₂ n⌉`` bits below its
    largest, so the fp64 sum is exact in any order."""
    return to_grid(x, -1, FP64_BITS - math.ceil(math.log2(max(x.shape[-1], 1)))).sum(-1, keepdim=True)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """The softmax over the last dim in fp32: ``e = exp(x − max x)`` (position-independent ops) divided by its
    :func:`exact_sum` rounded to fp32 (an MoE router's probabilities, ``fastgrpo.kernels.batch_invariant_moe``)."""
    x32 = x.float()
    e = torch.exp(x32 - x32.amax(-1, keepdim=True))
    return e.div_(exact_sum(e).float())


def last_dim_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean over the last dim (keepdim), exact sum: each row's terms on a grid of ``53 − ⌈log₂ n⌉`` bits
    below its largest, summed in fp64 (exact in any order), divided by ``n`` and cast to ``x``'s dtype."""
    return (exact_sum(x) / x.shape[-1]).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# The LM head: logits, the log-sum-exp over fixed vocabulary tiles, log-probs
# ----------------------------------------------------------------------------------------------------------------


def weight_grid(weight_NK: torch.Tensor) -> torch.Tensor:
    """The grid of a weight as the right operand ``Wᵀ [K, N]`` of :func:`exact_matmul` (per output row ``n``): the kept
    one (:func:`keep_weight_grids`) when ``weight`` is a kept parameter, else made now."""
    kept = kept_grid(weight_NK.t())
    return kept if kept is not None else to_grid(weight_NK.t(), -2, product_bits(weight_NK.shape[1]))


def linear(x_MK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None, grid: torch.Tensor | None = None,
           x_grid: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + b`` by :func:`exact_matmul` (``grid``: :func:`weight_grid` of ``weight``, ``x_grid``:
    :func:`input_grid` of ``x``, when the caller has them)."""
    bias = None if bias_N is None else bias_N.double()
    return exact_matmul(x_MK, weight_NK.t(), out_dtype or x_MK.dtype, bias=bias, a_grid=x_grid, b_grid=grid)


def vocab_tile_stats(z_MC: torch.Tensor, inv_temp: float, entropy: bool = False):
    """One vocabulary tile's part of the log-sum-exp, per row (``[..., C]`` columns of the tile): with ``t = z ·
    inv_temp`` (fp32) its max ``m_c``, ``s_c = Σ_v round(exp(t_v − m_c) · 2^42)`` (exact in fp64: at most 2048 terms
    ≤ 2^42, so any order gives it) and, with ``entropy``, ``a_c = Σ_v exp(t_v − m_c) (t_v − m_c)`` (fp64, not needed
    bit for bit; else None). Returns ``(m_c fp32, s_c fp64, a_c)``, each ``[...]``."""
    t = z_MC * inv_temp
    m = t.amax(-1, keepdim=True)
    d = t - m
    e = torch.exp(d)
    s_c = (e * 2.0**TILE_EXP_BITS).double().round_().sum(-1)  # e · 2^42 exact in fp32 (a power of two)
    a_c = (e.double() * d.double()).sum(-1) if entropy else None
    return m.squeeze(-1), s_c, a_c


def combine_tiles(m_MC: torch.Tensor, s_MC: torch.Tensor, a_MC: torch.Tensor | None = None):
    """The tiles' parts (:func:`vocab_tile_stats`, tile ``c`` in column ``c``, always in vocabulary order) as
    ``lse = m + log S``, ``S = Σ_c g_c s_c 2^-42``, ``g_c = exp(m_c − m)``, ``m = max_c m_c``; the sum over tiles runs
    left to right (:func:`ordered_sum`: not ``cumsum``, which CUDA computes as a tree scan whose association
    depends on the number of rows), so the result depends on the tiles alone. With ``a``: also the entropy
    ``H = log S − Σ_c g_c (a_c + s_c 2^-42 (m_c − m)) / S`` (every term of the sum ≤ 0: no cancellation).
    Returns ``(lse fp32 [M], H fp32 [M] or None)``."""
    m_M = m_MC.amax(-1)
    shift_MC = m_MC.double() - m_M.double()[:, None]
    g_MC = torch.exp(shift_MC)
    mass_MC = s_MC * 2.0**-TILE_EXP_BITS
    total_M = ordered_sum(mass_MC * g_MC)
    lse_M = (m_M.double() + total_M.log()).float()
    if a_MC is None:
        return lse_M, None
    tilt_M = (g_MC * (a_MC + mass_MC * shift_MC)).sum(-1)
    return lse_M, (total_M.log() - tilt_M / total_M).float()


def logsumexp_tiles(logits_MV: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """``logsumexp(logits · inv_temp)`` per row over the fixed vocabulary tiles (the engine's sampled log-probs:
    the same numbers :func:`linear_logprobs` computes tile by tile from the hidden states). fp32 ``[M]``."""
    M, V = logits_MV.shape
    full = V // VOCAB_TILE * VOCAB_TILE
    parts = []
    if full:
        parts.append(vocab_tile_stats(logits_MV[:, :full].reshape(M, -1, VOCAB_TILE), inv_temp))
    if full < V:
        parts.append(tuple(x[:, None] for x in vocab_tile_stats(logits_MV[:, full:], inv_temp)[:2]))
    m_MC, s_MC = (torch.cat([part[i] for part in parts], 1) for i in range(2))
    return combine_tiles(m_MC, s_MC)[0]


def token_logprobs(logits_MV: torch.Tensor, tokens_M: torch.Tensor, inv_temp: float,
                   lse_M: torch.Tensor) -> torch.Tensor:
    """``logits[token] · inv_temp − lse`` (fp32 ``[M]``): the same ops as :func:`linear_logprobs`' target term."""
    return logits_MV.gather(1, tokens_M[:, None]).squeeze(1) * inv_temp - lse_M


ROWS_PER_CHUNK = 1024  # hidden rows per chunk of linear_logprobs (bounds the fp64 grid copies: 8 bytes · H each)


def linear_logprobs(h_NH: torch.Tensor, w_VH: torch.Tensor, b_V: torch.Tensor | None, y_N: torch.Tensor,
                    inv_temp: float, entropy: bool):
    """The trainer's log-probs of targets ``y`` under ``softmax((h Wᵀ + b) · inv_temp)``, bit for bit the engine's:
    logits by :func:`linear` (fp32), one vocabulary tile at a time, the tiles' parts combined by
    :func:`combine_tiles`, the target's logit read from its tile (the value the engine's sampled row holds).
    Returns ``(logp [N], lse [N], entropy [N] or None)`` fp32. Memory: per chunk of ``ROWS_PER_CHUNK`` rows one
    ``[rows, VOCAB_TILE]`` fp64 logit tile, the hidden rows' grid, and ``[rows, C]`` tile parts; the weight's grid:
    the kept one's columns (:func:`keep_weight_grids`: the engine's LM head made it) or one tile's at a time
    (``[H, VOCAB_TILE]`` fp64). Nothing of ``[N, V]``."""
    N, V = h_NH.shape[0], w_VH.shape[0]
    C = -(-V // VOCAB_TILE)
    kept_HV = kept_grid(w_VH.t())
    logp_N, lse_N = (h_NH.new_empty(N, dtype=torch.float32) for _ in range(2))
    ent_N = h_NH.new_empty(N, dtype=torch.float32) if entropy else None
    for n0 in range(0, N, ROWS_PER_CHUNK):
        h_nH, y_n = h_NH[n0 : n0 + ROWS_PER_CHUNK], y_N[n0 : n0 + ROWS_PER_CHUNK]
        n = h_nH.shape[0]
        h_grid = input_grid(h_nH)
        m_nC, s_nC, a_nC = (h_NH.new_empty(n, C, dtype=dt) for dt in (torch.float32, torch.float64, torch.float64))
        zy_n = h_NH.new_zeros(n, dtype=torch.float32)
        for c in range(C):
            v0, v1 = c * VOCAB_TILE, min((c + 1) * VOCAB_TILE, V)
            z_nv = linear(h_nH, w_VH[v0:v1], None if b_V is None else b_V[v0:v1], out_dtype=torch.float32,
                          grid=None if kept_HV is None else kept_HV[:, v0:v1], x_grid=h_grid)
            inside = (y_n >= v0) & (y_n < v1)
            zy_n = torch.where(inside, z_nv.gather(1, (y_n - v0).clamp(0, v1 - v0 - 1)[:, None]).squeeze(1), zy_n)
            m_nC[:, c], s_nC[:, c], a_c = vocab_tile_stats(z_nv, inv_temp, entropy)
            if entropy:
                a_nC[:, c] = a_c
        lse_n, ent_n = combine_tiles(m_nC, s_nC, a_nC if entropy else None)
        lse_N[n0 : n0 + n] = lse_n
        logp_N[n0 : n0 + n] = zy_n * inv_temp - lse_n
        if entropy:
            ent_N[n0 : n0 + n] = ent_n
    return logp_N, lse_N, ent_N


# ----------------------------------------------------------------------------------------------------------------
# The overrides of PyTorch's CPU and CUDA kernels, and their scopes
# ----------------------------------------------------------------------------------------------------------------


def active() -> bool:
    """Whether the calling thread runs a model forward under the invariant ops (:func:`invariant_forward`)."""
    return getattr(_local, "active", False)


def enabled() -> bool:
    """Whether the overrides are registered (:func:`invariant_ops`): the trainer's log-prob kernels then take
    :func:`linear_logprobs` (``fastgrpo.kernels.linear_logprobs``)."""
    return _registry["refs"] > 0


@contextlib.contextmanager
def keep_weight_grids(params):
    """Keep the grids of these parameters (their products' right operands, :func:`kept_grid`) while the scope is open
    (counted per storage: nested scopes share them; the last exit drops them): made at a weight's first product and
    made again when its version counter has moved (every in-place write autograd tracks: torch's optimizers but the
    fused ones, ``copy_``, checkpoint loads; not writes through ``.data``). The trainer keeps its policy's for its
    run, so the engine's call and the training forwards of one weight version share them; an engine alone keeps them
    for its call. Memory: an fp64 copy of each weight used in a product (2x its fp32 bytes).

    A parameter that is a tensor subclass holds no storage of its own and is skipped: FSDP2's sharded ``DTensor``
    parameters. Their gathered weights are freed at each reshard and written again at the next gather, possibly at
    the same address and with the same version counter (FSDP2 preserves it), so a scope over gathered weights must
    close inside the gather that made them, as the engine's call does (``full_weights`` around ``generate`` and
    around each session run); a training forward makes each gathered weight's grid at its product."""
    ptrs = [p.untyped_storage().data_ptr() for p in params if _owns_storage(p)]
    for ptr in ptrs:
        _kept_storages[ptr] = _kept_storages.get(ptr, 0) + 1
    try:
        yield
    finally:
        for ptr in ptrs:
            _kept_storages[ptr] -= 1
            if not _kept_storages[ptr]:
                del _kept_storages[ptr]
                for key in [key for key, (_, b, _) in _kept_grids.items() if b.untyped_storage().data_ptr() == ptr]:
                    del _kept_grids[key]


def held_grid_bytes(params) -> int:
    """Bytes of the grids :func:`kept_grid` holds now for views of these parameters (made at a product while their
    scope is open; one a weight, of whichever version it was last made for)."""
    ptrs = {p.untyped_storage().data_ptr() for p in params if _owns_storage(p)}
    return sum(grid.numel() * grid.element_size() for _, b, grid in _kept_grids.values()
               if b.untyped_storage().data_ptr() in ptrs)


def _owns_storage(p: torch.Tensor) -> bool:
    """A plain tensor or parameter (not a subclass such as FSDP2's ``DTensor``, whose storage is not its data)."""
    return type(p) in (torch.Tensor, torch.nn.Parameter)


def kept_grid(b_KN: torch.Tensor) -> torch.Tensor | None:
    """The grid of ``b`` (per column over ``K``) when ``b`` is a view of a kept parameter (:func:`keep_weight_grids`),
    made once per version of it; else None. An entry holds ``b``, so its storage (the key) cannot be reused."""
    if b_KN.untyped_storage().data_ptr() not in _kept_storages:
        return None
    key = (b_KN.data_ptr(), tuple(b_KN.shape), b_KN.stride(), b_KN.dtype)
    entry = _kept_grids.get(key)
    if entry is None or entry[0] != b_KN._version:
        entry = _kept_grids[key] = (b_KN._version, b_KN, to_grid(b_KN, -2, product_bits(b_KN.shape[0])))
    return entry[2]


def _shared_input_grid(a_MK: torch.Tensor) -> torch.Tensor:
    """:func:`input_grid` of a product's left operand, reused by the next products of the same tensor (the q, k and v
    projections of one normed input, the gate and up of the MLP's, a LoRA adapter's ``A`` after its base): one entry,
    keyed by the tensor's address, shape, strides, dtype and version, holding the tensor (its storage cannot be
    reused while the entry lives); dropped when the forward scope ends. Inference tensors (no version) are not kept."""
    if a_MK.is_inference():
        return input_grid(a_MK)
    key = (a_MK.data_ptr(), tuple(a_MK.shape), a_MK.stride(), a_MK.dtype, a_MK._version)
    last = getattr(_local, "last_input", None)
    if last is None or last[0] != key:
        last = _local.last_input = (key, a_MK, input_grid(a_MK))
    return last[2]


def _computes(t: torch.Tensor) -> bool:
    return active() and t.dtype in INVARIANT_DTYPES


def _mm(a, b):
    if _computes(a):
        return exact_matmul(a, b, a.dtype, a_grid=_shared_input_grid(a), b_grid=kept_grid(b))
    return torch.ops.aten.mm.out(a, b, out=a.new_empty((a.shape[0], b.shape[1])))


def _addmm(bias, a, b, *, beta=1, alpha=1):
    if _computes(a):
        return exact_matmul(a, b, a.dtype, bias=bias.double(), a_grid=_shared_input_grid(a), b_grid=kept_grid(b),
                            alpha=alpha, beta=beta)
    return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=a.new_empty((a.shape[0], b.shape[1])))


def _bmm(a, b):
    if _computes(a):
        return exact_matmul(a, b, a.dtype)
    return torch.ops.aten.bmm.out(a, b, out=a.new_empty((a.shape[0], a.shape[1], b.shape[2])))


def _silu(x):
    if _computes(x):
        return silu(x)
    return torch.ops.aten.silu.out(x, out=torch.empty_like(x))


def _sigmoid(x):
    if _computes(x):
        return sigmoid(x)
    return torch.ops.aten.sigmoid.out(x, out=torch.empty_like(x))


def _softmax(x, dim, half_to_float):
    out_dtype = torch.float32 if half_to_float else x.dtype
    if _computes(x):
        if dim % x.dim() != x.dim() - 1:
            raise NotImplementedError(f"numerics.batch_invariant: aten::_softmax over dim {dim} is not "
                                      "batch-invariant; only the last dim is (an MoE router)")
        return softmax(x).to(out_dtype)
    return torch.ops.aten._softmax.out(x, dim, half_to_float, out=x.new_empty(x.shape, dtype=out_dtype))


def _mean_dim(x, dim, keepdim=False, *, dtype=None):
    if _computes(x):
        dims = [d % x.dim() for d in (dim if dim is not None else range(x.dim()))]
        if dims != [x.dim() - 1] or dtype not in (None, x.dtype):
            raise NotImplementedError(f"numerics.batch_invariant: aten::mean over dims {dim} (dtype {dtype}) is not "
                                      "batch-invariant; only the last dim is (RMSNorm)")
        out = last_dim_mean(x)
        return out if keepdim else out.squeeze(-1)
    out_dtype = dtype or x.dtype
    return torch.ops.aten.mean.out(x, dim, keepdim, dtype=dtype, out=x.new_empty(0, dtype=out_dtype))


OVERRIDES = {"mm": _mm, "addmm": _addmm, "bmm": _bmm, "silu": _silu, "sigmoid": _sigmoid, "_softmax": _softmax,
             "mean.dim": _mean_dim}


OVERRIDDEN_KEYS = ("CPU", "CUDA")  # the dispatch keys whose kernels the overrides replace


@contextlib.contextmanager
def invariant_ops(device: torch.device | str = "cpu"):
    """Register the invariant kernels in place of PyTorch's CPU and CUDA ``aten::mm``, ``addmm``, ``bmm``, ``silu``,
    ``sigmoid``, ``_softmax`` and ``mean.dim`` (counted: nested and repeated scopes share one registration; the
    last exit removes it). ``device``: where the mode runs, checked first (:func:`device_checked`: once per device
    and process). Outside :func:`invariant_forward` they call PyTorch's kernels (about 7 µs more a call)."""
    device_checked(device)
    if _registry["refs"] == 0:
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "overriding a previously registered kernel": the point
            warnings.simplefilter("ignore")
            for name, fn in OVERRIDES.items():
                for key in OVERRIDDEN_KEYS:
                    lib.impl(name, fn, key)
        _registry["lib"] = lib
    _registry["refs"] += 1
    try:
        yield
    finally:
        _registry["refs"] -= 1
        if _registry["refs"] == 0:
            _registry["lib"]._destroy()
            _registry["lib"] = None


@contextlib.contextmanager
def invariant_forward():
    """Run a model forward on the invariant ops (inside :func:`invariant_ops`): products of kept weights
    (:func:`keep_weight_grids`) read their kept grids, the others make theirs at each product."""
    if not enabled():
        raise RuntimeError("invariant_forward needs the invariant ops registered (invariant_ops())")
    saved = active()
    _local.active = True
    try:
        yield
    finally:
        _local.active = saved
        if not saved:
            _local.last_input = None


def checkpoint_contexts():
    """``torch.utils.checkpoint``'s ``context_fn`` (called at the forward): the backward's recompute runs on the
    invariant ops when the forward did (:func:`active`), so it recomputes the forward's very values and saves the same
    tensors (an MoE router chooses the same experts); otherwise neither context does anything. Returns the
    (forward, recompute) contexts."""
    return contextlib.nullcontext(), invariant_forward() if active() else contextlib.nullcontext()


def forward_scope():
    """The scope of the trainer's packed forward: :func:`invariant_forward` while the invariant ops are registered
    (the trainer's ``numerics.batch_invariant``), else nothing."""
    return invariant_forward() if enabled() else contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------------------------
# The start-up check
# ----------------------------------------------------------------------------------------------------------------


def device_checked(device: torch.device | str) -> None:
    """:func:`self_check` on ``device``, once per device and process (what it checks does not change; the devices
    checked are ``CHECKED_DEVICES``): CUDA's ``exp``, ``log``, fp64 GEMM and ``cumsum`` are other code than the CPU's,
    so each device is checked where the mode runs on it. A CUDA device without full-rate fp64 (consumer GPUs run it
    at 1/64 of fp32's rate) warns: the mode's products are fp64 GEMMs. The check runs on one CPU thread (a tiny
    multi-threaded fp64 gemv can take 40 ms on a loaded 2-core host, and nothing it checks depends on the threads)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if str(device) in CHECKED_DEVICES:
        return
    if device.type == "cuda" and torch.cuda.get_device_capability(device) not in FULL_RATE_FP64:
        warnings.warn(f"numerics.batch_invariant on {torch.cuda.get_device_name(device)}: its fp64 GEMMs run at a "
                      "small fraction of the fp32 rate on this GPU (A100 / H100 / H200 run them at half or more), so "
                      "the mode is far slower here", stacklevel=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        self_check(device)
    finally:
        torch.set_num_threads(threads)
    CHECKED_DEVICES.add(str(device))


def self_check(device: torch.device | str = "cpu") -> None:
    """What the mode rests on, checked on ``device`` (a few milliseconds); raises ``RuntimeError`` naming the
    property that fails, so the mode is refused rather than silently not invariant:

    - fp64 GEMM is exact on integer operands whose sums stay below 2^53 (against int64 products computed on the
      CPU), single rows (gemv), whole matrices, batches and a long reduction (K = 4096, where cuBLAS may split K)
      alike;
    - fp32 ``exp``, ``cos``, ``sin``, ``rsqrt`` and fp64 ``exp``, ``log`` give an element the same value wherever
      it sits in the tensor (offsets and lengths that move it between SIMD body and tail, or between a CUDA kernel's
      vectorised and unaligned paths);
    - ``cumsum`` over a middle dim sums left to right (the order the attention's big blocks are added in)."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)  # drawn on the CPU, moved to the device: the same inputs everywhere
    for K in (5, 64, 300, 4096):
        bits = product_bits(K)
        a = torch.randint(-(2**bits), 2**bits + 1, (9, K), generator=gen, device="cpu")
        b = torch.randint(-(2**bits), 2**bits + 1, (K, 7), generator=gen, device="cpu")
        want = torch.mm(a, b).double()
        a, b = a.double().to(dev), b.double().to(dev)
        got = [torch.mm(a, b), torch.bmm(a.expand(3, 9, K), b.expand(3, K, 7))[1]]
        got += [torch.mm(a[i : i + 1], b) for i in (0, 8)]  # single rows: a gemv
        want = [want, want, want[:1], want[8:]]
        if not all(torch.equal(g.cpu(), w) for g, w in zip(got, want)):
            raise RuntimeError(f"numerics.batch_invariant refused: fp64 GEMM on {dev} is not exact on integer "
                               f"operands (K={K}); the invariant products rest on it")
    x = (torch.randn(1031, generator=gen, device="cpu") * 8).to(dev)
    checks = {"exp": (torch.exp, x), "cos": (torch.cos, x), "sin": (torch.sin, x),
              "rsqrt": (torch.rsqrt, x.abs() + 1e-3), "exp fp64": (torch.exp, x.double()),
              "log fp64": (torch.log, x.double().abs() + 1e-3)}
    for name, (fn, t) in checks.items():
        whole = fn(t)
        for start, length in ((0, 1), (3, 17), (5, 64), (1, 1029), (512, 519), (77, 33)):
            if not torch.equal(fn(t[start : start + length]), whole[start : start + length]):
                raise RuntimeError(f"numerics.batch_invariant refused: torch's {name} on {dev} gives an element "
                                   "a value that depends on its position in the tensor")
    scales = torch.logspace(-8, 8, 40, dtype=torch.float64, device="cpu")[:, None]
    terms = torch.randn(2, 40, 3, generator=gen, dtype=torch.float64, device="cpu") * scales
    seq = terms[:, 0].clone()
    for i in range(1, terms.shape[1]):
        seq = seq + terms[:, i]
    if not torch.equal(terms.to(dev).cumsum(1)[:, -1].cpu(), seq):
        raise RuntimeError(f"numerics.batch_invariant refused: torch's cumsum on {dev} does not sum left to right")
