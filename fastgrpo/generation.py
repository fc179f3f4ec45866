"""Co-located generation: batched sampling with the training model's own parameter tensors.

The engine never copies a weight. It walks ``model.model.layers`` and calls each layer's own submodules (the
q/k/v/o projections with their biases, Qwen3's q_norm/k_norm, the RMSNorms, the MLP) on its own activations, with
a KV cache of its own that lives only for the duration of one :meth:`GenerationEngine.generate` call, so training
gets the memory back as soon as the rollout is done and the next rollout sees the optimizer's latest update.

One call, step by step (the host bookkeeping is ``fastgrpo.scheduler.Scheduler``; this file is the device step):

1. **Pages.** The KV cache is a pool of pages ``k, v: [layers, Hkv, pages, page_size, D]`` sized from the budget
   (``max_total_tokens``, or 80% of the free GPU memory), allocated per call and freed on return. Every sample of
   every prompt is queued at once (one wave) and admitted when pages and rows allow.
2. **Prefill, once per prompt, packed, straight into pages.** The prompts admitted in a round are concatenated into
   one row with per-sequence positions (no padding); attention runs per group of equal-length prompts (one causal
   SDPA per group) and each token's K/V go to its page. A prompt's ``n`` samples reference its full pages (reference
   counts) and get a private copy of its partly filled last page; the prompt's last hidden state gives each sample
   its first token.
3. **Decode.** One token per running sample per step: ``x_S -> layers -> logits_SV (fp32)``, sample, append. The
   attention reads each sample's keys through its block table: on CUDA the split-K paged kernel of
   ``fastgrpo.kernels.decode_attention`` (the G query heads of a kv head as G query rows, no K/V repeat). On CPU a
   row cache (``_Workspace``) holds each running row's keys contiguously: every step writes its token to the page
   and to the row, a row that gets another sequence is refreshed from its pages through the block table, and the
   attention is a masked fp32 softmax over the row (re-gathering every page at every layer and step would copy the
   live K/V once more per step). Every ``sync_every`` steps the host reads the flags and
   counts (the only host synchronisation in the loop): finished samples are harvested and free their pages, every
   running sample gets the pages of its next ``sync_every`` tokens (when the pool runs dry, the latest-admitted
   sample is preempted: pages freed, requeued with its tokens; it is later recomputed by prefilling prompt +
   tokens), queued samples are admitted, rows are compacted, and the batch is the smallest power of two that holds
   the running samples (padding rows write to a scratch page).
4. On CUDA the elementwise pieces of a layer (RMSNorm fused with the residual add, rotary on q and k, SiLU·up)
   are fused by ``torch.compile`` (small pure functions, dynamic shapes, compiled once per engine), and the decode
   forward (embedding → logits) is captured once per batch-size bucket into a CUDA graph (block tables and lengths
   are static inputs, so no graph per length) writing one logits buffer; the graphs and the pool are dropped when
   ``generate`` returns. On CPU everything runs eagerly, with the same host logic (``sync_every``, buckets), and the
   step writes its largest activations (logits, MLP) into reused buffers instead of fresh tensors.

Memory (DeepSeek-R1-Distill-Qwen-1.5B, bf16): 28 KiB of K/V per token (28 layers × 2 × 2 kv heads × 128 × 2 B), so
a 64-token page is 1.75 MiB; 40 GiB of pool hold ~1.5M tokens, e.g. 128 sequences at 12K tokens on average. Host
state is O(pages + samples). ``engine.last_stats`` reports each call: peak_running, preemptions, decode_steps,
prefill_tokens, peak_kv_tokens, kv_capacity_tokens, page_size.

Sampling. With ``temperature == 0`` the token is ``argmax(logits)`` and its log-prob is ``log_softmax(logits)``.
Otherwise ``logp = log_softmax(logits / temperature)``; top-k keeps the ``k`` largest (ties with the k-th are
kept), then top-p keeps the smallest set of the most likely tokens (of the top-k renormalised distribution)
whose mass reaches ``top_p`` — the order Hugging Face's warpers apply them. The token is drawn from the truncated,
renormalised distribution. Every sample has its own random stream keyed by ``h(seed, sample, t)`` for its t-th token
(``fastgrpo.kernels.sampling``), so a sample's tokens do not depend on the batch it runs in, its slot,
``max_batch_size`` or ``sync_every``, and no host sync is needed to seed them. On CUDA the draw is the Gumbel-max
trick (``argmax(logp_masked - log(-log(U)))``, ``U = U(h, v)`` philox); temperature-only sampling (no top-k/top-p,
the GRPO default) is ``fastgrpo.kernels.sampling.gumbel_sample``, one kernel that draws the noise in registers and
reads each row of logits twice. Elsewhere it is the inverse CDF with one 53-bit uniform per row, a hash of ``h``
(``inverse_cdf_sample``: fp64 CDF in two levels, no ``[S, V]`` noise). Same distribution, different draws.
The logits are accumulated and kept in fp32 (the LM head's product has an fp32 output even for bf16 weights), like
the training kernels', so no bf16 rounding happens before the softmax.
**The returned log-prob is ``logp[token]``: under the temperature-scaled distribution before top-p/top-k
truncation**, which is what the training forward computes with the same temperature.

Tensor names carry their shape: S rows (running samples), P block-table width, N packed prompt tokens, V vocabulary,
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
from fastgrpo.kernels.decode_attention import masked_attention, paged_decode_attention, paged_decode_attention_torch
from fastgrpo.kernels.sampling import SEED_MASK, gumbel_sample, inverse_cdf_sample, uniform_rows
from fastgrpo.scheduler import Admission, Scheduler

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
DEFAULT_CPU_TOTAL_TOKENS = 1 << 18  # KV-cache budget on CPU when max_total_tokens is not given
CUDA_MEMORY_FRACTION = 0.8  # share of the free GPU memory the KV cache may take when max_total_tokens is not given
PREFILL_CHUNK_TOKENS = 16384  # prompts are prefilled in packed chunks of at most this many tokens (bounds activations)
CUDA_SYNC_EVERY = 8  # decode steps between reads of the stop flags on CUDA (a finished slot idles at most this long)
# tokens per KV page, {on CUDA: True/False}. CUDA: 64 = the decode kernel's keys per inner step (one page per
# step); a sequence wastes < 64 tokens (1.8 MiB for the 1.5B model), nothing next to 24K-token responses. CPU: 16,
# the tiny models' gathers and partial-page copies stay small.
DEFAULT_PAGE_SIZE = {True: 64, False: 16}
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
    """The per-``generate`` memory (freed when generate returns): the KV page pool, head-major (a page's keys of
    one kv head are contiguous: a row refresh copies whole blocks, and the CUDA kernel reads 64 × D contiguous
    values per page and head), and, on the eager (CPU) path, the row cache and the step's reused buffers."""

    k: torch.Tensor  # [L, Hkv, pages, page_size, D]
    v: torch.Tensor  # [L, Hkv, pages, page_size, D]
    work: _Workspace | None = None

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's pools as ``[pages, page_size, Hkv, D]`` views (the decode-attention API's layout)."""
        return self.k[layer].permute(1, 2, 0, 3), self.v[layer].permute(1, 2, 0, 3)

    def write(self, layer: int, slot_N: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor) -> None:
        """K/V of N tokens into flat slots ``page · page_size + offset`` of the layer's pool."""
        Hkv, D = self.k.shape[1], self.k.shape[-1]
        self.k[layer].view(Hkv, -1, D)[:, slot_N] = k_NHD.transpose(0, 1)
        self.v[layer].view(Hkv, -1, D)[:, slot_N] = v_NHD.transpose(0, 1)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V of pages ``src`` into pages ``dst``."""
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]


class _Workspace(NamedTuple):
    """The eager (CPU) decode step's memory besides the pages.

    **Row cache.** Its attention reads each row's keys laid out contiguously, ``k_rows[layer, row, :, :len]``, not
    a fresh gather of the row's pages at every layer and step (which copies the whole live K/V once more per step and
    was the largest cost of a CPU step). Every decode step writes its token's K/V to the pages and to the row cache;
    a row whose sequence changed (admitted, moved by compaction, recomputed after a preemption) is refreshed from
    its pages through the block table, so the pages stay the one source of truth. Memory: a static cache for the
    rows (``L · R · Hkv · max_pages · page_size · D`` keys and values), kept only when it holds no more tokens than
    the KV budget; otherwise every layer gathers its rows' pages at every step (``paged_decode_attention_torch``,
    slower).

    **Buffers.** The step writes its largest activations (MLP, logits) into reused buffers instead of fresh tensors,
    as the feature-major products of ``_linear_t``. None under autocast (``out=`` products are not cast)."""

    k_rows: torch.Tensor | None  # [L, R, Hkv, max_pages · page_size, D]; None: attention through the pages
    v_rows: torch.Tensor | None  # [L, R, Hkv, max_pages · page_size, D]
    scores: torch.Tensor  # [R · Hq · max_pages · page_size] fp32: the attention's scores
    gate: torch.Tensor | None  # [R · intermediate]: the MLP's gate projection, then its activation
    up: torch.Tensor | None  # [R · intermediate]
    down: torch.Tensor | None  # [R · H]: the MLP's output
    logits: torch.Tensor | None  # [R · V] fp32


class _RowState(NamedTuple):
    """Per-row decode state on the device (rows [0, running) hold the scheduler's running samples)."""

    tok: torch.Tensor  # [R] int64
    pos: torch.Tensor  # [R] int64
    n_gen: torch.Tensor  # [R] int64
    done: torch.Tensor  # [R] bool
    limit: torch.Tensor  # [R] int64
    stream: torch.Tensor  # [R] int64: the key of the sample's random stream, h(seed, sample) (``_sample_streams``)
    out_tok: torch.Tensor  # [R, max_new] int64
    out_lp: torch.Tensor  # [R, max_new] fp32
    table: torch.Tensor  # [R, max_pages] int32


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
        max_batch_size: most sequences decoded at once (rows).
        max_total_tokens: KV page pool in tokens (``max_total_tokens // page_size`` pages; it must hold the longest
            prompt + response plus two pages). None: 80% of the free GPU memory (the allocator's cached blocks count
            as free) on CUDA, 2**18 tokens on CPU.
        dtype: activation and KV-cache dtype; None = the parameters' dtype. A different dtype runs the matmuls under
            ``torch.autocast`` (weights cast on the fly, never stored).
        sync_every: decode steps between host reads of the stop flags; None = 8 on CUDA, 1 on CPU.
        cuda_graphs: capture the decode step in CUDA graphs; None = on when the model is on CUDA.
        compile: fuse the elementwise pieces (RMSNorm, residual add, rotary, SiLU·up) with ``torch.compile``;
            None = on when the model is on CUDA (the CPU path stays eager).
        page_size: tokens per KV page; None = 64 on CUDA (the decode kernel's keys per inner step; < 64 tokens
            wasted per sequence), 16 on CPU.
        row_cache: where the paged kernel does not run (CPU), decode attention reads a contiguous row cache kept in
            step with the pages (see ``_Workspace``) instead of gathering every row's pages per layer and step; None
            = when it holds no more tokens than the KV budget (``max_total_tokens``). Ignored on CUDA.
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
        page_size: int | None = None,
        row_cache: bool | None = None,
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
        if page_size is not None and (not isinstance(page_size, int) or page_size < 1):
            raise ValueError(f"page_size must be an integer >= 1 or None, got {page_size!r}")
        if row_cache is not None and not isinstance(row_cache, bool):
            raise ValueError(f"row_cache must be True, False or None, got {row_cache!r}")
        self.page_size = page_size
        self.last_stats: dict = {}
        self.max_batch_size = max_batch_size
        self.max_total_tokens = max_total_tokens
        self._dtype = dtype
        self._sync_every = sync_every
        self._cuda_graphs = cuda_graphs
        self._compile = compile
        self._compiled_ops: _Ops | None = None
        self._row_cache = row_cache

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
        budget = self._budget_tokens(device, dtype)

        if params.seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        else:
            seed = params.seed

        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), self._autocast(device, dtype, param.dtype):
                cos_TD, sin_TD = self._rope_tables(max_len, device, dtype)
                run = _Run(self, prompts, params, device, dtype, seed, cos_TD, sin_TD, budget)
                return run.run(on_group_done)
        finally:
            model.train(was_training)

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

    def _attn_out_mlp(self, ops: _Ops, layer, x, o_MQ, work: _Workspace | None = None):
        """``x + o_proj(o)``, then the MLP on its post-attention norm; returns (new residual, MLP output). With a
        workspace the gate and up projections and the activation go to its buffers (in place, the same values)."""
        attn, mlp, ln2 = layer.self_attn, layer.mlp, layer.post_attention_layernorm
        o = F.linear(o_MQ, attn.o_proj.weight, attn.o_proj.bias)
        x, h = ops.add_rms_norm(x, o, ln2.weight, ln2.variance_epsilon)
        if work is None or work.gate is None:
            gate = F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
            up = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
            act = ops.silu_mul(gate, up) if self.silu else mlp.act_fn(gate) * up
            return x, F.linear(act, mlp.down_proj.weight, mlp.down_proj.bias)
        gate = _linear_t(h, mlp.gate_proj.weight, mlp.gate_proj.bias, work.gate)  # [M, I] feature-major views
        up = _linear_t(h, mlp.up_proj.weight, mlp.up_proj.bias, work.up)
        act = (F.silu(gate, inplace=True) if self.silu else mlp.act_fn(gate)).mul_(up)
        return x, _linear_t(act, mlp.down_proj.weight, mlp.down_proj.bias, work.down)

    def _norm_in(self, ops: _Ops, layer, x, delta):
        """Input norm of a layer, fused with the previous layer's MLP residual add when there is one."""
        ln1 = layer.input_layernorm
        if delta is None:
            return x, ops.rms_norm(x, ln1.weight, ln1.variance_epsilon)
        return ops.add_rms_norm(x, delta, ln1.weight, ln1.variance_epsilon)

    def _prefill(self, ops, tokens_N, pos_N, groups, cos_TD, sin_TD, cache, slot_N, dtype):
        """Packed prefill of prompts sorted into equal-length groups; returns the last residual stream ``[N, H]``
        (before the final norm).

        ``groups``: ``(start, count, length)`` = ``count`` prompts of ``length`` tokens at ``start`` in the row.
        Token i's K/V go to flat slot ``slot_N[i]`` of the page pool (page · page_size + offset). Its attention reads
        the same K/V values it writes (the fresh tensors, before the write), so it equals attention through the pages.
        """
        N = tokens_N.shape[0]
        G = self.num_heads // self.num_kv_heads
        cos, sin = cos_TD[pos_N].unsqueeze(1), sin_TD[pos_N].unsqueeze(1)  # [N, 1, D]
        x = self.model.model.embed_tokens(tokens_N)  # [N, H]
        delta = None
        for li, layer in enumerate(self.layers):
            x, h = self._norm_in(ops, layer, x, delta)
            q, k, v = self._attn_in(ops, layer, h, cos, sin, dtype)  # [N, Hq, D], [N, Hkv, D]
            cache.write(li, slot_N, k, v)
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

    def _decode_forward(self, ops, cache: _KVCache, tok_S, pos_S, table_SP, cos_TD, sin_TD, dtype) -> torch.Tensor:
        """One decode step for rows ``[0, S)``: feed ``tok_S`` at ``pos_S``, write its K/V into the row's page, return
        logits ``[S, V]`` (fp32; with a workspace, a feature-major view of ``cache.work.logits``: strides (1, S)).

        Static shapes and no host synchronisation, so it can be captured in a CUDA graph. Attention reads the keys
        ``[0, pos]`` of each row (the query's own key included): through its block table ``table_SP`` on CUDA; on
        CPU from the row cache, its first ``P · page_size`` columns (the engine passes only the table columns the
        longest row uses).
        """
        S = tok_S.shape[0]
        G = self.num_heads // self.num_kv_heads
        ps = cache.k.shape[3]
        page_S = table_SP.gather(1, (pos_S // ps)[:, None]).squeeze(1).long()
        slot_S = page_S * ps + pos_S % ps  # flat index of the new token's K/V in the pool
        length_S = pos_S + 1  # keys [0, pos] are live, the current one included
        work = cache.work  # None: the paged kernel (CUDA)
        rows = work is not None and work.k_rows is not None  # else attention through the pages
        # the torch path named off CUDA: paged_decode_attention would run the kernel under TRITON_INTERPRET=1
        attention = paged_decode_attention if _use_fused_attention(tok_S) else paged_decode_attention_torch
        if rows:
            rows_S = torch.arange(S, device=tok_S.device)
            T = table_SP.shape[1] * ps  # the row cache's columns the longest row uses
            dead_S11T = (torch.arange(T, device=tok_S.device) >= length_S[:, None]).view(S, 1, 1, T)
        cos, sin = cos_TD[pos_S].unsqueeze(1), sin_TD[pos_S].unsqueeze(1)  # [S, 1, D]
        x = self.model.model.embed_tokens(tok_S)  # [S, H]
        delta = None
        for li, layer in enumerate(self.layers):
            x, h = self._norm_in(ops, layer, x, delta)
            q, k, v = self._attn_in(ops, layer, h, cos, sin, dtype)  # [S, Hq, D], [S, Hkv, D]
            cache.write(li, slot_S, k, v)
            # the G query heads of one kv head act as G query rows against that head's keys (no K/V repeat)
            q4 = q.view(S, self.num_kv_heads, G, self.head_dim)
            if not rows:
                k_pages, v_pages = cache.pages(li)  # [pages, page_size, Hkv, D]
                o = attention(q4, k_pages, v_pages, table_SP, length_S, softmax_scale=self.scale)
            else:
                k_rows, v_rows = work.k_rows[li], work.v_rows[li]  # [R, Hkv, T_max, D]
                k_rows[rows_S, :, pos_S] = k
                v_rows[rows_S, :, pos_S] = v
                o = masked_attention(q4, k_rows[:S, :, :T], v_rows[:S, :, :T], dead_S11T, self.scale, work.scores)
            x, delta = self._attn_out_mlp(ops, layer, x, o.reshape(S, -1), work)  # o: [S, Hkv, G, D]
        norm = self.model.model.norm
        _, h = ops.add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)
        return self._lm_head(h, None if work is None else work.logits)  # [S, V] fp32

    def _logits(self, ops, residual_PH: torch.Tensor) -> torch.Tensor:
        norm = self.model.model.norm
        return self._lm_head(ops.rms_norm(residual_PH, norm.weight, norm.variance_epsilon))  # [P, V] fp32

    def _lm_head(self, h_MH: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``logits = h Wᵀ (+ b)`` ``[M, V]``, accumulated and returned in fp32 like the training kernels' (never
        rounded to bf16 before the softmax). bf16/fp16 on CUDA: cuBLAS with an fp32 output (``torch.mm``'s
        ``out_dtype``), the weights read once in their own dtype; elsewhere fp32 products over vocabulary chunks of
        ``LM_HEAD_CHUNK`` rows (one chunk of the weight upcast at a time). ``out`` (off CUDA): a flat fp32 buffer the
        product ``W hᵀ`` is written to; the logits are then its feature-major ``[M, V]`` view (see ``_linear_t``)."""
        weight_VH, bias_V = self.model.lm_head.weight, self.model.lm_head.bias
        with torch.autocast(h_MH.device.type, enabled=False):
            if h_MH.dtype == weight_VH.dtype == torch.float32:
                return F.linear(h_MH, weight_VH, bias_V) if out is None else _linear_t(h_MH, weight_VH, bias_V, out)
            if h_MH.is_cuda:
                logits_MV = torch.mm(h_MH, weight_VH.to(h_MH.dtype).t(), out_dtype=torch.float32)
                return logits_MV if bias_V is None else logits_MV + bias_V.float()
            M, V = h_MH.shape[0], weight_VH.shape[0]
            h32 = h_MH.float()
            logits_VM = torch.empty(V, M, device=h_MH.device) if out is None else out[: V * M].view(V, M)
            for v0 in range(0, V, LM_HEAD_CHUNK):
                w_CH = weight_VH[v0 : v0 + LM_HEAD_CHUNK].float()
                torch.mm(w_CH, h32.t(), out=logits_VM[v0 : v0 + LM_HEAD_CHUNK])
            if bias_V is not None:
                logits_VM += bias_V.float()[:, None]
            return logits_VM.t()


def _linear_t(x_MK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None, out: torch.Tensor):
    """``F.linear(x, weight, bias)`` for 2-D ``x``, computed as ``W xᵀ`` into the flat buffer ``out`` (``[N, M]``,
    contiguous) and returned as its ``[M, N]`` view, feature-major (strides (1, M)).

    For a few rows (decode: M = the batch) MKL's product is up to 2x faster with the weight as the long operand
    (the 16K × 256 LM head of ``bench_generation.py`` at M = 32: 2.1–2.5 ms against 3.4–4.9 ms cache-cold; the MLP's
    704 × 256 products 95 against 124 µs), and the buffer saves a fresh allocation per step. Elementwise ops and
    the next product take the view as it is (``x`` may itself be such a view: ``xᵀ`` is then contiguous)."""
    M, N = x_MK.shape[0], weight_NK.shape[0]
    y_NM = torch.mm(weight_NK, x_MK.t(), out=out[: N * M].view(N, M))
    if bias_N is not None:
        y_NM += bias_N[:, None]
    return y_NM.t()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: ``weight · (x / sqrt(mean(x²) + eps))``, normalised in fp32, cast back, then scaled.

    fp32 off CUDA: torch's fused ``rms_norm`` (one kernel instead of six; bit-identical to the composition on CPU for
    hidden sizes 8-4096 and 1-77 rows, 1 and 2 threads)."""
    if x.dtype == weight.dtype == torch.float32 and not x.is_cuda:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
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
    """Decode attention by the Triton kernel through the pages on CUDA; the row cache elsewhere (the CPU path)."""
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


def _sample_streams(seed: int, sample_S: torch.Tensor) -> torch.Tensor:
    """The key of each sample's random stream, a hash of (call seed, sample id): computed once when a sample takes
    its row, so that a decode step hashes only the token index (``_row_seeds``)."""
    return _mix31(_mix31(torch.full_like(sample_S, seed & SEED_MASK)) ^ sample_S)


def _row_seeds(stream_S: torch.Tensor, index_S: torch.Tensor) -> torch.Tensor:
    """The seed of each row's next draw: a hash of (call seed, sample id, index of the token being drawn), from the
    sample's stream key, on the rows' device (no host sync). A sample's noise is then the same whatever batch or row
    it runs in."""
    return _mix31(stream_S ^ index_S)


def _row_uniforms(seeds_S: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row, fp64 with 53 random bits, from the row's stream (``_row_seeds``): the high 31
    bits are the seed itself, the low 22 a second hash of it. On the rows' device, no host sync."""
    low = _mix31(seeds_S ^ 0x2545F491) >> 9  # 22 bits
    return ((seeds_S << 22) | low).double() * 2.0**-53


def _sample(logits_SV: torch.Tensor, params: SamplingParams, seeds_S: torch.Tensor):
    """Draw one token per row (row r from its stream ``seeds_S[r]``); returns (token [S] int64, log-prob [S] fp32
    before top-p/top-k truncation). ``logits_SV`` is consumed: the unfused path works in place on it.

    On CUDA (the Triton kernels) the draw is Gumbel-max over the row's uniforms ``U(seed, v)``; elsewhere it is the
    inverse CDF with one uniform per row (``inverse_cdf_sample``): the same distribution, no ``[S, V]`` noise."""
    if params.greedy:
        logp = torch.log_softmax(logits_SV, dim=-1)
        tok = logits_SV.argmax(dim=-1)
        return tok, logp.gather(1, tok[:, None]).squeeze(1)
    fused = _use_fused_sampling(logits_SV)
    plain = not params.top_k and params.top_p == 1.0
    if plain and fused:
        return gumbel_sample(logits_SV, params.temperature, seeds_S)
    if plain:  # w = exp(x − max x) in place, x = logits / T; log p[token] = log w[token] − log Σ w
        w_SV = logits_SV if params.temperature == 1.0 else logits_SV.div_(params.temperature)
        w_SV.sub_(w_SV.amax(dim=-1, keepdim=True)).exp_()
        tok, total = inverse_cdf_sample(w_SV, _row_uniforms(seeds_S))
        return tok, (w_SV.gather(1, tok[:, None]).squeeze(1).double().log() - total.log()).float()
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
    if fused:  # Gumbel(0, 1) noise −log(−log u) from the kernel's uniforms (philox, no host sync)
        u = uniform_rows(seeds_S, kept.shape[-1])  # [S, V]
        tok = (kept - (-u.log()).log()).argmax(dim=-1)
    else:  # the truncated tokens have weight exp(−inf) = 0: never drawn
        tok, _ = inverse_cdf_sample(kept.exp(), _row_uniforms(seeds_S))
    return tok, logp.gather(1, tok[:, None]).squeeze(1)


class _Run:
    """One ``generate`` call: the device step driven by a :class:`~fastgrpo.scheduler.Scheduler` (one wave)."""

    def __init__(self, engine: GenerationEngine, prompts, params, device, dtype, seed, cos_TD, sin_TD, budget):
        self.e = engine
        self.prompts = prompts
        self.params = params
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self.budget = budget  # KV tokens
        self.cos_TD, self.sin_TD = cos_TD, sin_TD
        cuda = device.type == "cuda"
        self.sync_every = engine._sync_every or (CUDA_SYNC_EVERY if cuda else 1)
        self.use_graphs = cuda and engine._cuda_graphs is not False
        self.ops = engine._ops(device)
        self.stop_set = set(engine.eos_token_ids) | set(params.stop_token_ids)
        self.stop_ids = torch.tensor(sorted(self.stop_set), dtype=torch.long, device=device)
        self.ps = engine.page_size or DEFAULT_PAGE_SIZE[device.type == "cuda"]
        self.lengths = [len(p) for p in prompts]
        self.limits = [params.response_limit(n) for n in self.lengths]
        # the pool never needs more than every sample's full length at once (+ prompt pages, the scratch page)
        ps = self.ps
        worst = sum(params.n * -(-(a + b) // ps) - (-a // ps) for a, b in zip(self.lengths, self.limits)) + 1
        try:
            self.sched = Scheduler(
                self.lengths, params.n, self.limits, self.ps, min(budget // self.ps, worst), engine.max_batch_size
            )
        except ValueError as err:
            raise ValueError(f"max_total_tokens={budget} ({budget // self.ps} pages of {self.ps}): {err}") from None

    def run(self, on_group_done) -> list[list[Completion]]:
        e, P, n, ps = self.e, len(self.prompts), self.params.n, self.ps
        L, Hkv, D = len(e.layers), e.num_kv_heads, e.head_dim
        R = min(e.max_batch_size, P * n)  # rows
        dev = self.device
        max_pages = max(self.sched.pages_for(a + b) for a, b in zip(self.lengths, self.limits))
        max_new = max(self.limits)
        # zeroed: masked-out keys still enter the CPU attention's P @ V, where 0 * NaN would be NaN
        cache = _KVCache(
            k=torch.zeros(L, Hkv, self.sched.num_pages, ps, D, device=dev, dtype=self.dtype),
            v=torch.zeros(L, Hkv, self.sched.num_pages, ps, D, device=dev, dtype=self.dtype),
        )
        if not _use_fused_attention(cache.k):
            cache.work = self._workspace(R, max_pages * ps)
        self.row_owner: list = [None] * R  # the sequence whose keys each row of the row cache holds
        self.st = _RowState(
            tok=torch.zeros(R, dtype=torch.long, device=dev),  # token fed at the next step
            pos=torch.zeros(R, dtype=torch.long, device=dev),  # its position (= tokens already cached)
            n_gen=torch.zeros(R, dtype=torch.long, device=dev),  # tokens generated so far
            done=torch.ones(R, dtype=torch.bool, device=dev),  # finished or padding
            limit=torch.ones(R, dtype=torch.long, device=dev),  # the sample's response limit
            stream=torch.zeros(R, dtype=torch.long, device=dev),  # h(seed, its sample id): its random stream
            out_tok=torch.zeros(R, max_new, dtype=torch.long, device=dev),
            out_lp=torch.zeros(R, max_new, dtype=torch.float32, device=dev),
            table=torch.zeros(R, max_pages, dtype=torch.int32, device=dev),  # block tables (0 = scratch page)
        )
        self.graphs = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.logits_RV = torch.empty(R, e.vocab_size, device=dev) if self.use_graphs else None
        self.stats = dict(decode_steps=0, prefill_tokens=0)
        try:
            return self._loop(cache, R, on_group_done)
        finally:
            self.graphs = None  # the graphs hold the cache's addresses: drop them with it
            sched = self.sched
            e.last_stats = dict(
                peak_running=sched.peak_running,
                preemptions=sched.preemptions,
                decode_steps=self.stats["decode_steps"],
                prefill_tokens=self.stats["prefill_tokens"],
                peak_kv_tokens=sched.peak_pages * ps,
                kv_capacity_tokens=(sched.num_pages - 1) * ps,
                page_size=ps,
            )

    def _workspace(self, R: int, max_keys: int) -> _Workspace:
        """The eager decode step's row cache and buffers for ``R`` rows of at most ``max_keys`` keys (see
        :class:`_Workspace`): by default the row cache only when it holds no more tokens than the KV budget
        (``R · max_keys ≤ max_total_tokens``: the eager path's K/V stays within twice the budget); no activation
        buffers under autocast."""
        e, dev, dt = self.e, self.device, self.dtype
        shape = (len(e.layers), R, e.num_kv_heads, max_keys, e.head_dim)
        rows = R * max_keys <= self.budget if e._row_cache is None else e._row_cache
        plain = dt == next(e.model.parameters()).dtype
        inter = e.layers[0].mlp.gate_proj.out_features
        return _Workspace(
            # zeroed: never-written keys stay finite (their weight is 0 in P V, and 0 · NaN would be NaN)
            k_rows=torch.zeros(shape, device=dev, dtype=dt) if rows else None,
            v_rows=torch.zeros(shape, device=dev, dtype=dt) if rows else None,
            scores=torch.empty(R * e.num_heads * max_keys, device=dev),
            gate=torch.empty(R * inter, device=dev, dtype=dt) if plain else None,
            up=torch.empty(R * inter, device=dev, dtype=dt) if plain else None,
            down=torch.empty(R * e.model.config.hidden_size, device=dev, dtype=dt) if plain else None,
            logits=torch.empty(R * e.vocab_size, device=dev) if plain else None,
        )

    def _refresh_rows(self, work: _Workspace, cache: _KVCache, n_pages: int) -> None:
        """Copy into the row cache, from the pages, every running row whose sequence is not the one it holds."""
        rows = [row for row, seq in enumerate(self.sched.rows) if self.row_owner[row] is not seq]
        self.row_owner[len(self.sched.rows) :] = [None] * (len(self.row_owner) - len(self.sched.rows))
        if not rows:
            return
        for row in rows:
            self.row_owner[row] = self.sched.rows[row]
        idx = torch.tensor(rows, device=self.device)
        pages_NP = self.st.table[idx, :n_pages].long()
        L, Hkv, _, ps, D = cache.k.shape
        T = n_pages * ps
        for pool, row_cache in ((cache.k, work.k_rows), (cache.v, work.v_rows)):
            keys = pool[:, :, pages_NP]  # [L, Hkv, N, P, page_size, D]
            row_cache[:, idx, :, :T] = keys.transpose(1, 2).reshape(L, len(rows), Hkv, T, D)

    def _loop(self, cache, R, on_group_done) -> list[list[Completion]]:
        P, n, st, sched = len(self.prompts), self.params.n, self.st, self.sched
        results: list[list[Completion | None]] = [[None] * n for _ in range(P)]
        unfinished = [n] * P  # samples of each prompt not finished yet
        last_hidden: dict[int, torch.Tensor] = {}  # [H] of each prompt whose pages are held
        rows = torch.arange(R, device=self.device)
        S_b = 0  # rows [0, S_b) are stepped
        table_rows, table_layout = 0, []  # the block tables in st.table: rows written, (sequence, pages) per row
        steps = self.sync_every
        while True:
            # ---- host bookkeeping: one device->host read of the flags and counts per sync_every steps
            running = len(sched.rows)
            if running:
                done, n_gen = torch.stack((st.done[:running].long(), st.n_gen[:running])).tolist()
                finished = []
                for row, seq in enumerate(sched.rows):
                    seq.generated = n_gen[row]
                    if done[row]:
                        finished.append(seq)
                if finished:
                    self._read_tokens(finished)
                    for seq in finished:
                        stopped = seq.tokens[-1] in self.stop_set
                        results[seq.prompt][seq.sample % n] = Completion(
                            seq.tokens, seq.logprobs, "stop" if stopped else "length"
                        )
                        sched.finish(seq)
                        unfinished[seq.prompt] -= 1
                        if unfinished[seq.prompt] == 0 and on_group_done is not None:
                            on_group_done(seq.prompt, results[seq.prompt])
                preempted = sched.grow(steps, before_leave=self._read_tokens)
                if preempted:
                    st.done[[row for _, row in preempted]] = True
                    for _, row in preempted:  # its row cache is stale if it comes back (recomputed)
                        self.row_owner[row] = None
                moves = sched.compact()
                if moves:
                    src = torch.tensor([m[0] for m in moves], device=self.device)
                    dst = torch.tensor([m[1] for m in moves], device=self.device)
                    for t in st:
                        t[dst] = t[src]
            admission = sched.admit(steps)
            self._admit(cache, admission, last_hidden)
            if running and (preempted or moves) or admission.prefill or admission.recompute or admission.fresh:
                table_layout = []  # rows may hold other sequences, or a sequence other pages: rebuild the tables
            for p in list(last_hidden):
                if p not in sched.prompt_pages:
                    del last_hidden[p]
            if admission.fresh:
                continue  # a sample can finish at its first token (stop token or a limit of 1): harvest it first
            if sched.done:
                break
            running = len(sched.rows)
            S_b = _bucket(running, R)
            # otherwise the block tables change only when a row's sequence gets a page (appended to its pages)
            layout = [(seq, len(seq.pages)) for seq in sched.rows]
            if S_b != table_rows or len(layout) != len(table_layout) or any(
                a is not b or n != m for (a, n), (b, m) in zip(layout, table_layout)
            ):
                width = st.table.shape[1]
                table = [seq.pages + [0] * (width - len(seq.pages)) for seq in sched.rows]
                table += [[0] * width] * (S_b - running)  # padding rows: the scratch page
                st.table[:S_b] = torch.tensor(table, dtype=torch.int32).to(self.device, non_blocking=True)
                table_rows, table_layout = S_b, layout
            if running < S_b:
                st.done[running:S_b] = True  # padding rows: write to the scratch page, never recorded
                st.pos[running:S_b] = 0
            n_pages = max(len(seq.pages) for seq in sched.rows)
            if cache.work is not None and cache.work.k_rows is not None:
                self._refresh_rows(cache.work, cache, n_pages)

            # ---- sync_every decode steps without reading anything back
            for _ in range(steps):
                logits = self._step(cache, S_b, n_pages)  # [S_b, V] fp32
                tok, lp = _sample(logits, self.params, _row_seeds(st.stream[:S_b], st.n_gen[:S_b]))
                live_S = ~st.done[:S_b]
                col = st.n_gen[:S_b].clamp(max=st.out_tok.shape[1] - 1)
                r = rows[:S_b]
                st.out_tok[r, col] = torch.where(live_S, tok, st.out_tok[r, col])
                st.out_lp[r, col] = torch.where(live_S, lp, st.out_lp[r, col])
                st.n_gen[:S_b] += live_S
                stop = torch.isin(tok, self.stop_ids) | (st.n_gen[:S_b] >= st.limit[:S_b])
                st.done[:S_b] |= live_S & stop
                st.pos[:S_b] += live_S
                st.tok[:S_b] = torch.where(live_S, tok, st.tok[:S_b])
            self.stats["decode_steps"] += steps
        return results

    def _read_tokens(self, seqs) -> None:
        """Copy the generated tokens and log-probs of ``seqs`` (at their rows) to the host."""
        idx = torch.tensor([s.row for s in seqs], device=self.device)
        toks, lps = self.st.out_tok[idx].tolist(), self.st.out_lp[idx].tolist()
        for s, tk, lp in zip(seqs, toks, lps):
            s.tokens, s.logprobs = tk[: s.generated], lp[: s.generated]

    def _admit(self, cache, adm: Admission, last_hidden) -> None:
        """Prefill new prompts and recomputed samples into their pages, copy partial prompt pages, sample first
        tokens, and fill the admitted rows' state."""
        sched, st, dev, ps = self.sched, self.st, self.device, self.ps
        seqs = [(self.prompts[p], sched.prompt_pages[p], p) for p in adm.prefill]
        seqs += [(self.prompts[s.prompt] + s.tokens[:-1], s.pages, None) for s in adm.recompute]
        if seqs:
            last_hidden.update(self._prefill_all(cache, seqs))
        fresh = adm.fresh
        if fresh:
            copies = [
                (sched.prompt_pages[s.prompt][s.shared], s.pages[s.shared]) for s in fresh if s.prompt_len % ps
            ]
            if copies:  # the partly filled last prompt page, one private copy per sample
                src = torch.tensor([c[0] for c in copies], device=dev)
                dst = torch.tensor([c[1] for c in copies], device=dev)
                cache.copy_pages(src, dst)
            idx = torch.tensor([s.row for s in fresh], device=dev)
            logits = self.e._logits(self.ops, torch.stack([last_hidden[s.prompt] for s in fresh]))  # [A, V]
            sample_A = torch.tensor([s.sample for s in fresh], device=dev)
            stream_A = _sample_streams(self.seed, sample_A)
            tok, lp = _sample(logits, self.params, _row_seeds(stream_A, torch.zeros_like(sample_A)))
            limits = torch.tensor([s.limit for s in fresh], device=dev)
            st.tok[idx] = tok
            st.pos[idx] = torch.tensor([s.prompt_len for s in fresh], device=dev)
            st.n_gen[idx] = 1
            st.out_tok[idx, 0] = tok
            st.out_lp[idx, 0] = lp
            st.limit[idx] = limits
            st.stream[idx] = stream_A
            st.done[idx] = torch.isin(tok, self.stop_ids) | (limits <= 1)
        sched.release_prompts()
        for s in adm.recompute:  # continue from the last sampled token, with everything kept
            c = len(s.tokens)
            st.tok[s.row] = s.tokens[-1]
            st.pos[s.row] = s.prompt_len + c - 1
            st.n_gen[s.row] = c
            st.out_tok[s.row, :c] = torch.tensor(s.tokens, device=dev)
            st.out_lp[s.row, :c] = torch.tensor(s.logprobs, device=dev)
            st.limit[s.row] = s.limit
            st.stream[s.row] = _sample_streams(self.seed, torch.tensor([s.sample], device=dev))[0]
            st.done[s.row] = False

    def _prefill_all(self, cache, seqs) -> dict[int, torch.Tensor]:
        """Prefill ``(tokens, pages, prompt or None)`` sequences in packed chunks (longest first), K/V into their
        pages; returns the last hidden state ``[H]`` of each prompt (None: a recompute, whose next token is known)."""
        e, dev, ps = self.e, self.device, self.ps
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
        last_hidden = {}
        i = 0
        while i < len(order):
            chunk = [order[i]]
            total = len(seqs[order[i]][0])
            i += 1
            while i < len(order) and total + len(seqs[order[i]][0]) <= PREFILL_CHUNK_TOKENS:
                chunk.append(order[i])
                total += len(seqs[order[i]][0])
                i += 1
            tokens, positions, slots, groups, start = [], [], [], [], 0
            for c in chunk:
                toks, pages, _ = seqs[c]
                m = len(toks)
                tokens += toks
                positions += range(m)
                slots += [pages[t // ps] * ps + t % ps for t in range(m)]
                if groups and groups[-1][2] == m:
                    groups[-1] = (groups[-1][0], groups[-1][1] + 1, m)
                else:
                    groups.append((start, 1, m))
                start += m
            x = e._prefill(
                self.ops,
                torch.tensor(tokens, device=dev),
                torch.tensor(positions, device=dev),
                groups,
                self.cos_TD,
                self.sin_TD,
                cache,
                torch.tensor(slots, device=dev),
                self.dtype,
            )  # [N_chunk, H]
            self.stats["prefill_tokens"] += total
            start = 0
            for c in chunk:
                start += len(seqs[c][0])
                if seqs[c][2] is not None:
                    last_hidden[seqs[c][2]] = x[start - 1]
        return last_hidden

    def _step(self, cache: _KVCache, S_b: int, n_pages: int) -> torch.Tensor:
        st = self.st
        if not self.use_graphs:
            return self.e._decode_forward(
                self.ops, cache, st.tok[:S_b], st.pos[:S_b], st.table[:S_b, :n_pages], self.cos_TD, self.sin_TD,
                self.dtype,
            )  # fmt: skip
        if S_b not in self.graphs:
            self.graphs[S_b] = self._capture(cache, S_b)
        self.graphs[S_b].replay()
        return self.logits_RV[:S_b]

    def _capture(self, cache: _KVCache, S_b: int):
        """Capture the decode forward for batch bucket ``S_b`` (full-width block tables: no per-length graph),
        writing the one logits buffer. Warm-up runs recompute the current step's K/V: harmless."""
        st = self.st

        def forward():
            logits = self.e._decode_forward(
                self.ops, cache, st.tok[:S_b], st.pos[:S_b], st.table[:S_b], self.cos_TD, self.sin_TD, self.dtype
            )
            self.logits_RV[:S_b].copy_(logits)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            forward()
        return graph
