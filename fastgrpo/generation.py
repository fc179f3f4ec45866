"""Co-located generation: batched sampling with the training model's own parameter tensors.

The engine never copies a weight. It walks ``model.model.layers`` and calls each layer's own submodules (the
q/k/v/o projections with their biases, Qwen3's q_norm/k_norm, the RMSNorms, the MLP) on its own activations, with
a KV cache of its own that lives only for the duration of one :meth:`GenerationEngine.generate` call, so training
gets the memory back as soon as the rollout is done and the next rollout sees the optimizer's latest update.

One call, step by step:

1. **Prefill, once per prompt, packed.** The prompts are concatenated into one row of ``N`` tokens with
   per-sequence positions (no padding). Projections, norms and the MLP run on the packed row; attention runs per
   group of equal-length prompts (one causal SDPA per group). Each prompt's K/V go to a packed *prompt store*
   ``[layers, N, Hkv, D]``; its last hidden state is kept for its first sampled token.
2. **Slots.** A static cache ``k, v: [layers, S, Hkv, T, D]`` holds ``S`` sequences of up to ``T = max prompt +
   max_new_tokens`` tokens, ``S * T + N <= max_total_tokens``. The ``n`` samples of a prompt (a GRPO group) are
   queued; a sample admitted to a free slot gets a copy of its prompt's K/V from the store, so the prompt is
   prefilled once and shared by its ``n`` samples.
3. **Decode.** One token per active slot per step: ``x_S -> layers -> logits_SV``, sample, append. On CUDA the
   attention is the split-K kernel of ``fastgrpo.kernels.decode_attention``, which reads each slot's live keys
   only (the G query heads of a kv head as G query rows, no K/V repeat); on CPU it is SDPA over the first ``T_b``
   cache positions with a length mask (``T_b`` = the longest live sequence, rounded up to a bucket on CUDA).
   Every ``sync_every`` steps the host reads the ``done`` flags (the only host synchronisation in the loop):
   finished samples are harvested, queued samples take their slots, and when the queue is empty and at most half
   the batch is live the live slots are moved to the front and the batch shrinks to a power of two, so finished
   sequences stop costing compute.
4. On CUDA the elementwise pieces of a layer (RMSNorm fused with the residual add, rotary on q and k, SiLU·up)
   are fused by ``torch.compile`` (small pure functions, dynamic shapes, compiled once per engine), and the decode
   forward (embedding → logits) is captured once per ``(batch, T_b)`` shape into a CUDA graph and replayed (no
   per-kernel launch overhead); the graphs and the cache are dropped when ``generate`` returns. On CPU everything
   runs eagerly.

Sampling. With ``temperature == 0`` the token is ``argmax(logits)`` and its log-prob is ``log_softmax(logits)``.
Otherwise ``logp = log_softmax(logits / temperature)``; top-k keeps the ``k`` largest (ties with the k-th are
kept), then top-p keeps the smallest set of the most likely tokens (of the top-k renormalised distribution)
whose mass reaches ``top_p`` — the order Hugging Face's warpers apply them. The token is drawn from the truncated,
renormalised distribution by the Gumbel-max trick (``argmax(logp_masked - log(-log(U)))``). Every sample has its own
random stream: the uniforms of its t-th token are ``U(h(seed, sample, t), v)`` (``fastgrpo.kernels.sampling``), so
a sample's tokens do not depend on the batch it runs in, its slot, ``max_batch_size`` or ``sync_every``, and no
host sync is needed to seed them. On CUDA, temperature-only sampling (no top-k/top-p, the GRPO default) is
``fastgrpo.kernels.sampling.gumbel_sample``: one kernel that draws the noise in registers (philox keyed by the row's
stream) and reads each row of logits twice; the distribution is the same.
The logits are accumulated and kept in fp32 (the LM head's product has an fp32 output even for bf16 weights), like
the training kernels', so no bf16 rounding happens before the softmax.
**The returned log-prob is ``logp[token]``: under the temperature-scaled distribution before top-p/top-k
truncation**, which is what the training forward computes with the same temperature.

Tensor names carry their shape: S slots, T cache length, N packed prompt tokens, P prompts, V vocabulary,
H hidden size, Hq/Hkv query/key-value heads, G = Hq / Hkv, D head dim.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastgrpo.kernels._utils import use_triton
from fastgrpo.kernels.decode_attention import decode_attention
from fastgrpo.kernels.sampling import SEED_MASK, gumbel_sample, uniform_rows, uniform_rows_torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
DEFAULT_CPU_TOTAL_TOKENS = 1 << 18  # KV-cache budget on CPU when max_total_tokens is not given
CUDA_MEMORY_FRACTION = 0.8  # share of the free GPU memory the KV cache may take when max_total_tokens is not given
PREFILL_CHUNK_TOKENS = 16384  # prompts are prefilled in packed chunks of at most this many tokens (bounds activations)
CUDA_SYNC_EVERY = 8  # decode steps between reads of the stop flags on CUDA (a finished slot idles at most this long)
CUDA_T_BUCKET = 128  # attention length granularity on CUDA: one CUDA graph per multiple, aligned masks
LM_HEAD_CHUNK = 8192  # vocabulary rows per fp32 product of the LM head off CUDA (bounds the upcast weight copy)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``n`` completions per prompt, each at most ``max_new_tokens`` long."""

    n: int = 1
    """Completions per prompt (the GRPO group size); the prompt is prefilled once for all of them."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most likely tokens whose probability mass reaches top_p (1 = off)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off)."""
    max_new_tokens: int = 256
    """Upper bound on generated tokens per completion (finish_reason "length" when reached without a stop)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens besides the engine's eos_token_ids; the stop token is included in the output."""
    seed: int | None = None
    """Seed of the sampling generator; None draws one from torch's default generator (torch.manual_seed)."""
    max_sequence_tokens: int | None = None
    """Prompt + response budget (NeMo-RL's max_total_sequence_length): each prompt's response limit is
    ``min(max_new_tokens, max_sequence_tokens - len(prompt))``; None = max_new_tokens alone."""

    def __post_init__(self):
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an integer >= 1, got {self.n!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 0, got {self.top_k!r}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        stops = tuple(self.stop_token_ids)
        if not all(is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"SamplingParams.seed must be an integer or None, got {self.seed!r}")
        mst = self.max_sequence_tokens
        if mst is not None and (not is_int(mst) or mst < 2):
            raise ValueError(f"SamplingParams.max_sequence_tokens must be an integer >= 2 or None, got {mst!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def response_limit(self, prompt_len: int) -> int:
        """Most tokens a completion of a ``prompt_len``-token prompt may have (may be < 1: no room)."""
        if self.max_sequence_tokens is None:
            return self.max_new_tokens
        return min(self.max_new_tokens, self.max_sequence_tokens - prompt_len)


@dataclass
class Completion:
    """One sampled continuation of a prompt (the prompt itself is not included)."""

    token_ids: list[int]
    """Generated tokens; ends with the stop token when finish_reason is "stop"."""
    logprobs: list[float] = field(repr=False)
    """log p(token) under softmax(logits / temperature) before top-p/top-k truncation (temperature 1 for greedy)."""
    finish_reason: str
    """"stop" (an eos or stop token was sampled) or "length" (the response limit was reached)."""


@dataclass
class _KVCache:
    """The per-``generate`` memory: the decode slots and the packed prompt store (freed when generate returns)."""

    k: torch.Tensor  # [L, S, Hkv, T, D]
    v: torch.Tensor  # [L, S, Hkv, T, D]
    store_k: torch.Tensor  # [L, N, Hkv, D]
    store_v: torch.Tensor  # [L, N, Hkv, D]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ``x·cos + rotate_half(x)·sin`` (Hugging Face's convention); x [..., D], cos/sin broadcast."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def _bucket(n: int, cap: int) -> int:
    """Smallest power of two >= n, at most cap."""
    return min(cap, 1 << max(n - 1, 0).bit_length())


class GenerationEngine:
    """Batched sampling with ``model``'s own parameters and a KV cache that lives only during :meth:`generate`.

    Args:
        model: a Hugging Face causal LM of a supported architecture (Llama, Qwen2/2.5, Qwen3). Its parameters are
            read in place at every call, so an optimizer step is seen by the next call.
        eos_token_ids: token id(s) that end a completion (with each call's ``stop_token_ids``).
        max_batch_size: most sequences decoded at once (slots).
        max_total_tokens: KV-cache budget in tokens (slots × (longest prompt + max_new_tokens) + all prompt
            tokens). None: 80% of the free GPU memory (the allocator's cached blocks count as free) on CUDA,
            2**18 tokens on CPU.
        dtype: activation and KV-cache dtype; None = the parameters' dtype. A different dtype runs the matmuls under
            ``torch.autocast`` (weights cast on the fly, never stored).
        sync_every: decode steps between host reads of the stop flags; None = 8 on CUDA, 1 on CPU.
        cuda_graphs: capture the decode step in CUDA graphs; None = on when the model is on CUDA.
        compile: fuse the elementwise pieces (RMSNorm, residual add, rotary, SiLU·up) with ``torch.compile``;
            None = on when the model is on CUDA (the CPU path stays eager).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: int | Iterable[int] | None,
        max_batch_size: int = 256,
        max_total_tokens: int | None = None,
        dtype: torch.dtype | None = None,
        sync_every: int | None = None,
        cuda_graphs: bool | None = None,
        compile: bool | None = None,
    ):
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model: unsupported architecture {model_type!r}, expected one of {SUPPORTED_MODEL_TYPES}")
        inner = getattr(model, "model", None)
        for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(inner, name):
                raise ValueError(f"model: unsupported structure, model.model has no {name!r}")
        if getattr(model, "lm_head", None) is None:
            raise ValueError("model: unsupported structure, no lm_head")
        layer_types = getattr(config, "layer_types", None) or ()
        if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
            raise ValueError("model: sliding-window attention layers are not supported")
        rope_type = getattr(inner.rotary_emb, "rope_type", "default")
        if not isinstance(rope_type, str) or "dynamic" in rope_type or "longrope" in rope_type:
            raise ValueError(f"model: rope type {rope_type!r} is not supported (its frequencies depend on length)")

        self.model = model
        self.vocab_size = inner.embed_tokens.num_embeddings
        if eos_token_ids is None:
            eos = ()
        elif isinstance(eos_token_ids, int):
            eos = (eos_token_ids,)
        else:
            eos = tuple(eos_token_ids)
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in eos):
            raise ValueError(f"eos_token_ids must be token ids in [0, {self.vocab_size}), got {eos_token_ids!r}")
        self.eos_token_ids = eos
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if max_total_tokens is not None and (not isinstance(max_total_tokens, int) or max_total_tokens < 2):
            raise ValueError(f"max_total_tokens must be an integer >= 2 or None, got {max_total_tokens!r}")
        if sync_every is not None and (not isinstance(sync_every, int) or sync_every < 1):
            raise ValueError(f"sync_every must be an integer >= 1 or None, got {sync_every!r}")
        self.max_batch_size = max_batch_size
        self.max_total_tokens = max_total_tokens
        self._dtype = dtype
        self._sync_every = sync_every
        self._cuda_graphs = cuda_graphs
        self._compile = compile
        self._compiled_ops: _Ops | None = None

        self.layers = list(inner.layers)
        attn = self.layers[0].self_attn
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self.max_positions = config.max_position_embeddings
        self.qk_norm = getattr(attn, "q_norm", None) is not None  # Qwen3
        self.silu = getattr(config, "hidden_act", None) == "silu"
        norms = [inner.norm]
        for layer in self.layers:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            norms += [layer.self_attn.q_norm, layer.self_attn.k_norm] if self.qk_norm else []
        if not all(hasattr(n, "weight") and hasattr(n, "variance_epsilon") for n in norms):
            raise ValueError("model: unsupported structure, its norms are not RMSNorm(weight, variance_epsilon)")

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        on_group_done: Callable[[int, list[Completion]], None] | None = None,
    ) -> list[list[Completion]]:
        """Sample ``params.n`` completions for each prompt; returns ``[prompt][sample]`` :class:`Completion`.

        The model runs in eval mode under ``no_grad`` and gets its previous mode back afterwards. A completion
        ends at the first token in ``eos_token_ids`` ∪ ``params.stop_token_ids`` (that token is included, reason
        "stop") or after ``params.response_limit(len(prompt))`` tokens (reason "length").

        ``on_group_done(prompt_index, completions)`` is called as soon as all ``params.n`` samples of a prompt have
        finished (in finishing order, each prompt exactly once, before ``generate`` returns), so a caller can score
        a group while the others still decode. ``completions`` is the same list the return value holds.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if on_group_done is not None and not callable(on_group_done):
            raise ValueError(f"on_group_done must be callable or None, got {type(on_group_done).__name__}")
        prompts = self._check_prompts(prompt_token_ids, params)
        if not prompts:
            return []
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"params.stop_token_ids {bad_stop} are outside the vocabulary [0, {self.vocab_size})")

        model = self.model
        param = next(model.parameters())
        device = param.device
        dtype = self._dtype or param.dtype
        max_len = max(len(p) + params.response_limit(len(p)) for p in prompts)  # T
        t_bucket = CUDA_T_BUCKET if device.type == "cuda" else 1
        max_len = -(-max_len // t_bucket) * t_bucket  # attention lengths T_b are multiples of t_bucket
        budget = self._budget_tokens(device, dtype)
        waves = self._plan_waves(prompts, params.n, max_len, budget)

        if params.seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        else:
            seed = params.seed

        was_training = model.training
        model.eval()
        results: list[list[Completion]] = []
        try:
            with torch.no_grad(), self._autocast(device, dtype, param.dtype):
                cos_TD, sin_TD = self._rope_tables(max_len, device, dtype)
                for first, last, slots in waves:
                    run = _Run(self, prompts[first:last], params, slots, max_len, device, dtype, seed, cos_TD, sin_TD)
                    results.extend(run.run(first, on_group_done))
        finally:
            model.train(was_training)
        return results

    # ------------------------------------------------------------------ validation and planning

    def _check_prompts(self, prompt_token_ids, params: SamplingParams) -> list[list[int]]:
        if isinstance(prompt_token_ids, torch.Tensor) or not isinstance(prompt_token_ids, Sequence):
            raise ValueError("prompt_token_ids must be a list of lists of token ids")
        prompts = []
        for i, p in enumerate(prompt_token_ids):
            if isinstance(p, torch.Tensor):
                p = p.tolist()
            if not isinstance(p, Sequence) or isinstance(p, str):
                raise ValueError(f"prompt_token_ids[{i}] must be a list of token ids, got {type(p).__name__}")
            if len(p) == 0:
                raise ValueError(f"prompt_token_ids[{i}] is empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise ValueError(f"prompt_token_ids[{i}] must hold Python ints")
            lo, hi = min(p), max(p)
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(
                    f"prompt_token_ids[{i}] has ids in [{lo}, {hi}], outside the vocabulary [0, {self.vocab_size})"
                )
            limit = params.response_limit(len(p))
            if limit < 1:
                raise ValueError(
                    f"prompt_token_ids[{i}] has {len(p)} tokens: no room for a response within "
                    f"params.max_sequence_tokens={params.max_sequence_tokens}"
                )
            if len(p) + limit > self.max_positions:
                raise ValueError(
                    f"prompt_token_ids[{i}] has {len(p)} tokens; with a response limit of {limit} that "
                    f"exceeds the model's context of {self.max_positions} positions"
                )
            prompts.append(list(p))
        return prompts

    def _kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * len(self.layers) * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()

    def _budget_tokens(self, device: torch.device, dtype: torch.dtype) -> int:
        if self.max_total_tokens is not None:
            return self.max_total_tokens
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # cached, reusable
            return int(free * CUDA_MEMORY_FRACTION) // self._kv_bytes_per_token(dtype)
        return DEFAULT_CPU_TOTAL_TOKENS

    def _plan_waves(self, prompts: list[list[int]], n: int, max_len: int, budget: int) -> list[tuple[int, int, int]]:
        """Split the prompts into waves whose prompt store plus at least one slot fit the token budget.

        Returns ``(first, last, slots)`` per wave; normally one wave holds every prompt.
        """
        waves = []
        first = 0
        while first < len(prompts):
            store = 0
            last = first
            while last < len(prompts):
                extra = len(prompts[last])
                slots_wanted = min(self.max_batch_size, n * (last + 1 - first))
                if store + extra + slots_wanted * max_len > budget and last > first:
                    break
                store += extra
                last += 1
                if store + max_len > budget:
                    raise ValueError(
                        f"max_total_tokens={budget} cannot hold prompt {last - 1} ({len(prompts[last - 1])} tokens) "
                        f"plus one sequence of {max_len} tokens (prompt + max_new_tokens)"
                    )
            slots = min(self.max_batch_size, n * (last - first), (budget - store) // max_len)
            waves.append((first, last, slots))
            first = last
        return waves

    # ------------------------------------------------------------------ model pieces

    def _autocast(self, device: torch.device, dtype: torch.dtype, param_dtype: torch.dtype):
        if dtype == param_dtype:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype, cache_enabled=False)

    def _rope_tables(self, length: int, device: torch.device, dtype: torch.dtype):
        """cos/sin ``[T, D]`` from the model's own rotary module (its inv_freq and attention scaling)."""
        probe = torch.empty(1, device=device, dtype=dtype)
        positions = torch.arange(length, device=device).unsqueeze(0)  # [1, T]
        cos, sin = self.model.model.rotary_emb(probe, positions)
        return cos[0].to(dtype), sin[0].to(dtype)  # [T, D]

    def _ops(self, device: torch.device) -> _Ops:
        """The elementwise helpers: compiled (fused kernels) on CUDA unless ``compile=False``, eager elsewhere."""
        want = device.type == "cuda" if self._compile is None else self._compile
        if not want:
            return _EAGER_OPS
        if self._compiled_ops is None:
            self._compiled_ops = _Ops(*(torch.compile(f, dynamic=True, fullgraph=True) for f in _EAGER_OPS))
        return self._compiled_ops

    def _attn_in(self, ops: _Ops, layer, h, cos, sin, dtype):
        """Projections + (Qwen3) q/k RMSNorm + rotary for rows ``h [M, H]`` → q [M, Hq, D], k/v [M, Hkv, D]."""
        attn = layer.self_attn
        M = h.shape[0]
        q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(M, self.num_heads, self.head_dim)
        k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(M, self.num_kv_heads, self.head_dim)
        v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(M, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = ops.rms_norm(q, attn.q_norm.weight, attn.q_norm.variance_epsilon)
            k = ops.rms_norm(k, attn.k_norm.weight, attn.k_norm.variance_epsilon)
        q, k = ops.rope_qk(q, k, cos, sin)
        return q.to(dtype), k.to(dtype), v.to(dtype)

    def _attn_out_mlp(self, ops: _Ops, layer, x, o_MQ):
        """``x + o_proj(o)``, then the MLP on its post-attention norm; returns (new residual, MLP output)."""
        attn, mlp, ln2 = layer.self_attn, layer.mlp, layer.post_attention_layernorm
        o = F.linear(o_MQ, attn.o_proj.weight, attn.o_proj.bias)
        x, h = ops.add_rms_norm(x, o, ln2.weight, ln2.variance_epsilon)
        gate = F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
        up = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
        act = ops.silu_mul(gate, up) if self.silu else mlp.act_fn(gate) * up
        return x, F.linear(act, mlp.down_proj.weight, mlp.down_proj.bias)

    def _norm_in(self, ops: _Ops, layer, x, delta):
        """Input norm of a layer, fused with the previous layer's MLP residual add when there is one."""
        ln1 = layer.input_layernorm
        if delta is None:
            return x, ops.rms_norm(x, ln1.weight, ln1.variance_epsilon)
        return ops.add_rms_norm(x, delta, ln1.weight, ln1.variance_epsilon)

    def _prefill(self, ops, tokens_N, pos_N, groups, cos_TD, sin_TD, store_k, store_v, offset, dtype):
        """Packed prefill of prompts sorted into equal-length groups; returns the last residual stream ``[N, H]``
        (before the final norm).

        ``groups``: ``(start, count, length)`` = ``count`` prompts of ``length`` tokens at ``start`` in the row.
        K/V go to ``store_{k,v}[:, offset : offset + N]``.
        """
        N = tokens_N.shape[0]
        G = self.num_heads // self.num_kv_heads
        cos, sin = cos_TD[pos_N].unsqueeze(1), sin_TD[pos_N].unsqueeze(1)  # [N, 1, D]
        x = self.model.model.embed_tokens(tokens_N)  # [N, H]
        delta = None
        for li, layer in enumerate(self.layers):
            x, h = self._norm_in(ops, layer, x, delta)
            q, k, v = self._attn_in(ops, layer, h, cos, sin, dtype)  # [N, Hq, D], [N, Hkv, D]
            store_k[li, offset : offset + N] = k
            store_v[li, offset : offset + N] = v
            out = torch.empty_like(q)  # [N, Hq, D]
            for start, count, length in groups:
                end = start + count * length
                qg = q[start:end].view(count, length, self.num_heads, self.head_dim).transpose(1, 2)
                kg = k[start:end].view(count, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
                vg = v[start:end].view(count, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
                if G > 1:  # query head h reads kv head h // G (Hugging Face's repeat_kv)
                    kg, vg = kg.repeat_interleave(G, dim=1), vg.repeat_interleave(G, dim=1)
                og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=self.scale)  # [c, Hq, len, D]
                out[start:end] = og.transpose(1, 2).reshape(count * length, self.num_heads, self.head_dim)
            x, delta = self._attn_out_mlp(ops, layer, x, out.view(N, -1))
        return x + delta

    def _decode_forward(self, ops, cache: _KVCache, tok_S, pos_S, cos_TD, sin_TD, T_b: int, dtype) -> torch.Tensor:
        """One decode step for slots ``[0, S)``: feed ``tok_S`` at ``pos_S``, write its K/V, return logits ``[S, V]``.

        Static shapes and no host synchronisation, so it can be captured in a CUDA graph. The attention reads
        cache positions ``[0, T_b)`` masked to ``<= pos`` (the query's own key included).
        """
        S = tok_S.shape[0]
        G = self.num_heads // self.num_kv_heads
        slot_S = torch.arange(S, device=tok_S.device)
        fused_attention = _use_fused_attention(tok_S)
        if fused_attention:
            length_S = (pos_S + 1).to(torch.int32)  # keys [0, pos] are live, the current one included
        else:
            mask_S11T = (torch.arange(T_b, device=tok_S.device) <= pos_S[:, None]).view(S, 1, 1, T_b)
        cos, sin = cos_TD[pos_S].unsqueeze(1), sin_TD[pos_S].unsqueeze(1)  # [S, 1, D]
        x = self.model.model.embed_tokens(tok_S)  # [S, H]
        delta = None
        for li, layer in enumerate(self.layers):
            x, h = self._norm_in(ops, layer, x, delta)
            q, k, v = self._attn_in(ops, layer, h, cos, sin, dtype)  # [S, Hq, D], [S, Hkv, D]
            k_cache, v_cache = cache.k[li], cache.v[li]  # [S_max, Hkv, T, D]
            k_cache[slot_S, :, pos_S] = k
            v_cache[slot_S, :, pos_S] = v
            # the G query heads of one kv head act as G query rows against that head's keys (no K/V repeat)
            q4 = q.view(S, self.num_kv_heads, G, self.head_dim)
            if fused_attention:  # reads each slot's live keys only
                o = decode_attention(q4, k_cache[:S, :, :T_b], v_cache[:S, :, :T_b], length_S, softmax_scale=self.scale)
            else:
                o = F.scaled_dot_product_attention(
                    q4, k_cache[:S, :, :T_b], v_cache[:S, :, :T_b], attn_mask=mask_S11T, scale=self.scale
                )  # [S, Hkv, G, D]
            x, delta = self._attn_out_mlp(ops, layer, x, o.reshape(S, -1))
        norm = self.model.model.norm
        _, h = ops.add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)
        return self._lm_head(h)  # [S, V] fp32

    def _logits(self, ops, residual_PH: torch.Tensor) -> torch.Tensor:
        norm = self.model.model.norm
        return self._lm_head(ops.rms_norm(residual_PH, norm.weight, norm.variance_epsilon))  # [P, V] fp32

    def _lm_head(self, h_MH: torch.Tensor) -> torch.Tensor:
        """``logits = h Wᵀ (+ b)`` ``[M, V]``, accumulated and returned in fp32 like the training kernels' (never
        rounded to bf16 before the softmax). bf16/fp16 on CUDA: cuBLAS with an fp32 output (``torch.mm``'s
        ``out_dtype``), the weights read once in their own dtype; elsewhere fp32 products over vocabulary chunks of
        ``LM_HEAD_CHUNK`` rows (one chunk of the weight upcast at a time)."""
        weight_VH, bias_V = self.model.lm_head.weight, self.model.lm_head.bias
        with torch.autocast(h_MH.device.type, enabled=False):
            if h_MH.dtype == weight_VH.dtype == torch.float32:
                return F.linear(h_MH, weight_VH, bias_V)
            if h_MH.is_cuda:
                logits_MV = torch.mm(h_MH, weight_VH.to(h_MH.dtype).t(), out_dtype=torch.float32)
            else:
                h32 = h_MH.float()
                logits_MV = torch.empty(h_MH.shape[0], weight_VH.shape[0], device=h_MH.device)
                for v0 in range(0, weight_VH.shape[0], LM_HEAD_CHUNK):
                    w_CH = weight_VH[v0 : v0 + LM_HEAD_CHUNK].float()
                    torch.mm(h32, w_CH.t(), out=logits_MV[:, v0 : v0 + LM_HEAD_CHUNK])
            return logits_MV if bias_V is None else logits_MV + bias_V.float()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: ``weight · (x / sqrt(mean(x²) + eps))``, normalised in fp32, cast back, then scaled."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add then RMSNorm: returns (x + delta, rms_norm(x + delta))."""
    x = x + delta
    return x, _rms_norm(x, weight, eps)


def _rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return _rope(q, cos, sin), _rope(k, cos, sin)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _use_fused_sampling(t: torch.Tensor) -> bool:
    """Temperature-only sampling by the Triton kernel on CUDA; torch ops elsewhere (and for top-k/top-p)."""
    return t.is_cuda and use_triton(t)


def _use_fused_attention(t: torch.Tensor) -> bool:
    """Decode attention by the Triton kernel on CUDA; SDPA with a length mask elsewhere (the CPU path)."""
    return t.is_cuda and use_triton(t)


class _Ops(NamedTuple):
    """The elementwise pieces of a layer; torch.compile fuses each into one or two kernels on CUDA."""

    rms_norm: Callable
    add_rms_norm: Callable
    rope_qk: Callable
    silu_mul: Callable


_EAGER_OPS = _Ops(_rms_norm, _add_rms_norm, _rope_qk, _silu_mul)


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of int64 values in [0, 2^31) onto [0, 2^31) (xor-shift-multiply; no overflow in int64)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & SEED_MASK
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & SEED_MASK
    return x ^ (x >> 16)


def _row_seeds(seed: int, sample_S: torch.Tensor, index_S: torch.Tensor) -> torch.Tensor:
    """The random stream of each row: a hash of (call seed, sample id, index of the token being drawn), on the
    rows' device (no host sync). A sample's noise is then the same whatever batch or row it runs in."""
    return _mix31(_mix31(_mix31(torch.full_like(sample_S, seed & SEED_MASK)) ^ sample_S) ^ index_S)


def _sample(logits_SV: torch.Tensor, params: SamplingParams, seeds_S: torch.Tensor):
    """Draw one token per row (row r from its stream ``seeds_S[r]``); returns (token [S] int64, log-prob [S] fp32
    before top-p/top-k truncation)."""
    if params.greedy:
        logp = torch.log_softmax(logits_SV, dim=-1)
        tok = logits_SV.argmax(dim=-1)
        return tok, logp.gather(1, tok[:, None]).squeeze(1)
    if not params.top_k and params.top_p == 1.0 and _use_fused_sampling(logits_SV):
        return gumbel_sample(logits_SV, params.temperature, seeds_S)
    logp = torch.log_softmax(logits_SV / params.temperature, dim=-1)  # [S, V]
    kept = logp
    if params.top_k and params.top_k < logp.shape[-1]:
        kth = torch.topk(logp, params.top_k, dim=-1).values[:, -1:]  # [S, 1]
        kept = kept.masked_fill(logp < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_lp, order = torch.sort(kept, dim=-1, descending=True)
        probs = torch.softmax(sorted_lp, dim=-1)  # renormalised over what top-k kept
        mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        drop = mass_before >= params.top_p  # the first token always stays (mass_before = 0 < top_p)
        kept = kept.scatter(1, order, sorted_lp.masked_fill(drop, -math.inf))
    # Gumbel(0, 1) noise -log(-log(u)), u ~ U[0, 1) (u = 0 gives -inf: never picked); on CUDA the uniforms of the
    # fused kernel (philox, no host sync), elsewhere one seeded torch.Generator per row
    V = kept.shape[-1]
    u = uniform_rows(seeds_S, V) if _use_fused_sampling(kept) else uniform_rows_torch(seeds_S, V)  # [S, V]
    tok = (kept - (-u.log()).log()).argmax(dim=-1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)


class _Run:
    """One wave of one ``generate`` call: prefill its prompts, then decode all their samples through the slots."""

    def __init__(self, engine: GenerationEngine, prompts, params, slots, max_len, device, dtype, seed, cos_TD, sin_TD):
        self.e = engine
        self.prompts = prompts
        self.params = params
        self.S = slots
        self.T = max_len
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self.cos_TD, self.sin_TD = cos_TD, sin_TD
        self.max_new = params.max_new_tokens
        cuda = device.type == "cuda"
        self.sync_every = engine._sync_every or (CUDA_SYNC_EVERY if cuda else 1)
        self.t_bucket = CUDA_T_BUCKET if cuda else 1
        self.use_graphs = cuda and engine._cuda_graphs is not False
        self.ops = engine._ops(device)
        self.stop_set = set(engine.eos_token_ids) | set(params.stop_token_ids)
        self.stop_ids = torch.tensor(sorted(self.stop_set), dtype=torch.long, device=device)

    def run(self, first: int, on_group_done) -> list[list[Completion]]:
        """Decode this wave; ``first`` is the index of its first prompt in the call (for ``on_group_done``)."""
        e, P, n = self.e, len(self.prompts), self.params.n
        lengths = [len(p) for p in self.prompts]
        L, Hkv, D = len(e.layers), e.num_kv_heads, e.head_dim
        # zeroed: masked-out positions still enter the attention's P @ V, where 0 * NaN would be NaN
        cache = _KVCache(
            k=torch.zeros(L, self.S, Hkv, self.T, D, device=self.device, dtype=self.dtype),
            v=torch.zeros(L, self.S, Hkv, self.T, D, device=self.device, dtype=self.dtype),
            store_k=torch.empty(L, sum(lengths), Hkv, D, device=self.device, dtype=self.dtype),
            store_v=torch.empty(L, sum(lengths), Hkv, D, device=self.device, dtype=self.dtype),
        )
        offsets, last_hidden_PH = self._prefill_all(cache, lengths)
        try:
            return self._decode(cache, lengths, offsets, last_hidden_PH, P, n, first, on_group_done)
        finally:
            self.graphs = None  # the graphs hold the cache's addresses: drop them with it

    def _prefill_all(self, cache: _KVCache, lengths: list[int]):
        """Prefill every prompt once (packed chunks, longest first); returns store offsets and last hidden states."""
        e, dev = self.e, self.device
        offsets = [0] * len(lengths)
        last_hidden = [None] * len(lengths)
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        offset = 0
        i = 0
        while i < len(order):
            chunk = [order[i]]
            total = lengths[order[i]]
            i += 1
            while i < len(order) and total + lengths[order[i]] <= PREFILL_CHUNK_TOKENS:
                chunk.append(order[i])
                total += lengths[order[i]]
                i += 1
            tokens = [t for p in chunk for t in self.prompts[p]]
            positions = [j for p in chunk for j in range(lengths[p])]
            groups, start = [], 0
            for p in chunk:
                if groups and groups[-1][2] == lengths[p]:
                    groups[-1] = (groups[-1][0], groups[-1][1] + 1, lengths[p])
                else:
                    groups.append((start, 1, lengths[p]))
                start += lengths[p]
            x = e._prefill(
                self.ops,
                torch.tensor(tokens, device=dev),
                torch.tensor(positions, device=dev),
                groups,
                self.cos_TD,
                self.sin_TD,
                cache.store_k,
                cache.store_v,
                offset,
                self.dtype,
            )  # [N_chunk, H]
            start = 0
            for p in chunk:
                offsets[p] = offset + start
                start += lengths[p]
                last_hidden[p] = x[start - 1]
            offset += total
        return offsets, torch.stack(last_hidden)  # [P, H]

    def _decode(self, cache, lengths, offsets, last_hidden_PH, P, n, first, on_group_done) -> list[list[Completion]]:
        dev, S, max_new = self.device, self.S, self.max_new
        queue = [(p, j) for p in range(P) for j in range(n)]  # sample j of prompt p, prompt-major
        queue.reverse()  # pop() from the end takes them in order
        results: list[list[Completion | None]] = [[None] * n for _ in range(P)]
        unfinished = [n] * P  # samples of each prompt still running or queued
        tok_S = torch.zeros(S, dtype=torch.long, device=dev)  # token fed at the next step
        pos_S = torch.zeros(S, dtype=torch.long, device=dev)  # its position (= tokens already in the cache)
        n_gen_S = torch.zeros(S, dtype=torch.long, device=dev)  # tokens generated so far
        done_S = torch.ones(S, dtype=torch.bool, device=dev)  # finished or free
        out_tok = torch.zeros(S, max_new, dtype=torch.long, device=dev)
        out_lp = torch.zeros(S, max_new, dtype=torch.float32, device=dev)
        limit_S = torch.ones(S, dtype=torch.long, device=dev)  # the response limit of the sample in the slot
        sample_S = torch.zeros(S, dtype=torch.long, device=dev)  # the sample's id in the call: its random stream
        state = (tok_S, pos_S, n_gen_S, done_S, out_tok, out_lp, limit_S, sample_S)
        owner: list[tuple[int, int] | None] = [None] * S  # host: which sample each slot holds
        upper: list[int] = [0] * S  # host: upper bound on each slot's pos (exact until it finishes)
        S_b = S  # slots [0, S_b) are stepped
        self.graphs = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.static_in = (tok_S, pos_S)
        rows = torch.arange(S, device=dev)

        while True:
            # ---- host bookkeeping (one device->host read of the flags per sync_every steps)
            done = done_S[:S_b].tolist()
            finished = [s for s in range(S_b) if done[s] and owner[s] is not None]
            if finished:
                idx = torch.tensor(finished, device=dev)
                counts = n_gen_S[idx].tolist()
                toks, lps = out_tok[idx].tolist(), out_lp[idx].tolist()
                for s, c, tk, lp in zip(finished, counts, toks, lps):
                    p, j = owner[s]
                    stopped = tk[c - 1] in self.stop_set
                    results[p][j] = Completion(tk[:c], lp[:c], "stop" if stopped else "length")
                    owner[s] = None
                    unfinished[p] -= 1
                    if unfinished[p] == 0 and on_group_done is not None:
                        on_group_done(first + p, results[p])
            free = [s for s in range(S_b) if owner[s] is None]
            if queue and free:
                admit = free[: len(queue)]
                samples = [queue.pop() for _ in admit]
                self._admit(cache, state, admit, samples, lengths, offsets, last_hidden_PH, first)
                for s, (p, j) in zip(admit, samples):
                    owner[s] = (p, j)
                    upper[s] = lengths[p]
                continue  # a sample can finish at its first token (stop token or max_new_tokens == 1)
            live = [s for s in range(S_b) if owner[s] is not None]
            if not live:
                break
            if not queue and len(live) <= S_b // 2:
                S_b = self._compact(cache, state, live, owner, upper)
                live = list(range(len(live)))  # the compaction moved them to the front

            # ---- sync_every decode steps without reading anything back
            steps = self.sync_every
            T_b = min(self.T, -(-(max(upper[s] for s in live) + steps) // self.t_bucket) * self.t_bucket)
            for _ in range(steps):
                logits = self._step(cache, S_b, T_b)  # [S_b, V]
                tok, lp = _sample(logits, self.params, _row_seeds(self.seed, sample_S[:S_b], n_gen_S[:S_b]))
                live_S = ~done_S[:S_b]
                col = n_gen_S[:S_b].clamp(max=max_new - 1)
                r = rows[:S_b]
                out_tok[r, col] = torch.where(live_S, tok, out_tok[r, col])
                out_lp[r, col] = torch.where(live_S, lp, out_lp[r, col])
                n_gen_S[:S_b] += live_S
                stop = torch.isin(tok, self.stop_ids) | (n_gen_S[:S_b] >= limit_S[:S_b])
                done_S[:S_b] |= live_S & stop
                pos_S[:S_b] += live_S
                tok_S[:S_b] = torch.where(live_S, tok, tok_S[:S_b])
            for s in live:
                upper[s] += steps
        return results

    def _admit(self, cache, state, slots, samples, lengths, offsets, last_hidden_PH, first) -> None:
        """Give each admitted sample its prompt's K/V and its first token (sampled from the prompt's last state)."""
        tok_S, pos_S, n_gen_S, done_S, out_tok, out_lp, limit_S, sample_S = state
        dev = self.device
        by_prompt: dict[int, list[int]] = {}
        for s, (p, _) in zip(slots, samples):
            by_prompt.setdefault(p, []).append(s)
        for p, group in by_prompt.items():  # one copy per prompt into all its admitted slots
            off, n = offsets[p], lengths[p]
            idx = torch.tensor(group, device=dev)
            cache.k[:, idx, :, :n] = cache.store_k[:, None, off : off + n].transpose(2, 3)  # [L, 1, Hkv, n, D]
            cache.v[:, idx, :, :n] = cache.store_v[:, None, off : off + n].transpose(2, 3)
        idx = torch.tensor(slots, device=dev)
        prompt_idx = torch.tensor([p for p, _ in samples], device=dev)
        logits = self.e._logits(self.ops, last_hidden_PH[prompt_idx])  # [A, V]
        sample_A = torch.tensor([(first + p) * self.params.n + j for p, j in samples], device=dev)
        sample_S[idx] = sample_A
        tok, lp = _sample(logits, self.params, _row_seeds(self.seed, sample_A, torch.zeros_like(sample_A)))
        tok_S[idx] = tok
        pos_S[idx] = torch.tensor([lengths[p] for p, _ in samples], device=dev)
        n_gen_S[idx] = 1
        out_tok[idx, 0] = tok
        out_lp[idx, 0] = lp
        limits = torch.tensor([self.params.response_limit(lengths[p]) for p, _ in samples], device=dev)
        limit_S[idx] = limits
        done_S[idx] = torch.isin(tok, self.stop_ids) | (limits <= 1)

    def _compact(self, cache, state, live, owner, upper) -> int:
        """Move the live slots to the front (K/V and state) and return the new, smaller batch size."""
        new_S = _bucket(len(live), self.S)
        moves = [(src, dst) for dst, src in enumerate(live) if src != dst]
        if moves:
            src = torch.tensor([m[0] for m in moves], device=self.device)
            dst = torch.tensor([m[1] for m in moves], device=self.device)
            for li in range(len(self.e.layers)):  # per layer: the temporary is one layer's share
                cache.k[li, dst] = cache.k[li, src]
                cache.v[li, dst] = cache.v[li, src]
            for t in state:
                t[dst] = t[src]
            for s_src, s_dst in moves:
                owner[s_dst], upper[s_dst] = owner[s_src], upper[s_src]
                owner[s_src] = None
        state[3][len(live) : self.S] = True  # the rest are free
        return new_S

    def _step(self, cache: _KVCache, S_b: int, T_b: int) -> torch.Tensor:
        tok_S, pos_S = self.static_in
        if not self.use_graphs:
            return self.e._decode_forward(
                self.ops, cache, tok_S[:S_b], pos_S[:S_b], self.cos_TD, self.sin_TD, T_b, self.dtype
            )
        key = (S_b, T_b)
        if key not in self.graphs:
            self.graphs[key] = self._capture(cache, S_b, T_b)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits

    def _capture(self, cache: _KVCache, S_b: int, T_b: int):
        """Capture the decode forward for this shape. Warm-up runs recompute the current step's K/V: harmless."""
        tok_S, pos_S = self.static_in

        def forward():
            return self.e._decode_forward(
                self.ops, cache, tok_S[:S_b], pos_S[:S_b], self.cos_TD, self.sin_TD, T_b, self.dtype
            )

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = forward()
        return graph, logits
