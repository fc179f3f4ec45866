"""The engine's mixture-of-experts step (Qwen3-MoE, Qwen2-MoE): the MoE block of a layer in prefill and decode
(:class:`EngineMoE`, called by ``ModelForward.mlp`` for the layers whose MLP is a sparse MoE block), and the record
of each token's experts for router replay (:class:`RoutingLog`).

**The block.** ``moe_router`` then ``moe_experts`` (``fastgrpo.kernels.moe``) on the block's own tensors (``gate``,
``experts.gate_up_proj``, ``experts.down_proj``): the ops of transformers' ``Qwen3MoeSparseMoeBlock`` (router logits
in the activations' dtype, fp32 softmax, top-K, renormalised with ``norm_topk_prob``). A Qwen2-MoE block then adds its
shared expert, ``σ(h w_sᵀ) · down(silu(gate(h)) · up(h))`` on every row (``fastgrpo.models.moe``), its four
projections through the engine's linear (the module's weight and bias, plus its live LoRA adapters) and its SiLU·up
through the step's elementwise ops (fused on CUDA), as ``Qwen2MoeSparseMoeBlock`` computes it: a dense MLP of width
``I_s`` per MoE layer, no host read. On CUDA the experts are
Triton grouped GEMMs with no host synchronisation (the pairs sorted, the tile map built and the GEMMs launched over a
grid fixed by the shapes), so the decode step, MoE layers included, is captured in the CUDA graphs. A decode step
has few tokens per expert: 128 rows × top-8 over 128 experts is 8 pairs per expert on average, so the launchers
take 16-row tiles there (``fastgrpo.kernels.moe_kernels.FEW_ROWS_CONFIGS``, chosen from S and E, which the graphs
fix per batch bucket): one tile per active expert, whose weights are then streamed once per N tile, which is what a
decode step's MoE layer costs (it is bound by reading the active experts' weights, ``3·H·I`` elements each, not by
its few rows' arithmetic). On CPU the experts run as per-expert products (``moe_experts``' torch path, which reads the
per-expert counts on the host; under ``TRITON_INTERPRET=1`` too, as the engine's CPU attention). Under autocast the
block's weights are cast to the activations' dtype per call, as autocast casts a linear's.

**The record (router replay).** With ``GenerationEngine(record_routing=True)`` every forward writes the expert ids
it chose, ``[tokens, L_moe, K]``, into the buffer :attr:`EngineMoE.out` that the runner sets: per prefill chunk
(prompts, once per group: its samples share the prompt's prefill and so its routing; a resumed turn's appended
tokens; an evicted conversation's re-prefill), and per decode step the one static ``[R, L_moe, K]`` buffer the CUDA
graphs write (kept for the round's ``sync_every`` steps and read at the round's one host read). :class:`RoutingLog`
keeps them on the host by position: a prompt's ids once, and per sample the ids of its completion's positions, the
first computation of each position winning (a preempted sample's recompute re-routes tokens whose log-probs were
already sampled with the first routing; it differs only where the router's top-K is a near tie). The last token of a
completion is never fed, so it has no record: its row holds E ("route afresh"; nothing depends on it). A completion's
``routing`` is ``[prompt + completion tokens, L_moe, K]``, uint8 when E ≤ 255, else int16.

Memory: ``L_moe · K`` ids per token, 384 B at Qwen3-30B-A3B (48 MoE layers × top-8, uint8): 1.2 GB of host memory for
a rank's 128 samples of 24K tokens, against 96 KiB of K/V per token on the GPU; on the device only the decode
round's ``[R, sync_every, L_moe, K]`` ring (384 KiB for 128 rows × 8 steps) and each prefill chunk's ids.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from fastgrpo.kernels.moe import moe_experts, moe_router
from fastgrpo.models.moe import moe_blocks


def routing_dtype(num_experts: int) -> torch.dtype:
    """The dtype of recorded ids: uint8 when E and the sentinel E fit (E ≤ 255), else int16."""
    return torch.uint8 if num_experts <= 255 else torch.int16


class EngineMoE:
    """The MoE blocks of a model for the engine's forward (module docstring): ``block(mlp, h)`` for a block this
    owns (:meth:`owns`), and ``out``, the ``[M, L_moe, K]`` buffer the step's ids go to (None: not recorded)."""

    def __init__(self, model: torch.nn.Module):
        blocks = [block for _, block in moe_blocks(model)]
        if not blocks:
            raise ValueError(f"model: a {model.config.model_type} config whose layers are all dense (its "
                             "decoder_sparse_step / mlp_only_layers leave no sparse MoE block); set them to keep one")
        self.index = {block: i for i, block in enumerate(blocks)}
        router = blocks[0].gate
        self.num_layers, self.top_k, self.num_experts = len(blocks), router.top_k, router.num_experts
        self.norm_topk_prob = router.norm_topk_prob
        self.out: torch.Tensor | None = None
        act = model.config.hidden_act
        if act != "silu":
            raise ValueError(f"model: hidden_act {act!r}: the engine's MoE blocks compute SwiGLU (silu) only")

    def owns(self, mlp: torch.nn.Module) -> bool:
        return mlp in self.index

    def block(self, mlp: torch.nn.Module, h_MH: torch.Tensor, ops, proj) -> torch.Tensor:
        """The sparse MoE block on rows ``h [M, H]``; its ids go to ``out[:, its MoE layer]`` when recording.
        ``ops``: the step's elementwise ops; ``proj(x, module)``: the engine's linear (a shared expert's)."""
        dt = h_MH.dtype
        experts = mlp.experts
        _, w_MK, ids_MK = moe_router(h_MH, mlp.gate.weight.to(dt), self.top_k, norm_topk_prob=self.norm_topk_prob)
        self.record(mlp, ids_MK)
        out_MH = moe_experts(h_MH, experts.gate_up_proj.to(dt), experts.down_proj.to(dt), ids_MK, w_MK,
                             check_ids=False, kernel=h_MH.is_cuda)
        shared = getattr(mlp, "shared_expert", None)
        if shared is None:
            return out_MH
        act_MI = ops.silu_mul(proj(h_MH, shared.gate_proj), proj(h_MH, shared.up_proj))  # [M, I_s]
        return out_MH + torch.sigmoid(proj(h_MH, mlp.shared_expert_gate)) * proj(act_MI, shared.down_proj)

    def record(self, mlp: torch.nn.Module, ids_MK: torch.Tensor) -> None:
        """The block's expert ids ``[M, K]`` to ``out[:, its MoE layer]`` when the step records (else nothing)."""
        if self.out is not None:
            self.out[:, self.index[mlp]] = ids_MK

    def buffer(self, M: int, device: torch.device) -> torch.Tensor:
        """A fresh ``[M, L_moe, K]`` record buffer."""
        return torch.empty(M, self.num_layers, self.top_k, dtype=routing_dtype(self.num_experts), device=device)


class RoutingLog:
    """Every sample's recorded experts on the host (module docstring): ``prompts[p]`` ``[P, L_moe, K]`` and, per
    sample id, a growing ``[capacity, L_moe, K]`` tensor of its completion's positions with the count recorded (the
    positions before it are kept; later writes there are ignored)."""

    def __init__(self, moe: EngineMoE):
        self.shape = (moe.num_layers, moe.top_k)
        self.sentinel = moe.num_experts
        self.dtype = routing_dtype(moe.num_experts)
        self.prompts: dict[int, torch.Tensor] = {}
        self.samples: dict[int, tuple[torch.Tensor, int]] = {}

    def prompt(self, p: int, ids_PLK: torch.Tensor) -> None:
        """Prompt ``p``'s prefill (the first one: a prompt prefilled again keeps its first record)."""
        self.prompts.setdefault(p, ids_PLK.cpu())

    def write(self, sample: int, start: int, ids_nLK: torch.Tensor) -> None:
        """The ids of completion positions ``start, start + 1, ...`` of ``sample`` (``start`` < 0: the first
        ``-start`` rows are the prompt's, skipped); positions already recorded keep their ids."""
        buf, n = self.samples.get(sample, (None, 0))
        first = max(n, start, 0)
        end = start + ids_nLK.shape[0]
        if end <= first:
            return
        if buf is None or buf.shape[0] < end:
            grown = torch.full((max(end, 2 * (0 if buf is None else buf.shape[0]), 64), *self.shape), self.sentinel,
                               dtype=self.dtype, device="cpu")  # the host's record
            if buf is not None:
                grown[:n] = buf[:n]
            buf = grown
        buf[first:end] = ids_nLK[first - start :].cpu()
        self.samples[sample] = (buf, end)

    def trim(self, sample: int, length: int) -> None:
        """Forget ``sample``'s record from completion position ``length`` on (a turn cut at a stop string seen late:
        the positions past the cut are recorded again when another turn's tokens go there)."""
        if sample in self.samples:
            buf, n = self.samples[sample]
            self.samples[sample] = (buf, min(n, length))

    def read_decode(self, ids_SsLK: torch.Tensor, pos_Ss: torch.Tensor, live_Ss: torch.Tensor, rows: list) -> None:
        """A decode round's record of the running ``rows`` (``Scheduler.rows`` order): step ``i`` of row ``r`` fed
        the token at ``pos[r, i]`` where ``live[r, i]`` (its sample had not finished before the step; a prefix of
        the round's steps)."""
        counts = live_Ss.sum(1).tolist()
        starts = pos_Ss[:, 0].tolist()
        for r, seq in enumerate(rows):
            if counts[r]:
                self.write(seq.sample, starts[r] - seq.prompt_len, ids_SsLK[r, : counts[r]])

    def completion(self, p: int, sample: int, length: int) -> torch.Tensor:
        """``[P + length, L_moe, K]``: prompt ``p``'s ids, then sample's for its ``length`` completion tokens (E where
        none was recorded); forgets the sample's record."""
        buf, n = self.samples.pop(sample, (None, 0))
        out = torch.full((self.prompts[p].shape[0] + length, *self.shape), self.sentinel, dtype=self.dtype,
                         device="cpu")
        P = self.prompts[p].shape[0]
        out[:P] = self.prompts[p]
        keep = min(n, length)
        if keep:
            out[P : P + keep] = buf[:keep]
        return out

    def forget_prompt(self, p: int) -> None:
        """Prompt ``p``'s group has finished: its record is no longer needed."""
        self.prompts.pop(p, None)

    def state(self, keys, n: int) -> dict:
        """The record of prompts ``keys`` (a session's unfinished groups, ``n`` samples each) as plain tensors, for a
        checkpoint: each prompt's ids and each of its samples' recorded positions."""
        keys = set(keys)
        return {"prompts": {p: ids for p, ids in self.prompts.items() if p in keys},
                "samples": {s: buf[:m].clone() for s, (buf, m) in self.samples.items() if s // n in keys}}

    def restore(self, state: dict) -> None:
        """Take back :meth:`state` (a restored session: its samples are recomputed, which records nothing new)."""
        self.prompts.update(state["prompts"])
        self.samples.update({s: (ids, ids.shape[0]) for s, ids in state["samples"].items()})


class RoutingRecorder:
    """The record of one call (module docstring): the device buffers the forwards write, and the host
    :class:`RoutingLog`. ``R`` rows, ``steps`` decode steps per round (``sync_every``)."""

    def __init__(self, moe: EngineMoE, R: int, steps: int, device: torch.device):
        self.moe = moe
        self.log = RoutingLog(moe)
        self.step_RLK = moe.buffer(R, device)  # the decode step's ids (the CUDA graphs write it)
        self.ring = torch.zeros(R, steps, moe.num_layers, moe.top_k, dtype=self.step_RLK.dtype, device=device)
        self.ring_pos = torch.zeros(R, steps, dtype=torch.long, device=device)
        self.ring_live = torch.zeros(R, steps, dtype=torch.bool, device=device)

    @contextmanager
    def recording(self, out_MLK: torch.Tensor):
        """The forwards inside write their ids into ``out_MLK``."""
        self.moe.out = out_MLK
        try:
            yield out_MLK
        finally:
            self.moe.out = None

    def prefilled(self, spans: list[tuple], ids_NLK: torch.Tensor) -> None:
        """A prefill chunk's ids (one transfer to the host): ``spans`` ``(key, row in the chunk, tokens, first
        position)``, key a prompt index, a resumed sample (``Seq``) or None (a recompute: nothing new to record)."""
        ids_NLK = ids_NLK.cpu()
        for key, at, m, pos0 in spans:
            if isinstance(key, int):
                self.log.prompt(key, ids_NLK[at : at + m])
            elif key is not None:
                self.log.write(key.sample, pos0 - key.prompt_len, ids_NLK[at : at + m])

    def keep_step(self, i: int, S_b: int, pos_S: torch.Tensor, live_S: torch.Tensor) -> None:
        """Decode step ``i`` of the round ran rows ``[0, S_b)`` feeding tokens at ``pos_S``; ``live_S``: the rows
        whose sample had not finished before it (no host synchronisation)."""
        self.ring[:S_b, i] = self.step_RLK[:S_b]
        self.ring_pos[:S_b, i] = pos_S
        self.ring_live[:S_b, i] = live_S

    def harvest(self, rows: list) -> None:
        """At the round's host read: the round's ids of the running ``rows`` (``Scheduler.rows`` order) to the log;
        the ring is emptied (a round without decode steps records nothing)."""
        n = len(rows)
        ids, pos = self.ring[:n].cpu(), self.ring_pos[:n].cpu()
        live = self.ring_live[:n].to("cpu", copy=True)  # a copy: the ring is emptied next (on CPU, the same storage)
        self.ring_live.zero_()
        self.log.read_decode(ids, pos, live, rows)

    def attach(self, on_group_done, n: int):
        """``on_group_done`` (or None) preceded by setting each finished completion's ``routing``."""

        def done(p: int, group: list) -> None:
            for j, c in enumerate(group):
                c.routing = self.log.completion(p, p * n + j, len(c.token_ids))
            self.log.forget_prompt(p)
            if on_group_done is not None:
                on_group_done(p, group)

        return done
