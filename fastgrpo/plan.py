"""Per-GPU memory plan of a run, from the config and ``model.path``'s ``config.json`` alone (no weights, no GPU).

    python -m fastgrpo.plan --recipe deepscaler-1.5b model.path=/models/DeepSeek-R1-Distill-Qwen-1.5B \\
        --nproc 8 --gpu-memory-gib 80

The model is built on the meta device (the built-in tiny model too) to count its parameters and read its shape.
It prints bytes per GPU for each component below, the peaks of the generation and the training phase, and as its
last line ``fits: ...`` or ``does not fit: ...`` with the cure; exit code 0 when it fits, 1 when it does not. The
trainer runs the same plan at start-up on CUDA (:func:`check_fits`) and stops with that line before loading weights.

Model (P parameters, c bytes per element of the compute dtype ``model.dtype``, W processes), the design of
``fastgrpo.precision`` (fp32 masters, fp32 AdamW, fp32 gradient accumulation; with fp32 compute the parameters are
the masters)::

                        ddp / none                  fsdp2
    weights             c·P                         c·P while gathered: all of it in generation; in training the
                                                    root (embedding, head) and two decoder layers
    masters             4·P (0 when c = 4)          in the sharded parameters (4·P / W)
    optimizer           8·P (AdamW m, v fp32)       8·P / W
    gradients           4·P fp32; + c·P (c < 4)     4·P / W; + 4·P unsharded fp32 while micro-batches accumulate
                        during a backward           (a GRPO step whose rank share fits one micro-batch accumulates
                                                    nothing: each layer's gradient is reduce-scattered in the backward,
                                                    one layer's fp32 gradient unsharded at a time)
    reference model     c·P when GRPO has a β > 0 at any stage, and for DPO (a frozen full copy)
    teacher (distill)   c·P_t                       c·(P_t / W + root_t + 2 layers_t): its shards, its root (gathered
                                                    from its first forward on) and two layers while it runs
    reward models       Σ c·P_m                     Σ c·(P_m / W + root_m + 2 layers_m), as the teacher
    (reward.models)
    judges              Σ c·P_j                     Σ c·P_j (each judge's engine reads whole weights: not sharded)
    (reward.judges)

The distillation teacher (``algorithm: distill``, P_t parameters, the shape of ``distill.teacher_path``'s config.json
or of ``distill.teacher_recipe``'s model) is frozen in the compute dtype: no masters, optimizer state or gradients.
In full mode a micro-batch also keeps the teacher's last hidden state ``c·T·Ht`` through the student's backward (the
divergence kernel recomputes the teacher's logits from it; its workspace is the fused loss's below); the teacher's
forward itself runs before the student's, so its one-layer working set never meets the student's activations. In
sampled-token mode the teacher's forwards run between generation and the update (nothing of it at the peaks but its
weights).

The reward models (``reward.models``, :mod:`fastgrpo.algorithms.reward_models`; P_m parameters, the shape of each
one's config.json) are frozen in the compute dtype like the teacher. They score after generation, before the update:
the KV cache is freed by then and no training activation exists yet, so that phase peaks at the static part, the
policy's weights and one packed no-grad forward of the largest model over T tokens: one layer's working set
``c·T·(3·h + (n_q + 2·n_kv)·d + 3·I)`` and its final hidden state ``c·T·h`` (the head reads B pooled rows only).
A generative judge's own KV cache and decoding working set are not counted: its engine runs in that phase too, after
the policy's cache is freed, and sizes its cache from what is left (``rollout.max_batch_size`` rows).

With ``model.lora`` (:mod:`fastgrpo.models.lora`; p adapter parameters, ``r · (in + out)`` per targeted projection and
layer) the base is frozen in the compute dtype and only the adapters train: weights ``c·(P + p)``; masters,
optimizer and gradients as above with p for P (``4·p``, ``8·p``, ``4·p`` + ``c·p``; ``/ W`` under fsdp2, where the
base's shard ``c·P / W`` stays resident too); no reference model (the base with the adapters disabled). Per token
and layer, each adapted projection saves its ``x·A`` (``c·r``) for backward and the two frozen RMSNorms no longer save
their normalised rows (``− 2·c·h``; the projections' inputs stay saved, by ``lora_A``), and the fused loss skips
the frozen head's ``[V, H]`` gradient accumulator.

A vision-language policy (:mod:`fastgrpo.models.vlm`: a tower of P_v parameters, blocks of width h_v, q = merge²
patches of e pixel values per image token; v = ``data.max_prompt_tokens`` bounds a prompt's image tokens, however
many images): a frozen tower (the default; always with LoRA) is ``c·P_v`` on every GPU (FSDP2 leaves it out:
replicated, no collective) with no masters, optimizer state or gradients (P − P_v train); a trainable one trains
like the rest (in FSDP2's root group). The update keeps every micro-batch's pixel values on the device and a frozen
tower's output, ``S·v·(4·q·e + c·h)`` at most for the rank's S sequences of a rollout, and runs one no-grad tower
pass over a prompt's patches (:func:`vision_pass_bytes`); a trainable tower's blocks save ``q·T·L_v·A_v`` (``A_v``:
``A`` below for its shape; checkpointed ``q·T·(L_v·c·h_v + A_v)``). Generation keeps each prompt's tower output for
the call (``c·v·h`` per prompt) and runs one tower pass.

Activations of one micro-batch of T tokens (``train.max_tokens_per_microbatch``, at least the longest sequence:
one sequence is never split). What the packed forward of a Qwen2 / Llama / Qwen3 decoder layer saves for backward,
per token (h hidden, n_q / n_kv heads of d, I MLP width)::

    A = 2·(4·h + 4 + 2·c·h)             two RMSNorms: the fp32 input (pow, mul), 1/rms, the normalised row in the
                                        compute dtype (weight mul) and the norm's output (the projections' input)
      + (4 + c)·(n_q + n_kv)·d          Qwen3's q_norm / k_norm (fp32 input, 1/rms, normalised; their outputs go
        + 4·(n_q + n_kv)                through rotary, which saves only cos / sin), else 0
      + c·(2·n_q + 2·n_kv)·d + 4·n_q    varlen attention: q, k, v, o (o is o_proj's input) and the fp32 LSE
      + 4·c·I                           MLP: gate (SiLU's input), SiLU(gate), up, their product (down's input)

Per token once: the final norm ``4·h + 4 + c·h``, the loss's copy of the kept hidden rows ``c·h``, cos/sin
``2·c·d`` and ``PER_TOKEN_LOSS_BYTES`` of fp32 per-token vectors; the backward's largest transient adds
``c·(2·I + 2·h)``.
Without checkpointing a micro-batch keeps ``L·A`` per token; with ``train.activation_checkpointing`` (per decoder
layer) it keeps each layer's input ``L·c·h`` and recomputes one layer at a time (``+ A``).
``tests/test_plan.py`` checks ``A`` against the bytes autograd actually saves (storages counted once).
A mixture-of-experts model (``fastgrpo.models.moe.MoEShape``: E experts of width I, top-K, per MoE layer) counts every
expert in P (the weights, masters, state and gradients) but only the chosen ones in its active parameters (the FLOP
line: 6 x active per trained token; a Qwen2-MoE shared expert of width I_s and its gate are always active); an MoE
layer saves its block's router softmax, ids and weights and the experts' ``2·c·K·I`` pre-activations in place of
``4·c·I`` (a shared expert adds ``4·c·I_s + c·h + c``; checked against autograd too), keeps the kernel's routing
(``16·K``), with the load-balancing loss (any algorithm) each MoE layer's ``c·E`` router logits, and its block's
transient is ``c·K·(3·I + h)`` or the shared expert's ``c·(3·I_s + h)``; router replay's record is host memory,
``L_moe·K`` bytes a token. LoRA's MLP targets adapt the dense layers and the shared experts, never the experts.

The fused loss (``kernels/linear_logprobs.py``) in backward: fp32 accumulators ``grad_W`` ``[V, H]`` and
``grad_h`` ``[T, H]``, their casts to the compute dtype (c < 4), the scatter of ``grad_h`` back into ``[T, H]``;
forward partials ``4 × [S, T]`` fp32 (S vocabulary splits). The plain-torch path (CPU) adds its chunk buffers.

Generation (GRPO and distillation; DPO and SFT do not generate) keeps the weights, the reference, the teacher,
masters, optimizer state and the last step's gradients (zeroed at the next step), a prefill working set (one layer's
activations over one prefill chunk: the rank's prompt tokens of a generation batch, at most ``PREFILL_CHUNK_TOKENS``
or the longest sequence) and fp32 logits for the decoding batch; the rest is the KV cache: ``2·L·n_kv·d·c`` bytes
per token (paged or not). It fits when the cache holds the decoding batch, ``min(rollout.max_batch_size, sequences
per rank)``, at full length (:func:`longest_sequence`). A pool set by ``rollout.max_total_tokens`` is the cache: a
synchronous call allocates at most what its samples can fill (every sample of a generation batch at full length, in
64-token pages, and a scratch page), an async session the whole pool; it must fit beside generation's base (else the
cure names the largest pool that does, and the batch cure what that pool holds).
Training peaks at its static part + activations + the loss workspace.
Async GRPO (``grpo.async_grpo``) holds its generation session's page pool through the update: the KV cache is that
pool (``rollout.max_total_tokens``; unset, the engine takes ``CUDA_MEMORY_FRACTION`` of what generation leaves
free at the session's start) and the training peak adds it; the cure of a training peak over the GPU names the pool
that leaves the update its room.
A GPU keeps ``RESERVED_FRACTION`` for the CUDA context, allocator fragmentation and kernels' scratch.

``numerics.batch_invariant`` (``fastgrpo.kernels.batch_invariant``) keeps the policy's fp64 weight grids for the run,
in both phases: ``8·(P − V·h)`` (``8·P`` with a tied head; the norms' and biases' few entries counted too), 11.5 GiB
for DeepSeek-R1-Distill-Qwen-1.5B. Under fsdp2 the gathered weights are new tensors at each gather: their grids live
for a generation call only (counted there, beside the gathered weights), and a training product makes its weight's
grid (one at a time: ``8·h·I`` at the MLP's, 105 MiB at 1.5B), as the reference model's forward does. Its fp64
temporaries, by reading the code (not measured on a GPU): the attention's, twice the bound ``CUDA_CHUNK_BYTES`` of a
call's counted bytes (``rows_per_call``; a call's peak measured on CPU is 0.6x the count in a decode step, 1.5x in a
packed forward's call), plus in generation the pages' K/V gathered for a chunk of rows (``c/8`` of the bound), the
exact products of a prefill chunk's tokens (an input's fp64 grid and the fp64 product, ``8·n·(h + I)`` at the MLP's
widest) and the LM head's fp64 product for the decoding batch (``8·batch·V``); in training the products of a
micro-batch, ``8·T·(h + I)`` (the log-prob kernel's vocabulary tiles are bounded).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import torch

from fastgrpo.config import Config, load_config, stage_settings
from fastgrpo.engine.engine import CUDA_MEMORY_FRACTION, DEFAULT_PAGE_SIZE, PREFILL_CHUNK_TOKENS
from fastgrpo.kernels.batch_invariant_attention import CUDA_CHUNK_BYTES
from fastgrpo.models.vlm import image_token_range
from fastgrpo.shapes import (
    ModelShape,
    activation_bytes,
    judge_shapes,
    layer_saved_bytes_per_token,
    lora_params,
    loss_workspace_bytes,
    model_shape,
    reward_model_shapes,
    teacher_shape,
    vision_pass_bytes,
)

GIB = 1 << 30
RESERVED_FRACTION = 0.08  # of the GPU: CUDA context, caching-allocator fragmentation, cuBLAS / Triton workspaces
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass
class MemoryPlan:
    """Bytes per GPU of each component and phase; ``lines()`` is the printed report."""

    cfg: Config
    shape: ModelShape
    nproc: int
    gpu_bytes: int
    checkpointing: bool
    tokens: int
    weights: int
    base_shard: int
    """LoRA under fsdp2: the frozen base's resident shard (0 otherwise)."""
    adapter_params: int
    masters: int
    optimizer: int
    gradients: int
    reference: int
    teacher: int
    teacher_hidden: int
    reward_models: int
    """reward.models' and reward.judges' weights (frozen, compute dtype)."""
    reward_pass: int
    """The largest reward model's packed no-grad forward over one micro-batch."""
    train_extra: int
    activations: int
    activations_other: int
    loss_workspace: int
    generation_workspace: int
    kv_bytes_per_token: int
    seq_len: int
    batch: int
    vision_tower: int = 0
    """A frozen vision tower's weights (compute dtype, whole on every GPU; no master, state or gradient)."""
    vision_train: int = 0
    """The update's images (module docstring)."""
    vision_generation: int = 0
    """Generation's images (module docstring)."""
    invariant_grids: int = 0
    """numerics.batch_invariant: the policy's fp64 weight grids, kept for the run (module docstring)."""
    invariant_generation: int = 0
    """numerics.batch_invariant: generation's fp64 temporaries (module docstring)."""
    invariant_training: int = 0
    """numerics.batch_invariant: the training forward's fp64 temporaries (module docstring)."""
    call_tokens: int = 0
    """The most KV tokens a synchronous generation call can fill: its samples at full length in CUDA pages."""

    @property
    def usable(self) -> int:
        return int(self.gpu_bytes * (1 - RESERVED_FRACTION))

    @property
    def static(self) -> int:
        return (self.base_shard + self.masters + self.optimizer + self.gradients + self.reference + self.teacher
                + self.reward_models + self.vision_tower + self.invariant_grids)

    @property
    def generation_base(self) -> int:
        return (self.static + self.weights + self.generation_workspace + self.vision_generation
                + self.invariant_generation)

    @property
    def session_pool(self) -> int:
        """Async GRPO: the session's page pool, held through the update (module docstring); 0 otherwise."""
        if not (self.batch and self.cfg.grpo.async_grpo.enabled):
            return 0
        tokens = self.cfg.rollout.max_total_tokens
        return tokens * self.kv_bytes_per_token if tokens else int(CUDA_MEMORY_FRACTION * max(
            0, self.usable - self.generation_base))

    @property
    def user_pool(self) -> int:
        """The KV page pool ``rollout.max_total_tokens`` sets, 0 when unset or nothing generates (module docstring):
        a session (async) allocates it whole; a synchronous call at most what its samples can fill
        (``call_tokens``)."""
        tokens = self.cfg.rollout.max_total_tokens
        if not self.cfg.grpo.async_grpo.enabled:
            tokens = min(tokens, self.call_tokens)
        return tokens * self.kv_bytes_per_token if self.batch else 0

    @property
    def kv_cache(self) -> int:
        return self.session_pool or self.user_pool or max(0, self.usable - self.generation_base)

    @property
    def kv_tokens(self) -> int:
        return self.kv_cache // self.kv_bytes_per_token

    @property
    def kv_sequences(self) -> int:
        return self.kv_tokens // self.seq_len

    @property
    def generation_peak(self) -> int:
        return self.generation_base + (self.kv_pool or self.batch * self.seq_len * self.kv_bytes_per_token)

    @property
    def training_peak(self) -> int:
        return (self.static + self.train_extra + self.activations + self.loss_workspace + self.teacher_hidden
                + self.vision_train + self.session_pool + self.invariant_training)

    @property
    def scoring_peak(self) -> int:
        """The reward models' pass, between generation (its KV cache freed) and the update."""
        return self.static + self.weights + self.reward_pass

    @property
    def fits(self) -> bool:
        return (self.training_peak <= self.usable and self.scoring_peak <= self.usable
                and self.kv_sequences >= self.batch and self.generation_fits)

    @property
    def generation_fits(self) -> bool:
        """Generation's base and the pool it allocates (set or held) fit the GPU (trivially when nothing
        generates)."""
        return not self.batch or self.generation_base + self.kv_pool <= self.usable

    @property
    def kv_pool(self) -> int:
        """The page pool generation allocates beside its base when one is set or held (0: the engine sizes it from
        what is free, never past it)."""
        return self.session_pool or self.user_pool

    def verdict(self) -> str:
        """``fits: ...`` or ``does not fit: ...`` with the cure."""
        gib = self.gpu_bytes / GIB
        if self.fits:
            gen = f", generation peak {self.generation_peak / GIB:.1f} GiB" if self.batch else ""
            return (f"fits: {self.nproc} x {gib:g} GiB, training peak {self.training_peak / GIB:.1f} GiB{gen} of "
                    f"{self.usable / GIB:.1f} GiB usable")
        cures = []
        t = self.cfg.train
        if self.training_peak > self.usable:
            cures.append(self._training_cure())
        if self.scoring_peak > self.usable and self.reward_pass:
            cures.append(f"a smaller train.max_tokens_per_microbatch (the reward models' pass peaks at "
                         f"{self.scoring_peak / GIB:.1f} GiB)" + ("" if self.cfg.train.strategy == "fsdp2" or
                                                                 self.nproc == 1 else " or train.strategy=fsdp2"))
        fsdp2 = "" if t.strategy == "fsdp2" or self.nproc == 1 else " or train.strategy=fsdp2"
        room = self.pool_room
        if self.batch and room < self.seq_len:  # generation's base alone leaves no sequence room
            cures.append(f"a GPU with more memory, or fewer bytes in generation (its base is "
                         f"{self.generation_base / GIB:.1f} GiB of {self.usable / GIB:.1f} usable: weights, "
                         f"optimizer state, workspaces{', batch-invariant grids' if self.invariant_generation else ''})"
                         + fsdp2)
        elif not self.generation_fits:  # the pool set is larger than the room beside generation
            pool = self.kv_pool // self.kv_bytes_per_token
            cures.append(f"rollout.max_total_tokens<={room} (the KV pool of {pool} tokens does not fit beside "
                         f"generation's {self.generation_base / GIB:.1f} GiB)")
        held = min(self.kv_sequences, room // self.seq_len)  # what the cache holds once its pool fits
        if self.batch and room >= self.seq_len and held < self.batch:
            wanted = self.batch * self.seq_len
            cures.append(f"rollout.max_batch_size<={held} (the KV cache holds {held} sequences of {self.seq_len} "
                         f"tokens, the batch is {self.batch})"
                         + (f" or rollout.max_total_tokens>={wanted}" if self.kv_pool and wanted <= room else "")
                         + fsdp2)
        return (f"does not fit: {self.nproc} x {gib:g} GiB (training peak {self.training_peak / GIB:.1f} GiB, usable "
                f"{self.usable / GIB:.1f} GiB); cure: " + "; ".join(cures))

    @property
    def pool_room(self) -> int:
        """The largest KV pool, in tokens, that fits beside generation's base and (async, which holds it through the
        update) beside the update: what a pool cure may name."""
        spare = self.usable - self.generation_base
        if self.session_pool:
            spare = min(spare, self.usable - (self.training_peak - self.session_pool))
        return max(spare, 0) // self.kv_bytes_per_token

    def _invariant_rows(self, row) -> list[str]:
        """numerics.batch_invariant's rows of :meth:`lines` (the grids kept for the run under ddp, made per generation
        call and counted there under fsdp2)."""
        kept = bool(self.invariant_grids)
        return [row("batch-invariant weight grids (fp64)", self.invariant_grids, "kept for the run" if kept else
                    "fsdp2: made per generation call and per training product"),
                row("batch-invariant temporaries", self.invariant_training, "training forward; generation: "
                    f"{self.invariant_generation / GIB:.3f} GiB" + ("" if kept else ", the gathered weights' grids "
                                                                    "included"))]

    def _training_cure(self) -> str:
        room = self.usable - self.static - self.train_extra - self.loss_workspace - self.vision_train
        per_token = self.activations / self.tokens
        options = []
        if not self.checkpointing:
            options.append("train.activation_checkpointing=true")
        fit_tokens = int(room // per_token) if room > 0 else 0
        if fit_tokens >= self.seq_len:
            options.append(f"train.max_tokens_per_microbatch<={fit_tokens}")
        if self.cfg.train.strategy != "fsdp2" and self.nproc > 1:
            options.append("train.strategy=fsdp2")
        if self.session_pool:  # async: the pool the update (and generation) leaves room for
            options.append(f"rollout.max_total_tokens<={self.pool_room} (the async session's pool, held through the "
                           "update)")
        if not options:
            options.append("a GPU with more memory, or a shorter rollout.max_new_tokens")
        return " or ".join(options)

    def lines(self) -> list[str]:
        s, t = self.shape, self.cfg.train

        def row(name, value, note=""):
            return f"  {name:34s} {value / GIB:9.3f} GiB  {note}".rstrip()

        other = "without" if self.checkpointing else "with"
        out = [
            f"memory plan: {self.cfg.name}, model {self.cfg.model.path} ({s.params / 1e6:.1f}M parameters, "
            + (f"{s.active_params / 1e6:.1f}M active per token: {s.moe.layers} MoE layers of {s.moe.experts} experts "
               f"of width {s.moe.intermediate}, top-{s.moe.top_k}, " if s.moe else "")
            + f"{s.layers} layers, hidden {s.hidden}, heads {s.heads}/{s.kv_heads}x{s.head_dim}, vocab {s.vocab}), "
            f"{self.cfg.model.dtype}, {t.strategy} on {self.nproc} GPU(s) of {self.gpu_bytes / GIB:g} GiB "
            f"({self.usable / GIB:.1f} usable)" + (f", LoRA r={self.cfg.model.lora.r} on "
                                                  f"{len(self.cfg.model.lora.target_modules)} projections "
                                                  f"({self.adapter_params / 1e6:.1f}M adapter parameters)"
                                                  if self.adapter_params else ""),
            "per GPU:",
            row("weights (compute dtype)", self.weights, "gathered in generation" if t.strategy == "fsdp2" else ""),
            *([row("frozen base shard (LoRA)", self.base_shard)] if self.base_shard else []),
            *([row("vision tower (frozen, compute dtype)", self.vision_tower, "whole on every GPU")]
              if self.vision_tower else []),
            row("master weights (fp32)", self.masters),
            row("optimizer state (AdamW, fp32)", self.optimizer),
            row("gradients", self.gradients),
            row("reference model (compute dtype)", self.reference),
            *([row("teacher (distill, compute dtype)", self.teacher,
                   "shards + gathered root + 2 layers" if t.strategy == "fsdp2" else "a full frozen copy"),
               row("teacher hidden state (full mode)", self.teacher_hidden, f"one micro-batch of {self.tokens} tokens")]
              if self.cfg.algorithm == "distill" else []),
            *([row("reward models, judges (compute dtype)", self.reward_models,
                   f"{len(self.cfg.reward.models)} + {len(self.cfg.reward.judges)} frozen" + (
                       ", the models: shards + gathered root + 2 layers" if t.strategy == "fsdp2" else "")),
               row("reward models' scoring peak", self.scoring_peak, f"one packed pass of {self.tokens} tokens")]
              if self.reward_models else []),
            row("training: gathered weights, grads", self.train_extra,
                "gathered root + 2 layers, unsharded fp32 grads" if t.strategy == "fsdp2" else "weights, compute-dtype "
                "grads of a backward"),
            row(f"activations ({'with' if self.checkpointing else 'without'} checkpointing)", self.activations,
                f"one micro-batch of {self.tokens} tokens"),
            row(f"activations ({other} checkpointing)", self.activations_other),
            row("loss workspace (fused linear loss)", self.loss_workspace),
            *([row("images (update)", self.vision_train, "pixels, kept tower output, a tower pass")]
              if s.vision else []),
            *(self._invariant_rows(row) if self.cfg.numerics.batch_invariant else []),
        ]
        if self.batch:
            out += [
                row("generation workspace", self.generation_workspace),
                *([row("images (generation)", self.vision_generation, "kept tower output, a tower pass")]
                  if s.vision else []),
                row("KV pool (async, kept in the update)" if self.session_pool else
                    "KV pool (rollout.max_total_tokens)" if self.user_pool else "KV cache the rest allows",
                    self.kv_cache,
                    f"{self.kv_tokens} tokens at {self.kv_bytes_per_token} B/token = {self.kv_sequences} sequences of "
                    f"{self.seq_len} (decoding batch {self.batch})"),
                row("generation peak", self.generation_peak),
            ]
        else:
            out.append(f"  generation: none ({self.cfg.algorithm} does not generate)")
        active = s.active_params
        out.append(f"  compute: {6 * active / 1e9:.3g} GFLOP per trained token (6 x {active / 1e6:.1f}M active "
                   f"parameters), {2 * active / 1e9:.3g} per token of a no-grad forward or generation")
        if self.cfg.model.moe.router_replay and s.moe:
            host = self.batch * self.seq_len * s.moe.replay_bytes_per_token()
            out.append(f"  router replay record (host memory, per rank): {s.moe.replay_bytes_per_token()} B per token,"
                       f" {host / GIB:.3f} GiB for the decoding batch's {self.batch} sequences of {self.seq_len}")
        if s.vision:
            v = self.cfg.model.vision
            lo, hi = image_token_range(v.min_pixels, v.max_pixels, s.vision.patch, s.vision.merge)
            out.insert(1, f"images: {lo} to {hi} tokens each (model.vision.min_pixels {v.min_pixels}, max_pixels "
                          f"{v.max_pixels}, after the {s.vision.merge} x {s.vision.merge} merge); a prompt's at "
                          f"most data.max_prompt_tokens {self.cfg.data.max_prompt_tokens}")
        return [*out, row("training peak", self.training_peak), self.verdict()]


def memory_plan(cfg: Config, nproc: int, gpu_memory_gib: float, *, activation_checkpointing: bool | None = None,
                kernel_loss: bool = True, shape: ModelShape | None = None,
                teacher: ModelShape | None = None, reward_models: list[ModelShape] | None = None,
                judges: list[ModelShape] | None = None) -> MemoryPlan:
    """The plan of ``cfg`` on ``nproc`` GPUs of ``gpu_memory_gib`` GiB each (see the module docstring).

    ``activation_checkpointing``: None reads ``train.activation_checkpointing``. ``kernel_loss``: the Triton loss
    (GPU); False models the plain-torch path (CPU). ``shape`` / ``teacher`` / ``reward_models`` / ``judges``: the
    student's / distillation teacher's / reward models' / judges' shapes (None: read from the config).
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be a positive integer, got {nproc!r}")
    if not gpu_memory_gib > 0:
        raise ValueError(f"--gpu-memory-gib must be > 0, got {gpu_memory_gib!r}")
    s = shape or model_shape(cfg)
    t, r, g = cfg.train, cfg.rollout, cfg.grpo
    ckpt = t.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    c = ELEMENT_BYTES[cfg.model.dtype]
    p = lora_params(s, cfg)  # the adapters (LoRA): what trains; without LoRA every parameter trains
    P = s.params + p  # every weight the forward reads
    vs = s.vision  # a VLM's tower: frozen (compute dtype, whole on every GPU) unless trained without LoRA
    frozen_tower = vs.params if vs is not None and (p or not cfg.model.vision.train_vision_tower) else 0
    trained = p if p else P - frozen_tower
    fsdp = t.strategy == "fsdp2" and nproc > 1
    generates = cfg.algorithm in ("grpo", "distill")
    seq_len = longest_sequence(cfg) if generates else 1
    tokens = max(t.max_tokens_per_microbatch, seq_len)
    base_shard = 0
    if fsdp:
        masters, optimizer, gradients = 4 * trained // nproc, 8 * trained // nproc, 4 * trained // nproc
        base_shard = c * (s.params - frozen_tower) // nproc if p else 0  # a frozen base: sharded, compute dtype
        layer = s.layer_params + p // s.layers
        root = P - s.layers * layer - frozen_tower
        # a rank's share of one optimizer step in one micro-batch: nothing accumulates (module docstring)
        step_seqs = (t.sequences_per_optimizer_step or g.num_prompts_per_step * g.num_generations) // nproc
        single = generates and step_seqs * seq_len <= tokens
        unsharded = 4 * (layer if p == 0 else p // s.layers) if single else 4 * trained
        train_extra = c * (root + 2 * layer) + unsharded  # gathered root + 2 layers; unsharded fp32 grads
    else:
        masters = 0 if c == 4 else 4 * trained
        optimizer, gradients = 8 * trained, 4 * trained
        train_extra = c * (P - frozen_tower) + (c * trained if c < 4 else 0)  # weights; compute-dtype grads
    per_rank_seqs = max(1, g.prompts_per_gen_batch * g.num_generations // nproc)  # one generation batch
    batch = min(r.max_batch_size, per_rank_seqs) if generates else 0
    page = DEFAULT_PAGE_SIZE[True]  # the engine's page on CUDA; a call's pool: its samples' pages and a scratch page
    call_tokens = math.ceil(g.prompts_per_gen_batch / nproc) * g.num_generations * -(-seq_len // page) * page + page
    # the engine prefills in packed chunks of PREFILL_CHUNK_TOKENS (a longer prompt, or a preempted sample's
    # recompute up to seq_len tokens, alone)
    prompt_tokens = min(math.ceil(g.prompts_per_gen_batch / nproc) * cfg.data.max_prompt_tokens,
                        max(PREFILL_CHUNK_TOKENS, seq_len)) if generates else 0
    qk = (s.heads + 2 * s.kv_heads) * s.head_dim
    mlp = max(3 * c * s.intermediate, s.moe.transient_bytes_per_token(c, s.hidden) if s.moe else 0)
    prefill = prompt_tokens * (c * (3 * s.hidden + qk) + mlp)  # one layer's working set
    gen_ws = prefill + 3 * 4 * batch * s.vocab  # fp32 logits, log-softmax and noise of the decoding batch
    needs_ref = cfg.algorithm == "dpo" or (generates and max([g.beta] + [st.beta or 0 for st in cfg.stages]) > 0)
    teacher_bytes = teacher_hidden = 0
    if cfg.algorithm == "distill":
        ts = teacher or teacher_shape(cfg)
        teacher_bytes = ts.frozen_bytes(c, nproc, fsdp)
        teacher_hidden = c * tokens * ts.hidden if cfg.distill.mode == "full" else 0
    rms = (reward_models if reward_models is not None else reward_model_shapes(cfg)) if generates else []
    js = (judges if judges is not None else judge_shapes(cfg)) if generates else []
    needs_ref = needs_ref and not p  # LoRA: the reference is the base, the adapters disabled
    # per token and layer: the adapters' x·A, minus the frozen norms' normalised rows (module docstring)
    lora_act = c * cfg.model.lora.r * len(cfg.model.lora.target_modules) - 2 * c * s.hidden if p else 0
    moe = cfg.model.moe
    aux = s.moe is not None and (s.moe.aux_loss_coef if moe.router_aux_loss_coef is None
                                 else moe.router_aux_loss_coef) > 0  # the load-balancing loss (every algorithm)
    vision_train = vision_gen = 0
    if vs is not None:  # v: a prompt's image tokens at most; a micro-batch's at most its T tokens (module docstring)
        v, q, a = cfg.data.max_prompt_tokens, vs.merge**2, layer_saved_bytes_per_token(vs, c)
        seqs = max(1, g.num_prompts_per_step * g.num_generations // nproc)
        vision_train = seqs * v * (4 * vs.patch_values * q + (c * s.hidden if frozen_tower else 0))
        vision_train += vision_pass_bytes(s, c, v) + (0 if frozen_tower else q * tokens * (
            vs.layers * c * vs.hidden + a if ckpt else vs.layers * a))
        vision_gen = math.ceil(g.prompts_per_gen_batch / nproc) * c * v * s.hidden + vision_pass_bytes(s, c, v)
    grids = inv_gen = inv_train = 0
    if cfg.numerics.batch_invariant:  # module docstring
        grids = 8 * (P - (0 if s.tied else s.vocab * s.hidden))
        products = 8 * (s.hidden + s.intermediate)
        inv_gen = 2 * CUDA_CHUNK_BYTES + c * CUDA_CHUNK_BYTES // 8 + prompt_tokens * products + 8 * batch * s.vocab
        inv_train = 2 * CUDA_CHUNK_BYTES + tokens * products
        if fsdp or needs_ref:  # a product of a weight whose grid is not kept makes it (the widest: the MLP's)
            inv_train += 8 * s.hidden * s.intermediate
        if fsdp:  # the gathered weights' grids live for a generation call
            inv_gen, grids = inv_gen + grids, 0
    return MemoryPlan(
        cfg=cfg, shape=s, nproc=nproc, gpu_bytes=int(gpu_memory_gib * GIB), checkpointing=ckpt, tokens=tokens,
        weights=c * (P - frozen_tower), base_shard=base_shard, adapter_params=p, masters=masters, optimizer=optimizer,
        gradients=gradients, reference=c * P if needs_ref else 0, teacher=teacher_bytes, teacher_hidden=teacher_hidden,
        reward_models=sum(m.frozen_bytes(c, nproc, fsdp) for m in rms) + sum(j.frozen_bytes(c, nproc, False)
                                                                             for j in js),
        reward_pass=max((m.forward_bytes(c, tokens) for m in rms), default=0), train_extra=train_extra,
        activations=activation_bytes(s, c, tokens, ckpt, lora_act, aux),
        activations_other=activation_bytes(s, c, tokens, not ckpt, lora_act, aux),
        loss_workspace=loss_workspace_bytes(s, c, tokens, kernel_loss, frozen_head=bool(p)),
        generation_workspace=gen_ws,
        kv_bytes_per_token=2 * s.layers * s.kv_heads * s.head_dim * c, seq_len=seq_len, batch=batch,
        vision_tower=c * frozen_tower, vision_train=vision_train, vision_generation=vision_gen if generates else 0,
        invariant_grids=grids, invariant_generation=inv_gen if generates else 0, invariant_training=inv_train,
        call_tokens=call_tokens)


def longest_sequence(cfg: Config) -> int:
    """Longest prompt + completion of any stage: ``data.max_prompt_tokens + max_new_tokens``, capped by the
    stage's ``max_sequence_tokens`` when that is set."""
    out = 0
    for step in [0] + [s.at_step for s in cfg.stages]:
        st = stage_settings(cfg, step)
        n = cfg.data.max_prompt_tokens + st["max_new_tokens"]
        out = max(out, min(n, st["max_sequence_tokens"]) if st["max_sequence_tokens"] else n)
    return out


def check_fits(cfg: Config, world_size: int, device: torch.device) -> None:
    """Trainer start-up on CUDA: raise ``SystemExit`` with the plan's verdict when the run does not fit."""
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    plan = memory_plan(cfg, world_size, total / GIB)
    if not plan.fits:
        raise SystemExit("\n".join(plan.lines()) + "\n(python -m fastgrpo.plan prints this plan)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fastgrpo: per-GPU memory plan from the config alone")
    parser.add_argument("--recipe", default=None, help="shipped recipe name (default: tiny)")
    parser.add_argument("--config", default=None, help="YAML config file instead of a recipe")
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (torchrun processes)")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU in GiB")
    parser.add_argument("overrides", nargs="*", help="group.field=value overrides, e.g. train.lr=1e-5")
    args = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config(args.recipe, args.config, args.overrides)
    plan = memory_plan(cfg, args.nproc, args.gpu_memory_gib)
    print("\n".join(plan.lines()))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
