"""Co-located generation: batched sampling with the training model's own parameter tensors.

The engine never copies a weight. It walks ``model.model.layers`` and calls each layer's own submodules (the
q/k/v/o projections with their biases, Qwen3's q_norm/k_norm, the RMSNorms, the MLP) on its own activations, with
a KV cache of its own that lives only for the duration of one :meth:`GenerationEngine.generate` call, so training
gets the memory back as soon as the rollout is done and the next rollout sees the optimizer's latest update.

One call, step by step (the host bookkeeping is ``fastgrpo.engine.scheduler.Scheduler``; this file and the ``engine_*``
modules listed below are the device step):

1. **Pages.** The KV cache is a pool of pages ``kv: [layers, 2, Hkv, pages, page_size, D]`` (keys, values) sized
   from the budget (``max_total_tokens``, or 80% of the free GPU memory), allocated per call and freed on return.
   Every sample of every prompt is queued at once (one wave) and admitted when pages and rows allow.
2. **Prefill, once per prompt, packed, straight into pages.** The prompts admitted in a round are concatenated into
   one row with per-sequence positions (no padding); attention runs per group of equal-length prompts (one causal
   SDPA per group) and each token's K/V go to its page. A prompt's ``n`` samples reference its full pages (reference
   counts) and get a private copy of its partly filled last page; the prompt's last hidden state gives each sample
   its first token.
3. **Decode.** One token per running sample per step: ``x_S -> layers -> logits_SV (fp32)``, sample, append. The
   attention reads each sample's keys through its block table: on CUDA the split-K paged kernel of
   ``fastgrpo.kernels.decode_attention`` (the G query heads of a kv head as G query rows, no K/V repeat). On CPU a
   row cache (``_Workspace``) holds each running row's keys contiguously: a row that gets another sequence is
   loaded from its pages through the block table, every step writes its token to the row (the pages get a row's
   new K/V when its sequence leaves the row keeping them), and the attention is SDPA over the row with the keys
   past its length masked (re-gathering every page at every layer and step would copy the live K/V once more per
   step). Every ``sync_every`` steps the host reads the flags and
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
   step runs its LM head, MLP and q/k/v products on weights packed for MKL or writes them (logits, MLP) into
   reused buffers instead of fresh tensors, whichever its first call measured faster on this host
   (``engine_cache``).

5. **Turns (multi-turn, ``generate(..., turns=)``; host side in ``engine_turns.py``).** A sample whose turn ends at
   a boundary (eos/stop token, or a stop string matched on the decoded tail; a match seen late with
   ``sync_every`` > 1 is trimmed and the pages of the trimmed tokens freed) pauses: it leaves its row, keeps its pages,
   and the turn handler's ``start`` is called while the others go on decoding. The handler's answer (polled every
   ``sync_every`` steps; a blocking wait only when nothing decodes) ends the trajectory or appends tokens: at
   admission the last sampled token and the appended ones are prefilled into the sample's own pages against its
   cached K/V (``_prefill_onto``: a few new tokens, nothing before recomputed), and its next turn's first token is
   sampled from that prefill. The device step stays one batched decode of whatever rows run; pausing, evicting and
   resuming are the scheduler's. A sample evicted while paused, or preempted mid-turn, is recomputed from all its
   tokens (prompt, turns, observations). Single-turn (no handler) is the case of one turn: its outputs are bit for
   bit those of the engine before turns existed.

Memory (DeepSeek-R1-Distill-Qwen-1.5B, bf16): 28 KiB of K/V per token (28 layers × 2 × 2 kv heads × 128 × 2 B), so
a 64-token page is 1.75 MiB; 40 GiB of pool hold ~1.5M tokens, e.g. 128 sequences at 12K tokens on average. Host
state is O(pages + samples). Multi-turn: a paused sample holds the pages of its whole conversation while its
environment runs: 224 MiB at 8K tokens, 448 MiB at 16K, 672 MiB at 24K; 128 samples per rank paused at 12K on
average hold 42 GiB, more than the 40 GiB pool, so the pool, not the rows, bounds how many conversations can wait on
environments at once; beyond that the latest-paused are evicted (pages freed, the conversation prefilled again in
full when it resumes: the cost the KV reuse saves, paid only under memory pressure). The conversation budget
(``max_sequence_tokens``, default the model's context) sizes the block tables and, on CPU, the row cache: set it to
the real bound. ``engine.last_stats`` reports each call: peak_running, preemptions, decode_steps, prefill_tokens
(prompts, recomputes and resumed turns' appended tokens), resume_prefill_tokens (the appended ones: observations +
the one sampled token per resume whose K/V were not cached), re_prefill_tokens (what re-prefilling the whole
conversation at every resumed turn would have cost, TRL's way), evictions (paused samples whose pages were freed),
peak_paused, peak_kv_tokens, kv_capacity_tokens, page_size, and for the CPU step which weight groups ran on
MKL-packed weights and how that was chosen (cpu_packed, cpu_packed_by, cpu_product_ms: ``fastgrpo.engine.cache``).

Where it lives (``fastgrpo.engine.engine`` is the entry module; it re-exports the public names):

- ``generation.py``: ``GenerationEngine`` (validation, ``generate``, the KV budget, the decode forward) and ``_Run``
  (one call: its scheduler, pool and row state).
- ``engine_loop.py``: the host loop of a call (harvest, grow/preempt/compact/admit through the scheduler, packed
  prefill, first tokens, block tables, the ``sync_every`` decode steps) and the rows' device state.
- ``engine_forward.py``: the model pieces (projections, packed prefill, the prefill onto cached K/V, MLP, fp32 LM
  head) and the fused ops.
- ``engine_cache.py``: the KV page pool and the CPU row cache / reused step buffers.
- ``engine_cuda.py``: the CUDA graph capture and replay of the decode step.
- ``engine_sampling.py``: ``SamplingParams``, ``Completion``, ``TurnHandler``/``TurnResult``, the per-sample random
  streams and the token draw.
- ``engine_turns.py``: turn ends, stop strings, the turn handler's answers (the host side of multi-turn).
- ``fastgrpo.engine.scheduler``: the host bookkeeping, the one place that knows which sample is where.

Sampling (``engine_sampling.py`` states the math): greedy, or temperature / top-k / top-p from one random stream per
sample (its tokens do not depend on the batch, row or ``sync_every``); the logits are fp32, and the returned
log-prob is ``logp[token]`` under the temperature-scaled distribution before top-p/top-k truncation.

Tensor names carry their shape: S rows (running samples), P block-table width, N packed prompt tokens, V vocabulary,
H hidden size, Hq/Hkv query/key-value heads, G = Hq / Hkv, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

from fastgrpo.engine.cache import _KVCache, _RowCacheSteps
from fastgrpo.engine.cuda_graphs import _GraphSteps
from fastgrpo.engine.forward import LM_HEAD_CHUNK, _ModelPieces, _Ops
from fastgrpo.engine.loop import PREFILL_CHUNK_TOKENS, _DecodeLoop, _RowState
from fastgrpo.engine.sampling import Completion, SamplingParams, TurnHandler, TurnResult, _use_fused_sampling
from fastgrpo.engine.scheduler import Scheduler
from fastgrpo.engine.turns import _TurnSteps
from fastgrpo.kernels.decode_attention import masked_attention, paged_decode_attention, paged_decode_attention_torch
from fastgrpo.kernels.utils import use_triton
from fastgrpo.models.lora import check_modules, unwrap_peft

__all__ = [
    "GenerationEngine", "SamplingParams", "Completion", "TurnHandler", "TurnResult", "PREFILL_CHUNK_TOKENS",
    "LM_HEAD_CHUNK",
    "SUPPORTED_MODEL_TYPES", "DEFAULT_CPU_TOTAL_TOKENS", "CUDA_MEMORY_FRACTION", "CUDA_SYNC_EVERY", "DEFAULT_PAGE_SIZE",
]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
DEFAULT_CPU_TOTAL_TOKENS = 1 << 18  # KV-cache budget on CPU when max_total_tokens is not given
CUDA_MEMORY_FRACTION = 0.8  # share of the free GPU memory the KV cache may take when max_total_tokens is not given
CUDA_SYNC_EVERY = 8  # decode steps between reads of the stop flags on CUDA (a finished slot idles at most this long)
# tokens per KV page, {on CUDA: True/False}. CUDA: 64 = the decode kernel's keys per inner step (one page per
# step); a sequence wastes < 64 tokens (1.8 MiB for the 1.5B model), nothing next to 24K-token responses. CPU: 16,
# the tiny models' gathers and partial-page copies stay small.
DEFAULT_PAGE_SIZE = {True: 64, False: 16}


class GenerationEngine(_ModelPieces):
    """Batched sampling with ``model``'s own parameters and a KV cache that lives only during :meth:`generate`.

    Args:
        model: a Hugging Face causal LM of a supported architecture (Llama, Qwen2/2.5, Qwen3), or a PEFT
            ``PeftModel`` of one with LoRA adapters (read unmerged: base + adapter per projection). Its parameters are
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
        cpu_packed: on CPU (fp32, MKL), run the LM head's, MLP's and q/k/v's products on weights packed for MKL's
            GEMM (True) or as plain products (False); None = ``FASTGRPO_CPU_PACKED`` (0, 1, or auto: each weight
            group's two products timed once per process and shapes, the faster kept; see ``fastgrpo.engine.cache``).
        tokenizer: decodes a turn's tokens (anything with ``decode(list[int]) -> str``, e.g. a Hugging Face
            tokenizer): needed for ``SamplingParams.stop_strings`` (matched on the decoded tail) and for a turn
            handler (its ``turn_text``). Never used to encode.
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
        cpu_packed: bool | None = None,
        tokenizer=None,
    ):
        model = unwrap_peft(model)  # a PeftModel: its model, LoRA layers in place (read unmerged, fastgrpo.models.lora)
        check_modules(model)
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
        if cpu_packed is not None and not isinstance(cpu_packed, bool):
            raise ValueError(f"cpu_packed must be True, False or None, got {cpu_packed!r}")
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(f"tokenizer must have a decode(ids) method, got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
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
        self._cpu_packed = cpu_packed

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
        turns: TurnHandler | None = None,
    ) -> list[list[Completion]]:
        """Sample ``params.n`` completions for each prompt; returns ``[prompt][sample]`` :class:`Completion`.

        The model runs in eval mode under ``inference_mode`` (no autograd bookkeeping: 5-8% of a CPU call of
        bench_generation.py against ``no_grad``) and gets its previous mode back afterwards; ``on_group_done`` and
        the turn handler are called inside it too (a tensor they create is an inference tensor: no autograd, no
        in-place update outside inference mode). A completion
        ends at the first token in ``eos_token_ids`` ∪ ``params.stop_token_ids`` (that token is included, reason
        "stop"), at the token that completes the first ``params.stop_strings`` match in its decoded text ("stop";
        see ``fastgrpo.engine.turns``), or after ``params.response_limit(len(prompt))`` tokens (reason "length").

        ``turns`` (multi-turn, see ``fastgrpo.engine.turns``): a sample whose turn ends at one of those boundaries
        pauses with its KV pages kept while the others go on decoding, and ``turns.start(key, turn_ids, turn_text)``
        is called; the handler's answer (``turns.ready``) ends the trajectory or gives tokens to append, which are
        prefilled into the sample's pages against its cached K/V, and decoding resumes. ``params.max_new_tokens``
        is then per turn, ``params.max_sequence_tokens`` (default: the model's context) bounds the whole
        conversation, ``params.max_turns`` the sampled turns.

        ``on_group_done(prompt_index, completions)`` is called as soon as all ``params.n`` samples of a prompt have
        finished (in finishing order, each prompt exactly once, before ``generate`` returns), so a caller can score
        a group while the others still decode. ``completions`` is the same list the return value holds.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if on_group_done is not None and not callable(on_group_done):
            raise ValueError(f"on_group_done must be callable or None, got {type(on_group_done).__name__}")
        if turns is not None and not (callable(getattr(turns, "start", None)) and callable(getattr(turns, "ready",
                                                                                                   None))):
            raise ValueError(f"turns must have start(key, turn_ids, turn_text) and ready(block), got {turns!r}")
        if params.max_turns > 1 and turns is None:
            raise ValueError(f"params.max_turns={params.max_turns} needs a turn handler (generate(..., turns=))")
        if self.tokenizer is None and (params.stop_strings or turns is not None):
            what = "params.stop_strings" if params.stop_strings else "a turn handler (its turn_text)"
            raise ValueError(f"{what} needs the engine's tokenizer (GenerationEngine(..., tokenizer=))")
        prompts = self._check_prompts(prompt_token_ids, params, multi_turn=turns is not None)
        if not prompts:
            return []
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"params.stop_token_ids {bad_stop} are outside the vocabulary [0, {self.vocab_size})")

        model = self.model
        param = next(model.parameters())
        device = param.device
        dtype = self._dtype or param.dtype
        max_context = self._max_context(params) if turns is not None else None  # a conversation's budget
        max_len = max_context or max(len(p) + params.response_limit(len(p)) for p in prompts)  # T
        budget = self._budget_tokens(device, dtype)

        if params.seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        else:
            seed = params.seed

        was_training = model.training
        model.eval()
        self._read_adapters()  # LoRA: base + adapters, unmerged (fastgrpo.models.lora)
        try:
            with torch.inference_mode(), self._autocast(device, dtype, param.dtype):
                cos_TD, sin_TD = self._rope_tables(max_len, device, dtype)
                run = _Run(self, prompts, params, device, dtype, seed, cos_TD, sin_TD, budget, turns, max_context)
                return run.run(on_group_done)
        finally:
            model.train(was_training)
            self._lora = {}  # the adapters are read afresh by the next call

    # ------------------------------------------------------------------ validation and planning

    def _max_context(self, params: SamplingParams) -> int:
        """Multi-turn: most tokens a conversation may reach (max_sequence_tokens, within the model's context)."""
        return min(params.max_sequence_tokens or self.max_positions, self.max_positions)

    def _first_limit(self, params: SamplingParams, prompt_len: int, multi_turn: bool) -> int:
        if not multi_turn:
            return params.response_limit(prompt_len)
        return min(params.max_new_tokens, self._max_context(params) - prompt_len)

    def _check_prompts(self, prompt_token_ids, params: SamplingParams, multi_turn: bool = False) -> list[list[int]]:
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
            limit = self._first_limit(params, len(p), multi_turn)
            if limit < 1:
                raise ValueError(
                    f"prompt_token_ids[{i}] has {len(p)} tokens: no room for a response within "
                    f"params.max_sequence_tokens={params.max_sequence_tokens}"
                    + (f" and the model's context of {self.max_positions}" if multi_turn else "")
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

    # ------------------------------------------------------------------ the decode forward

    def _decode_forward(self, ops, cache: _KVCache, tok_S, pos_S, table_SP, cos_TD, sin_TD, dtype) -> torch.Tensor:
        """One decode step for rows ``[0, S)``: feed ``tok_S`` at ``pos_S``, write its K/V into the row's page, return
        logits ``[S, V]`` (fp32; with a workspace whose LM head is not packed, a feature-major view of
        ``cache.work.logits``: strides (1, S)).

        Static shapes and no host synchronisation, so it can be captured in a CUDA graph. Attention reads the keys
        ``[0, pos]`` of each row (the query's own key included): through its block table ``table_SP`` on CUDA; on
        CPU from the row cache (:meth:`_decode_rows`) when there is one, its first ``P · page_size`` columns (the
        engine passes only the table columns the longest row uses).
        """
        work = cache.work  # None: the paged kernel (CUDA)
        ps = cache.kv.shape[4]
        if work is not None and work.kv_rows is not None:
            return self._decode_rows(ops, cache, tok_S, pos_S, table_SP.shape[1] * ps, cos_TD, sin_TD, dtype)
        page_S = table_SP.gather(1, (pos_S // ps)[:, None]).squeeze(1).long()
        slot_S = page_S * ps + pos_S % ps  # flat index of the new token's K/V in the pool
        S = tok_S.shape[0]
        G = self.num_heads // self.num_kv_heads
        length_S = pos_S + 1  # keys [0, pos] are live, the current one included
        # the torch path named off CUDA: paged_decode_attention would run the kernel under TRITON_INTERPRET=1
        attention = paged_decode_attention if _use_fused_attention(tok_S) else paged_decode_attention_torch

        def attend(li, q, k, v):  # the G query heads of one kv head act as G query rows (no K/V repeat)
            k_pages, v_pages = cache.pages(li)  # [pages, page_size, Hkv, D]
            q4 = q.view(S, self.num_kv_heads, G, self.head_dim)
            return attention(q4, k_pages, v_pages, table_SP, length_S, softmax_scale=self.scale)  # [S, Hkv, G, D]

        x, delta = self._layers(ops, tok_S, pos_S, cos_TD, sin_TD, cache, slot_S, dtype, attend, work)
        return self._final_logits(ops, x, delta, work)

    def _decode_rows(self, ops, cache: _KVCache, tok_S, pos_S, T, cos_TD, sin_TD, dtype) -> torch.Tensor:
        """The decode step on the CPU row cache: each layer writes the token's K/V to its row
        (``work.kv_rows[layer, row, :, :, pos]``; the pages get them when the sequence leaves the row keeping them,
        ``_RowCacheSteps._flush_rows``), then attends over the row's first ``T`` keys, those past ``pos`` masked
        (:func:`masked_attention`). Without autocast the projections and the rotary embedding run on q, k, v side by
        side (:meth:`_attn_in_rows`)."""
        work = cache.work
        S = tok_S.shape[0]
        Hkv, G, D = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        rows_S = torch.arange(S, device=tok_S.device)
        # additive mask, 0 where live, -inf past pos: SDPA turns a boolean one into this at every call (6 ops)
        dead_S11T = torch.arange(T, device=tok_S.device) > pos_S[:, None]
        mask_S11T = torch.zeros(S, 1, 1, T, device=tok_S.device).masked_fill_(dead_S11T.view(S, 1, 1, T), -math.inf)
        cos, sin = cos_TD[pos_S].unsqueeze(1), sin_TD[pos_S].unsqueeze(1)  # [S, 1, D]
        joint = dtype == self.layers[0].self_attn.q_proj.weight.dtype  # no autocast: q, k, v side by side
        if joint:
            sin_signed = torch.cat((-sin[..., : D // 2], sin[..., D // 2 :]), dim=-1)
        x = self.model.model.embed_tokens(tok_S)  # [S, H]
        delta = None
        for li, layer in enumerate(self.layers):
            x, h = self._norm_in(ops, layer, x, delta)
            if joint:
                q4, kv = self._attn_in_rows(ops, layer, h, cos, sin_signed, work)  # [S, Hkv, G, D], [S, 2, Hkv, D]
            else:
                q, k, v = self._attn_in(ops, layer, h, cos, sin, dtype)
                q4, kv = q.view(S, Hkv, G, D), torch.stack((k, v), 1)
            kv_rows = work.kv_rows[li]  # [R, 2, Hkv, T_max, D]
            kv_rows[rows_S, :, :, pos_S] = kv
            o = masked_attention(q4, kv_rows[:S, 0, :, :T], kv_rows[:S, 1, :, :T], mask_S11T, self.scale)
            x, delta = self._attn_out_mlp(ops, layer, x, o.reshape(S, -1), work)  # o: [S, Hkv, G, D]
        return self._final_logits(ops, x, delta, work)

    def _final_logits(self, ops, x, delta, work) -> torch.Tensor:
        norm = self.model.model.norm
        _, h = ops.add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)
        return self._lm_head(h, work)  # [S, V] fp32


def _use_fused_attention(t: torch.Tensor) -> bool:
    """Decode attention by the Triton kernel through the pages on CUDA; the row cache elsewhere (the CPU path)."""
    return t.is_cuda and use_triton(t)


class _Run(_DecodeLoop, _TurnSteps, _RowCacheSteps, _GraphSteps):
    """One ``generate`` call: the device step driven by a :class:`~fastgrpo.engine.scheduler.Scheduler` (one wave)."""

    def __init__(self, engine: GenerationEngine, prompts, params, device, dtype, seed, cos_TD, sin_TD, budget,
                 turns=None, max_context=None):
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
        self.turns = turns
        self.max_context = max_context  # multi-turn: a conversation's token budget; None: single-turn
        self.lengths = [len(p) for p in prompts]
        self.limits = [engine._first_limit(params, n, turns is not None) for n in self.lengths]
        # the pool never needs more than every sample's full length at once (+ prompt pages, the scratch page)
        ps = self.ps
        ends = [max_context or a + b for a, b in zip(self.lengths, self.limits)]  # a sequence's last position + 1
        worst = sum(params.n * -(-end // ps) - (-a // ps) for a, end in zip(self.lengths, ends)) + 1
        self.max_end = max(ends)
        try:
            self.sched = Scheduler(
                self.lengths, params.n, self.limits, self.ps, min(budget // self.ps, worst), engine.max_batch_size,
                max_context,
            )
        except ValueError as err:
            raise ValueError(f"max_total_tokens={budget} ({budget // self.ps} pages of {self.ps}): {err}") from None

    def run(self, on_group_done) -> list[list[Completion]]:
        e, P, n, ps = self.e, len(self.prompts), self.params.n, self.ps
        L, Hkv, D = len(e.layers), e.num_kv_heads, e.head_dim
        R = min(e.max_batch_size, P * n)  # rows
        dev = self.device
        max_pages = self.sched.pages_for(self.max_end)
        max_new = max(self.limits)
        # zeroed: masked-out keys still enter the CPU attention's P @ V, where 0 * NaN would be NaN
        cache = _KVCache(kv=torch.zeros(L, 2, Hkv, self.sched.num_pages, ps, D, device=dev, dtype=self.dtype))
        self.products = dict(cpu_packed={}, cpu_packed_by=None, cpu_product_ms={})  # the CPU step's (_workspace)
        if not _use_fused_attention(cache.kv):
            cache.work = self._workspace(R, max_pages * ps)
        self.row_owner: list = [None] * R  # the sequence whose keys each row of the row cache holds
        self.row_from = [0] * R  # the position from which a row's K/V are in the row cache only (not in pages)
        self.st = _RowState(
            tok=torch.zeros(R, dtype=torch.long, device=dev),  # token fed at the next step
            pos=torch.zeros(R, dtype=torch.long, device=dev),  # its position (= tokens already cached)
            n_gen=torch.zeros(R, dtype=torch.long, device=dev),  # tokens generated so far
            done=torch.ones(R, dtype=torch.bool, device=dev),  # finished or padding
            limit=torch.ones(R, dtype=torch.long, device=dev),  # the sample's response limit
            stream=torch.zeros(R, dtype=torch.long, device=dev),  # h(seed, its sample id): its random stream
            t0=torch.zeros(R, dtype=torch.long, device=dev),  # tokens sampled in its earlier turns
            out_tok=torch.zeros(R, max_new + 1, dtype=torch.long, device=dev),  # + a scratch column
            out_lp=torch.zeros(R, max_new + 1, dtype=torch.float32, device=dev),
            u=torch.zeros(R, 0 if self.params.greedy or _use_fused_sampling(cache.kv) else max_new + 1, device=dev,
                          dtype=torch.float64),  # uniforms of the CPU draws (the kernels draw their own on CUDA)
            table=torch.zeros(R, max_pages, dtype=torch.int32, device=dev),  # block tables (0 = scratch page)
        )
        self.graphs = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.logits_RV = torch.empty(R, e.vocab_size, device=dev) if self.use_graphs else None
        self.stats = dict(decode_steps=0, prefill_tokens=0, resume_prefill_tokens=0, re_prefill_tokens=0)
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
                resume_prefill_tokens=self.stats["resume_prefill_tokens"],
                re_prefill_tokens=self.stats["re_prefill_tokens"],
                evictions=sched.evictions,
                peak_paused=sched.peak_paused,
                peak_kv_tokens=sched.peak_pages * ps,
                kv_capacity_tokens=(sched.num_pages - 1) * ps,
                page_size=ps,
                **self.products,
            )
