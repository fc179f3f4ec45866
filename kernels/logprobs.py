"""Selective log-softmax: the log-prob of each target token (and the entropy) straight from the logits.

With ``z = logits / T`` over a vocabulary of V entries, per row (token) ``i`` with target ``y_i``::

    lse_i  = log Σ_v exp(z_iv)
    logp_i = z_iy − lse_i
    H_i    = −Σ_v p_iv log p_iv = lse_i − Σ_v p_iv z_iv,        p_iv = exp(z_iv − lse_i)

Gradients, for upstream gradients ``g_i = ∂L/∂logp_i`` and ``h_i = ∂L/∂H_i``::

    ∂logp_i/∂z_ij = [j = y_i] − p_ij
    ∂H_i/∂z_ij    = −p_ij (log p_ij + H_i)
    ∂L/∂logits_ij = (g_i ([j = y_i] − p_ij) − h_i p_ij (log p_ij + H_i)) / T

The entropy gradient follows from ``∂p_ik/∂z_ij = p_ik ([k = j] − p_ij)``:
``∂H/∂z_j = −Σ_k (log p_k + 1) p_k ([k = j] − p_j) = −p_j (log p_j + 1) + p_j (1 − H) = −p_j (log p_j + H)``.

The eager composition ``log_softmax(logits.float() / T).gather(...)`` materialises fp32 ``[N, V]`` tensors
(several with the entropy and in backward). Here the forward streams over the vocabulary once per row and keeps
only the LSE (fp32 ``[N]``) for the backward, which recomputes ``p`` block by block; with
``inplace_backward=True`` the gradient overwrites the logits buffer, so forward + backward need no logits-sized
allocation at all. Logits with ``-inf`` entries (masked tokens) give ``p = 0`` there, a zero gradient, and no
entropy contribution.

Paths (``kernels/utils.use_triton``): the Triton kernels on CUDA and under ``TRITON_INTERPRET=1``; otherwise a
plain-torch path chunked over rows (about ``_CPU_CHUNK_BYTES`` of fp32 per chunk), forward and backward, with the
same results and the same ``inplace_backward`` behaviour.

Shape legend: N rows (tokens; ``B·T`` for padded input), V vocabulary, C rows of one CPU chunk.
"""

from __future__ import annotations

import numbers

import torch

from .utils import FLOAT_DTYPES, HAS_TRITON, check_shape, check_targets, check_tensor, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

# fp32 bytes of one row chunk on the torch path. Smaller chunks stay in cache (8 MiB ran fastest on an idle core),
# but each op on a chunk is one multi-threaded region whose barrier costs a scheduler time slice when the CPU is
# oversubscribed; 32 MiB keeps the region count low while the temporaries stay far below N·V.
_CPU_CHUNK_BYTES = 32 << 20
_LOG_P_FLOOR = -1e4  # log p is clamped here: p = e^{log p} is already 0 in fp32, and 0 · log p stays 0 for −inf logits


def _launch_config(V: int, element_size: int) -> tuple[int, int, int]:
    """(BLOCK_V, VEC, num_warps) for both kernels: up to 4096 vocabulary entries per step, in groups of VEC that
    fill one 16-byte load; 8 warps give each thread two such loads in bf16. Small programs leave room for several
    per SM, whose independent loops overlap their loads (compiled offline for sm_90: no spills, about 8 instructions
    per entry in the forward loop, 10 in the backward's). The loads vectorize when V and the row strides are
    multiples of 16, which Triton detects (real vocabularies: 32000, 128256, 151936)."""
    vec = 16 // element_size
    block_v = max(vec, min(triton.next_power_of_2(V), 4096))
    num_warps = max(1, min(8, block_v // 512))
    return block_v, vec, num_warps


if HAS_TRITON:
    _M_INIT = tl.constexpr(-1e30)  # running-max start: finite, so −inf logits never give (−inf) − (−inf) = nan
    _LOG2E = tl.constexpr(1.4426950408889634)  # e^u = 2^{u log2 e}: exp2 is the hardware instruction

    # Per row: reads V logits once, the target id and the target's logit; writes logp, lse (and H): 3 floats.
    @triton.jit
    def _logprobs_fwd_kernel(
        logits_ptr,
        targets_ptr,
        logp_ptr,
        entropy_ptr,
        lse_ptr,
        T,
        stride_b,
        stride_t,
        V,
        inv_temperature,
        RETURN_ENTROPY: tl.constexpr,
        BLOCK_V: tl.constexpr,
        VEC: tl.constexpr,
    ):
        # Online log-sum-exp, kept per group of VEC adjacent entries (one 16-byte load, held by one thread) so the
        # loop reduces only within a thread. Group r sees the raw logits x = logits[k·BLOCK_V + r·VEC + c] and keeps
        # m = their running max, s = Σ e^{τ(x−m)}, w = Σ e^{τ(x−m)} (x − m), with τ = 1/T (the max of x is the max
        # of z = τx, so the loop never scales x by τ separately). A block moves the max to m' and rescales the old
        # terms by e^{τ(m−m')} (shifting x − m by m − m'):
        #   s' = e^{τ(m−m')} s + Σ e^{τ(x−m')},   w' = e^{τ(m−m')} (w + (m − m') s) + Σ e^{τ(x−m')} (x − m').
        # The groups merge once at the end: M = max m, S = Σ s e^{τ(m−M)}, W = Σ e^{τ(m−M)} (w + (m − M) s);
        # lse = τM + log S and H = lse − Σ p z = log S − τW / S (no cancellation against the size of M).
        GROUPS: tl.constexpr = BLOCK_V // VEC
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + (row // T) * stride_b + (row % T) * stride_t
        offs = tl.arange(0, GROUPS)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [GROUPS, VEC]
        c = inv_temperature * _LOG2E  # e^{τu} = 2^{cu}
        m = tl.full((GROUPS,), _M_INIT, tl.float32)
        s = tl.zeros((GROUPS,), tl.float32)
        w = tl.zeros((GROUPS,), tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            scale = tl.exp2((m - m_new) * c)
            x_shift = x - m_new[:, None]
            e = tl.exp2(x_shift * c)  # 0 on masked lanes and −inf logits
            if RETURN_ENTROPY:
                x_shift = tl.where(e > 0.0, x_shift, 0.0)  # keeps 0 · (−∞) out
                w = scale * (w + (m - m_new) * s) + tl.sum(e * x_shift, axis=1)
            s = s * scale + tl.sum(e, axis=1)
            m = m_new
        m_row = tl.max(m, axis=0)
        scale = tl.exp2((m - m_row) * c)  # 0 on groups that saw no finite logit (their s = w = 0)
        s_row = tl.sum(s * scale, axis=0)
        log_s = tl.log(s_row)
        target = tl.load(targets_ptr + row).to(tl.int64)
        x_target = tl.load(row_ptr + target).to(tl.float32)
        tl.store(logp_ptr + row, (x_target - m_row) * inv_temperature - log_s)  # not z − lse: no rounding of lse
        tl.store(lse_ptr + row, m_row * inv_temperature + log_s)
        if RETURN_ENTROPY:
            w_row = tl.sum(scale * (w + (m - m_row) * s), axis=0)
            tl.store(entropy_ptr + row, log_s - inv_temperature * w_row / s_row)

    # Per row: reads V logits, lse, the target id, g (and H, h); writes V gradient entries (possibly over the
    # logits themselves: each block is read before it is written, by the same program).
    @triton.jit
    def _logprobs_bwd_kernel(
        logits_ptr,
        grad_ptr,
        targets_ptr,
        lse_ptr,
        entropy_ptr,
        grad_logp_ptr,
        grad_entropy_ptr,
        T,
        stride_b,
        stride_t,
        grad_stride_b,
        grad_stride_t,
        V,
        inv_temperature,
        HAS_GRAD_LOGP: tl.constexpr,
        HAS_GRAD_ENTROPY: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # grad_j = g' ([j = y] − p_j) − h' p_j (log p_j + H) with g' = g / T, h' = h / T and log p_j = z_j − lse,
        # recomputed per block.
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + (row // T) * stride_b + (row % T) * stride_t
        grad_row_ptr = grad_ptr + (row // T) * grad_stride_b + (row % T) * grad_stride_t
        offs = tl.arange(0, BLOCK_V)
        lse = tl.load(lse_ptr + row)
        c = inv_temperature * _LOG2E  # p = e^{τx − lse} = 2^{cx − lse log2 e}
        lse2 = lse * _LOG2E
        if HAS_GRAD_LOGP:
            g = tl.load(grad_logp_ptr + row).to(tl.float32) * inv_temperature
            target = tl.load(targets_ptr + row).to(tl.int32)  # < V: compared with int32 columns
        if HAS_GRAD_ENTROPY:
            h = tl.load(grad_entropy_ptr + row).to(tl.float32) * inv_temperature
            entropy = tl.load(entropy_ptr + row)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            p = tl.exp2(x * c - lse2)  # −inf on masked lanes: p = 0 there, nothing overflows
            grad = tl.zeros((BLOCK_V,), tl.float32)
            if HAS_GRAD_LOGP:
                grad = g * (tl.where(cols == target, 1.0, 0.0) - p)
            if HAS_GRAD_ENTROPY:
                log_p = x * inv_temperature - lse
                grad -= h * p * tl.where(p > 0.0, log_p + entropy, 0.0)
            tl.store(grad_row_ptr + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < V)


def _row_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(T, stride_b, stride_t) such that row ``r`` starts at ``(r // T) * stride_b + (r % T) * stride_t``."""
    if x.dim() == 2:
        return x.shape[0], 0, x.stride(0)
    return x.shape[1], x.stride(0), x.stride(1)


def _triton_forward(logits, targets_N, inv_temperature, return_entropy):
    N, V = targets_N.numel(), logits.shape[-1]
    logp_N = torch.empty(N, dtype=torch.float32, device=logits.device)
    lse_N = torch.empty_like(logp_N)
    entropy_N = torch.empty_like(logp_N) if return_entropy else None
    T, stride_b, stride_t = _row_strides(logits)
    block_v, vec, num_warps = _launch_config(V, logits.element_size())
    _logprobs_fwd_kernel[(N,)](
        logits, targets_N, logp_N, entropy_N if return_entropy else lse_N, lse_N,
        T, stride_b, stride_t, V, inv_temperature,
        RETURN_ENTROPY=return_entropy, BLOCK_V=block_v, VEC=vec, num_warps=num_warps,
    )
    return logp_N, entropy_N, lse_N


def _triton_backward(logits, grad, targets_N, lse_N, entropy_N, grad_logp_N, grad_entropy_N, inv_temperature):
    N, V = targets_N.numel(), logits.shape[-1]
    T, stride_b, stride_t = _row_strides(logits)
    _, grad_stride_b, grad_stride_t = _row_strides(grad)
    block_v, _, num_warps = _launch_config(V, logits.element_size())
    has_g, has_h = grad_logp_N is not None, grad_entropy_N is not None
    _logprobs_bwd_kernel[(N,)](
        logits, grad, targets_N, lse_N,
        entropy_N if has_h else lse_N, grad_logp_N if has_g else lse_N, grad_entropy_N if has_h else lse_N,
        T, stride_b, stride_t, grad_stride_b, grad_stride_t, V, inv_temperature,
        HAS_GRAD_LOGP=has_g, HAS_GRAD_ENTROPY=has_h, BLOCK_V=block_v, num_warps=num_warps,
    )


def _row_blocks(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """2-D ``[n, V]`` views covering the rows of each tensor in the same order and the same pieces: the whole
    ``[N, V]``, or one piece per sequence when some ``[B, T, V]`` tensor has gaps (e.g. ``logits[:, :-1]``)."""
    if tensors[0].dim() == 2:
        return [tensors]
    try:
        return [tuple(t.view(-1, t.shape[-1]) for t in tensors)]
    except RuntimeError:  # row strides that do not flatten
        return list(zip(*(t.unbind(0) for t in tensors)))


def _chunk_rows(V: int) -> int:
    return max(1, _CPU_CHUNK_BYTES // (4 * V))


def _row_chunks(*tensors: torch.Tensor):
    """Yield ``(rows, chunks_CV)``: a slice of the flat row index and the matching ``[C, V]`` view of each tensor,
    ``C`` rows holding about ``_CPU_CHUNK_BYTES`` of fp32."""
    step = _chunk_rows(tensors[0].shape[-1])
    first = 0
    for blocks in _row_blocks(*tensors):
        n = blocks[0].shape[0]
        for start in range(0, n, step):
            stop = min(start + step, n)
            yield slice(first + start, first + stop), tuple(b[start:stop] for b in blocks)
        first += n


def _workspace(logits: torch.Tensor, needed: bool = True) -> torch.Tensor | None:
    """An fp32 ``[C, V]`` buffer that every chunk reuses (sliced to its rows), allocated once per call: allocating
    per chunk lets glibc keep several freed chunk-sized blocks resident."""
    if not needed:
        return None
    V = logits.shape[-1]
    return torch.empty(min(_chunk_rows(V), logits.numel() // V), V, dtype=torch.float32, device=logits.device)


def _forward_chunk(chunk_CV, targets_C, inv_temperature, return_entropy, buf_a, buf_b):
    """(logp, lse, entropy or None) of one chunk, in the two workspace buffers ``buf_a`` (z, then p) and ``buf_b``.

    ``lse = max z − max log p`` (the largest log-prob sits at the largest logit and equals ``−log Σ e^{z−m}``): two
    cheap ``amax`` reductions instead of a second exp pass, finite with ``−inf`` logits.
    """
    C = chunk_CV.shape[0]
    if chunk_CV.dtype != torch.float32:
        z_CV = buf_a[:C].copy_(chunk_CV)  # upcast first: bf16 · (1/T) would round in bf16
        if inv_temperature != 1.0:
            z_CV.mul_(inv_temperature)
    elif inv_temperature != 1.0:
        z_CV = torch.mul(chunk_CV, inv_temperature, out=buf_a[:C])
    else:
        z_CV = chunk_CV  # read only
    logp_all_CV = torch.log_softmax(z_CV, dim=-1, out=buf_b[:C])
    lse_C = z_CV.amax(dim=-1) - logp_all_CV.amax(dim=-1)
    logp_C = logp_all_CV.gather(1, targets_C[:, None]).squeeze(1)
    entropy_C = None
    if return_entropy:
        p_CV = torch.exp(logp_all_CV, out=buf_a[:C])
        entropy_C = -p_CV.mul_(logp_all_CV.clamp_(min=_LOG_P_FLOOR)).sum(dim=-1)
    return logp_C, lse_C, entropy_C


def _torch_forward(logits, targets_N, inv_temperature, return_entropy):
    """The forward on the torch path, a chunk of rows at a time (see :func:`_forward_chunk`)."""
    N = targets_N.numel()
    logp_N = torch.empty(N, dtype=torch.float32, device=logits.device)
    lse_N = torch.empty_like(logp_N)
    entropy_N = torch.empty_like(logp_N) if return_entropy else None
    scaled = logits.dtype != torch.float32 or inv_temperature != 1.0
    buf_a, buf_b = _workspace(logits, scaled or return_entropy), _workspace(logits)
    for rows, (chunk_CV,) in _row_chunks(logits):
        logp_N[rows], lse_N[rows], entropy_C = _forward_chunk(chunk_CV, targets_N[rows], inv_temperature,
                                                              return_entropy, buf_a, buf_b)
        if return_entropy:
            entropy_N[rows] = entropy_C
    return logp_N, entropy_N, lse_N


def _backward_chunk(chunk_CV, grad_CV, targets_C, lse_C, entropy_C, g_C, h_C, inv_temperature, buf_a, buf_b):
    """Write one chunk of ``grad = p · (h' log p + c') + (g / T) onehot(y)``, ``h' = −h / T``, ``c' = −(h H + g) / T``.

    ``log p`` is built in ``grad_CV`` itself when it is fp32 (else in ``buf_b``), ``p`` in ``buf_a`` when the entropy
    term needs both.
    """
    C = chunk_CV.shape[0]
    work = grad_CV if grad_CV.dtype == torch.float32 else buf_b[:C]
    log_p_CV = torch.add(-lse_C[:, None], chunk_CV, alpha=inv_temperature, out=work)  # z − lse, fp32
    g_C1 = None if g_C is None else g_C[:, None]
    if h_C is None:
        out_CV = log_p_CV.exp_().mul_(-inv_temperature * g_C1)
    else:
        h_C1 = h_C[:, None]
        c_C1 = h_C1 * entropy_C[:, None] + (0.0 if g_C1 is None else g_C1)
        p_CV = torch.exp(log_p_CV, out=buf_a[:C])
        out_CV = log_p_CV.clamp_(min=_LOG_P_FLOOR).mul_(-inv_temperature * h_C1)
        out_CV.sub_(inv_temperature * c_C1).mul_(p_CV)
    if g_C1 is not None:
        out_CV.scatter_add_(1, targets_C[:, None], inv_temperature * g_C1)
    if out_CV is not grad_CV:
        grad_CV.copy_(out_CV)


def _torch_backward(logits, grad, targets_N, lse_N, entropy_N, grad_logp_N, grad_entropy_N, inv_temperature):
    """The backward on the torch path, a chunk of rows at a time from the saved LSE (see :func:`_backward_chunk`)."""
    buf_a, buf_b = _workspace(logits, grad_entropy_N is not None), _workspace(logits, grad.dtype != torch.float32)
    for rows, (chunk_CV, grad_CV) in _row_chunks(logits, grad):
        _backward_chunk(chunk_CV, grad_CV, targets_N[rows], lse_N[rows],
                        None if entropy_N is None else entropy_N[rows],
                        None if grad_logp_N is None else grad_logp_N[rows],
                        None if grad_entropy_N is None else grad_entropy_N[rows], inv_temperature, buf_a, buf_b)


class _LogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets_N, temperature, return_entropy, inplace_backward):
        inv_temperature = 1.0 / temperature
        triton_path = use_triton(logits)
        forward = _triton_forward if triton_path else _torch_forward
        logp_N, entropy_N, lse_N = forward(logits, targets_N, inv_temperature, return_entropy)
        ctx.save_for_backward(logits, targets_N, lse_N, entropy_N)
        ctx.inv_temperature = inv_temperature
        ctx.triton_path = triton_path
        ctx.inplace_backward = inplace_backward
        ctx.logits_overwritten = False
        ctx.set_materialize_grads(False)
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N, grad_entropy_N):
        if grad_logp_N is None and grad_entropy_N is None:
            return None, None, None, None, None
        if ctx.logits_overwritten:
            raise RuntimeError(
                "logprobs_from_logits(inplace_backward=True): the logits were overwritten by the first backward; "
                "a second backward through the same graph needs inplace_backward=False"
            )
        logits, targets_N, lse_N, entropy_N = ctx.saved_tensors
        if ctx.inplace_backward:
            grad = logits
            ctx.logits_overwritten = True
        else:
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_logp_N, grad_entropy_N = (None if t is None else t.float().contiguous()
                                       for t in (grad_logp_N, grad_entropy_N))
        backward = _triton_backward if ctx.triton_path else _torch_backward
        backward(logits, grad, targets_N, lse_N, entropy_N, grad_logp_N, grad_entropy_N, ctx.inv_temperature)
        if ctx.inplace_backward:  # a later backward of another op that saved the logits now raises, not misleads
            torch.autograd.graph.increment_version(logits)
        return grad, None, None, None, None


def _check_inputs(logits, targets, temperature) -> None:
    check_tensor("logits", logits, ndim=(2, 3), dtypes=FLOAT_DTYPES)
    if logits.stride(-1) != 1:
        raise ValueError(f"logits must be contiguous in the vocabulary dimension (stride 1), got strides "
                         f"{tuple(logits.stride())} (call .contiguous())")
    check_tensor("targets", targets, device=logits.device)
    check_shape("targets", targets, tuple(logits.shape[:-1]), "logits.shape[:-1]")
    check_targets("targets", targets, logits.shape[-1])
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    if not 0.0 < temperature < float("inf"):
        raise ValueError(f"temperature must be positive and finite, got {temperature}")


def logprobs_from_logits(logits, targets, *, temperature=1.0, return_entropy=False, inplace_backward=False):
    """Log-prob of each target under ``softmax(logits / temperature)`` (and the entropy), without ``[N, V]`` temps.

    ``logp = z_y − logsumexp(z)``, ``H = −Σ p log p`` with ``z = logits / temperature`` and ``p = softmax(z)``
    (the module docstring has the gradients).

    Args:
        logits: ``[N, V]`` or padded ``[B, T, V]``, fp32/bf16/fp16; the vocabulary dimension must have stride 1
            (row strides are fine, e.g. ``logits[:, :-1]``).
        targets: int64/int32 ids in ``[0, V)``, shape ``logits.shape[:-1]``. There is no mask: padded positions
            get a value like any other, and callers mask the result.
        temperature: positive; the logits are divided by it before the softmax.
        return_entropy: also return the entropy of each row's distribution.
        inplace_backward: the backward writes the gradient into the logits tensor itself and returns it (no
            logits-sized allocation). The logits' contents are destroyed by the backward: use it only when
            nothing needs them afterwards. The backward marks them modified in place, so an op that saved them
            for its own backward and runs after this one raises autograd's in-place error instead of using the
            gradient as logits; a second backward through this graph raises too.

    Returns:
        ``logp`` (fp32, shape of ``targets``), and ``entropy`` (fp32, same shape) when ``return_entropy``.
    """
    _check_inputs(logits, targets, temperature)
    targets_N = targets.reshape(-1).contiguous()
    logp_N, entropy_N = _LogprobsFunction.apply(logits, targets_N, float(temperature), bool(return_entropy),
                                                bool(inplace_backward))
    logp = logp_N.view(targets.shape)
    return (logp, entropy_N.view(targets.shape)) if return_entropy else logp
