"""Co-located generation: batched sampling with the training model's own parameter tensors.

The engine never copies a weight. It walks ``model.model.layers`` and calls each layer's own submodules (the
q/k/v/o projections with their biases, Qwen3's q_norm/k_norm, the RMSNorms, the MLP) on its own activations, with
a KV cache of its own that lives only for the duration of one :meth:`GenerationEngine.generate` call, so training
gets the memory back as soon as the rollout is done and the next rollout sees the optimizer's latest update.

One call, step by step (the host bookkeeping is ``fastgrpo.engine.scheduler.Scheduler``; the modules listed below
are the device step and the host loop that drives it):

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
   ``fastgrpo.kernels.decode_attention`` (the G query heads of a kv head as G query rows, no K/V repeat). On CPU a row
   cache (``fastgrpo.engine.workspace.Workspace``) holds each running row's keys contiguously: a row that gets another
   sequence is loaded from its pages through the block table, every step writes its token to the row (the pages get a
   row's new K/V when its sequence leaves the row keeping them), and the attention is SDPA over the row with the keys
   past its length masked (re-gathering every page at every layer and step would copy the live K/V once more per step).
   Every ``sync_every`` steps the host reads the flags and counts (the only host synchronisation in the loop): finished
   samples are harvested and free their pages, every running sample gets the pages of its next ``sync_every`` tokens
   (when the pool runs dry, the latest-admitted sample is preempted: pages freed, requeued with its tokens; it is later
   recomputed by prefilling prompt + tokens), queued samples are admitted, rows are compacted, and the batch is the
   smallest power of two that holds the running samples (padding rows write to a scratch page).
4. On CUDA the elementwise pieces of a layer (RMSNorm fused with the residual add, rotary on q and k, SiLU·up) are fused
   by ``torch.compile`` (small pure functions, dynamic shapes, compiled once per engine), and the decode forward
   (embedding → logits) is captured once per batch-size bucket into a CUDA graph (block tables and lengths are static
   inputs, so no graph per length) writing one logits buffer; the graphs and the pool are dropped when ``generate``
   returns. On CPU everything runs eagerly, with the same host logic (``sync_every``, buckets), and the step runs its LM
   head, MLP and q/k/v products on weights packed for MKL or writes them (logits, MLP) into reused buffers instead of
   fresh tensors, whichever its first call measured faster on this host (``fastgrpo.engine.workspace``).

5. **Turns (multi-turn, ``generate(..., turns=)``; host side in ``fastgrpo.engine.turns``).** A sample whose turn ends
   at a boundary (eos/stop token, or a stop string matched on the decoded tail; a match seen late with ``sync_every`` >
   1 is trimmed and the pages of the trimmed tokens freed) pauses: it leaves its row, keeps its pages, and the turn
   handler's ``start`` is called while the others go on decoding. The handler's answer (polled every ``sync_every``
   steps; a blocking wait only when nothing decodes) ends the trajectory or appends tokens: at admission the last
   sampled token and the appended ones are prefilled into the sample's own pages against its cached K/V
   (``ModelForward.prefill_onto``: a few new tokens, nothing before recomputed), and its next turn's first token is
   sampled from that prefill. The device step stays one batched decode of whatever rows run; pausing, evicting and
   resuming are the scheduler's. A sample evicted while paused, or preempted mid-turn, is recomputed from all its tokens
   (prompt, turns, observations). Single-turn (no handler) is the case of one turn: its outputs are bit for bit those of
   the engine before turns existed.

Memory (DeepSeek-R1-Distill-Qwen-1.5B, bf16): 28 KiB of K/V per token (28 layers × 2 × 2 kv heads × 128 × 2 B), so
a 64-token page is 1.75 MiB; 40 GiB of pool hold ~1.5M tokens, e.g. 128 sequences at 12K tokens on average. Host
state is O(pages + samples). Multi-turn: a paused sample holds the pages of its whole conversation while its
environment runs: 224 MiB at 8K tokens, 448 MiB at 16K, 672 MiB at 24K; 128 samples per rank paused at 12K on
average hold 42 GiB, more than the 40 GiB pool, so the pool, not the rows, bounds how many conversations can wait on
environments at once; beyond that the latest-paused are evicted (pages freed, the conversation prefilled again in
full when it resumes: the cost the KV reuse saves, paid only under memory pressure). The conversation budget
(``max_sequence_tokens``, default the model's context) sizes the block tables and, on CPU, the row cache: set it to
the real bound. ``engine.last_stats`` reports each call: peak_running, preemptions, decode_steps, active_row_steps
(Σ over decode steps of the samples running in the batch: ``/ decode_steps`` is its mean occupancy), prefill_tokens
(prompts, recomputes and resumed turns' appended tokens), resume_prefill_tokens (the appended ones: observations +
the one sampled token per resume whose K/V were not cached), re_prefill_tokens (what re-prefilling the whole
conversation at every resumed turn would have cost, TRL's way), evictions (paused samples whose pages were freed),
peak_paused, peak_kv_tokens, kv_capacity_tokens, page_size, and for the CPU step which weight groups ran on
MKL-packed weights and how that was chosen (cpu_packed, cpu_packed_by, cpu_product_ms: ``fastgrpo.engine.workspace``).

Where it lives (``fastgrpo.engine.engine`` is the entry module; it re-exports the public names; the object model,
who owns what and one call as a data flow: ``docs/architecture.md``, "The engine"):

- ``engine.py``: ``GenerationEngine`` (validation, ``generate``, ``session``, the KV budget, the call's
  ``CallSettings``).
- ``session.py``: ``GenerationSession``, prompts added over time and decoded across in-place weight updates (the
  engine side of asynchronous RL: a ``Run`` kept open between optimizer steps).
- ``loop.py``: ``Run``, the host loop of one call, top-down (harvest, reschedule, admit, prepare the batch,
  ``sync_every`` decode steps); the scheduler decides, the runner computes.
- ``scheduler.py``: ``Scheduler``, the host bookkeeping, the one place that knows which sample is where.
- ``runner.py``: ``ModelRunner``, the device side of one call (packed prefill, first tokens, the decode step) and
  the memory it owns (the pool, the CPU workspace, the CUDA graphs).
- ``state.py``: ``RowState`` (the rows' device state) and ``StepOutput`` (what the decode steps hand to the host).
- ``forward.py``: ``ModelForward``, the model pieces (projections, packed prefill, the prefill onto cached K/V,
  the decode forward, MLP, fp32 LM head); ``ops.py``: the elementwise ops ``torch.compile`` fuses.
- ``cache.py``: ``KVCache`` (the page pool) and ``RowCache`` (the CPU row cache's host bookkeeping).
- ``workspace.py``: the CPU step's ``Workspace`` (row cache, reused buffers, MKL packs), the plain and packed
  products and their per-host choice.
- ``cuda_graphs.py``: ``DecodeGraphs``, the CUDA graph capture and replay of the decode step.
- ``sampling.py``: ``SamplingParams``, ``Completion``, ``TurnHandler``/``TurnResult``, the per-sample random
  streams and the token draw.
- ``turns.py``: ``Conversations``: turn ends, stop strings, the turn handler's answers, the results.

Sampling (``fastgrpo.engine.sampling`` states the math): greedy, or temperature / top-k / top-p from one random stream
per sample (its tokens do not depend on the batch, row or ``sync_every``); the logits are fp32, and the returned log-
prob is ``logp[token]`` under the temperature-scaled distribution before top-p/top-k truncation.

Tensor names carry their shape: S rows (running samples), P block-table width, N packed prompt tokens, V vocabulary,
H hidden size, Hq/Hkv query/key-value heads, G = Hq / Hkv, D head dim.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager

import torch

from fastgrpo.engine.forward import LM_HEAD_CHUNK, ModelForward
from fastgrpo.engine.loop import CallSettings, Run
from fastgrpo.engine.runner import PREFILL_CHUNK_TOKENS
from fastgrpo.engine.sampling import Completion, SamplingParams, TurnHandler, TurnResult
from fastgrpo.engine.vision import CallVision, prompt_images
from fastgrpo.models.batch_invariant import check_model, has_sliding_window
from fastgrpo.models.lora import check_modules, unwrap_peft
from fastgrpo.models.vlm import VLM_MODEL_TYPES, ImageInputs, is_vlm, text_config, text_decoder

__all__ = [
    "GenerationEngine", "SamplingParams", "Completion", "TurnHandler", "TurnResult", "PREFILL_CHUNK_TOKENS",
    "LM_HEAD_CHUNK",
    "SUPPORTED_MODEL_TYPES", "DEFAULT_CPU_TOTAL_TOKENS", "CUDA_MEMORY_FRACTION", "CUDA_SYNC_EVERY", "DEFAULT_PAGE_SIZE",
]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", *VLM_MODEL_TYPES)
DEFAULT_CPU_TOTAL_TOKENS = 1 << 18  # KV-cache budget on CPU when max_total_tokens is not given
CUDA_MEMORY_FRACTION = 0.8  # share of the free GPU memory the KV cache may take when max_total_tokens is not given
CUDA_SYNC_EVERY = 8  # decode steps between reads of the stop flags on CUDA (a finished slot idles at most this long)
# tokens per KV page, {on CUDA: True/False}. CUDA: 64 = the decode kernel's keys per inner step (one page per
# step); a sequence wastes < 64 tokens (1.8 MiB for the 1.5B model), nothing next to 24K-token responses. CPU: 16,
# the tiny models' gathers and partial-page copies stay small.
DEFAULT_PAGE_SIZE = {True: 64, False: 16}


class GenerationEngine:
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
        cuda_graphs: capture the decode step in CUDA graphs; None = on when the model is on CUDA and
            ``batch_invariant`` is off (its decode runs eagerly: it reads shapes and kept grids on the host).
        compile: fuse the elementwise pieces (RMSNorm, residual add, rotary, SiLU·up) with ``torch.compile``;
            None = on when the model is on CUDA (the CPU path stays eager).
        page_size: tokens per KV page; None = 64 on CUDA (the decode kernel's keys per inner step; < 64 tokens
            wasted per sequence), 16 on CPU.
        row_cache: where the paged kernel does not run (CPU), decode attention reads a contiguous row cache kept in
            step with the pages (see ``fastgrpo.engine.workspace.Workspace``) instead of gathering every row's pages
            per layer and step; None = when it holds no more tokens than the KV budget (``max_total_tokens``).
            Ignored on CUDA.
        cpu_packed: on CPU (fp32, MKL), run the LM head's, MLP's and q/k/v's products on weights packed for MKL's
            GEMM (True) or as plain products (False); None = ``FASTGRPO_CPU_PACKED`` (0, 1, or auto: each weight
            group's two products timed once per process and shapes, the faster kept; see ``fastgrpo.engine.workspace``).
        tokenizer: decodes a turn's tokens (anything with ``decode(list[int]) -> str``, e.g. a Hugging Face
            tokenizer): needed for ``SamplingParams.stop_strings`` (matched on the decoded tail) and for a turn
            handler (its ``turn_text``). Never used to encode.
        batch_invariant: ``numerics.batch_invariant``: the model's own decoder on the batch-invariant ops, so that
            every sampled token's log-prob equals the trainer's packed forward's bit for bit
            (``fastgrpo.engine.batch_invariant``; CPU or CUDA, its decode eager on CUDA; dense Llama / Qwen2 /
            Qwen3 and Qwen3-MoE / Qwen2-MoE: refused otherwise). Its weights' fp64 grids (4x bf16 weights' bytes)
            are taken off the free GPU memory before the KV budget.
        record_routing: a mixture-of-experts model (Qwen3-MoE, Qwen2-MoE): record the experts each token was routed
            to, every ``Completion.routing`` (router replay; ``fastgrpo.engine.moe``).
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
        record_routing: bool = False,
        batch_invariant: bool = False,
    ):
        model = unwrap_peft(model)  # a PeftModel: its model, LoRA layers in place (read unmerged, fastgrpo.models.lora)
        check_modules(model)
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model: unsupported architecture {model_type!r}, expected one of {SUPPORTED_MODEL_TYPES}")
        inner = text_decoder(model) if is_vlm(model) else getattr(model, "model", None)
        config = text_config(model) if is_vlm(model) else config
        for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(inner, name):
                raise ValueError(f"model: unsupported structure, model.model has no {name!r}")
        if getattr(model, "lm_head", None) is None:
            raise ValueError("model: unsupported structure, no lm_head")
        if has_sliding_window(config):
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
        self._row_cache = row_cache
        self._cpu_packed = cpu_packed
        self._record_routing = record_routing

        if batch_invariant:
            check_model(model)
            if cuda_graphs:
                raise ValueError("cuda_graphs=True with batch_invariant: the mode's decode runs eagerly (its host "
                                 "reads of shapes and its weight grids kept per version cannot be captured)")
            weights = next(model.parameters()).dtype
            if dtype is not None and dtype != weights:
                raise ValueError(f"dtype={dtype} with batch_invariant: the mode computes in the weights' dtype "
                                 f"({weights}), as the trainer's forward does; autocast would round the weights "
                                 "before their grids")
        self.forward = ModelForward(model, compile, batch_invariant)  # the forward pieces, from the model's modules
        if record_routing not in (True, False) or (record_routing and self.forward.moe is None):
            raise ValueError(f"record_routing={record_routing!r}: True records a mixture-of-experts model's routing "
                             f"({model_type!r} has no MoE layers), else False")
        self.layers = self.forward.layers
        self.max_positions = config.max_position_embeddings
        norms = [inner.norm]
        for layer in self.layers:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            norms += [layer.self_attn.q_norm, layer.self_attn.k_norm] if self.forward.qk_norm else []
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
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[list[Completion]]:
        """Sample ``params.n`` completions for each prompt; returns ``[prompt][sample]`` :class:`Completion`.

        ``images`` (a vision-language model, ``fastgrpo.engine.vision``): each prompt's images (None: none), its
        ``<|image_pad|>`` tokens as many as its images make; the vision tower runs once per prompt and the prompt's
        samples share its pages. Single-turn only.

        The model runs in eval mode under ``inference_mode`` (no autograd bookkeeping, cheaper than ``no_grad``;
        measured by bench/bench_generation.py) and gets its previous mode back afterwards; ``on_group_done`` and
        the turn handler are called inside it too (a tensor they create is an inference tensor: no autograd, no
        in-place update outside inference mode). A completion
        ends at the first token in ``eos_token_ids`` ∪ ``params.stop_token_ids`` (that token is included, reason
        "stop"), at the token that completes the first ``params.stop_strings`` match in its decoded text ("stop";
        see ``fastgrpo.engine.turns``), or after :meth:`SamplingParams.response_limit` tokens (reason "length": the
        model's context caps every completion).

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
        self._check_call(params, on_group_done, turns)
        images = prompt_images(prompt_token_ids, images)  # given, or those the data layer's prompts carry
        prompts = self._check_prompts(prompt_token_ids, params)
        self._check_images(images, len(prompts), turns)
        if not prompts:
            return []

        model = self.model
        param = next(model.parameters())
        device = param.device
        dtype = self._dtype or param.dtype
        context = params.context(self.max_positions)
        limits = [params.response_limit(len(p), context) for p in prompts]
        max_context = context if turns is not None else None  # a conversation's budget
        max_len = max_context or max(len(p) + limit for p, limit in zip(prompts, limits))  # T
        settings = self._call_settings(params, device, dtype, max_context)
        forward = self.forward
        with self.calling(device, dtype, param.dtype):
            cos_TD, sin_TD = forward.rope_tables(max_len, device, dtype)
            vision = None if images is None else CallVision(model, prompts, list(images), cos_TD, sin_TD)
            run = Run(forward, settings, prompts, params, limits, turns, self.tokenizer, cos_TD, sin_TD,
                      vision=vision)
            try:
                return run.run(on_group_done)
            finally:
                if run.last_stats is not None:
                    self.last_stats = run.last_stats

    def session(self, params: SamplingParams, *, max_prompt_tokens: int,
                on_group_done: Callable[[int, list[Completion]], None] | None = None,
                turns: TurnHandler | None = None, moving_weights: bool = False, version: int = 0):
        """A :class:`fastgrpo.engine.session.GenerationSession`: prompts added over time, decoded across weight
        updates (asynchronous RL: generation that never drains); ``max_prompt_tokens`` bounds the prompts it will
        take; ``moving_weights``: FSDP2 (see the session's module docstring); ``version``: the weights' version at
        its start (a session that follows another on the same weights continues its count)."""
        from fastgrpo.engine.session import GenerationSession

        return GenerationSession(self, params, max_prompt_tokens=max_prompt_tokens, on_group_done=on_group_done,
                                 turns=turns, moving_weights=moving_weights, version=version)

    @contextmanager
    def calling(self, device: torch.device, dtype: torch.dtype, param_dtype: torch.dtype):
        """What the engine's device work runs under: the model in eval mode (its mode restored after), its LoRA
        adapters read, ``inference_mode`` and, for another dtype than the weights', autocast."""
        model, forward = self.model, self.forward
        was_training = model.training
        model.eval()
        forward.read_adapters()  # LoRA: base + adapters, unmerged (fastgrpo.models.lora)
        invariant = forward.invariant.calling() if forward.invariant is not None else contextlib.nullcontext()
        try:
            with torch.inference_mode(), forward.autocast(device, dtype, param_dtype), invariant:
                yield
        finally:
            model.train(was_training)
            forward.clear_adapters()  # the adapters are read afresh by the next call

    def _call_settings(self, params: SamplingParams, device: torch.device, dtype: torch.dtype,
                       max_context: int | None) -> CallSettings:
        seed = int(torch.randint(0, 2**62, (1,), device="cpu").item()) if params.seed is None else params.seed
        cuda = device.type == "cuda"
        return CallSettings(
            device=device, dtype=dtype, seed=seed, budget=self._budget_tokens(device, dtype),
            sync_every=self._sync_every or (CUDA_SYNC_EVERY if cuda else 1),
            cuda_graphs=cuda and self._cuda_graphs is not False and self.forward.invariant is None,
            page_size=self.page_size or DEFAULT_PAGE_SIZE[cuda], max_batch_size=self.max_batch_size,
            row_cache=self._row_cache, cpu_packed=False if self.forward.invariant else self._cpu_packed,
            record_routing=self._record_routing,
            stop_ids=frozenset(self.eos_token_ids) | frozenset(params.stop_token_ids), max_context=max_context,
            batch_invariant=self.forward.invariant is not None,
        )  # fmt: skip

    # ------------------------------------------------------------------ validation and planning

    def _check_call(self, params: SamplingParams, on_group_done, turns) -> None:
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
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"params.stop_token_ids {bad_stop} are outside the vocabulary [0, {self.vocab_size})")

    def _check_images(self, images, n_prompts: int, turns) -> None:
        if images is None:
            return
        if not is_vlm(self.model):
            raise ValueError(f"images need a vision-language model ({', '.join(VLM_MODEL_TYPES)}), got "
                             f"{self.model.config.model_type!r}")
        if turns is not None:
            raise ValueError("images are single-turn: a turn handler with images is not supported")
        if len(images) != n_prompts:
            raise ValueError(f"images has {len(images)} entries for {n_prompts} prompts")
        bad = next((i for i, im in enumerate(images) if im is not None and not isinstance(im, ImageInputs)), None)
        if bad is not None:
            raise ValueError(f"images[{bad}] must be an ImageInputs or None, got {type(images[bad]).__name__}")

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
            if params.response_limit(len(p), params.context(self.max_positions)) < 1:
                raise ValueError(
                    f"prompt_token_ids[{i}] has {len(p)} tokens: no room for a response within "
                    f"params.max_sequence_tokens={params.max_sequence_tokens} and the model's context of "
                    f"{self.max_positions} positions"
                )
            prompts.append(list(p))
        return prompts

    def _budget_tokens(self, device: torch.device, dtype: torch.dtype) -> int:
        if self.max_total_tokens is not None:
            return self.max_total_tokens
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # cached, reusable
            if self.forward.invariant is not None:  # the weights' fp64 grids not held yet, made after the pool
                free -= self.forward.invariant.grid_bytes_to_make()
            return max(int(free * CUDA_MEMORY_FRACTION), 0) // self.forward.kv_bytes_per_token(dtype)
        return DEFAULT_CPU_TOTAL_TOKENS
