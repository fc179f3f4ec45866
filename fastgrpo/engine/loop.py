"""The host loop of one ``generate`` call (``Run``), top-down: each round reads what the last decode steps did
(:meth:`Run.harvest`), lets the scheduler grow, preempt and compact (:meth:`Run.reschedule`), takes the turn
handler's answers, admits and prefills (:meth:`Run.admit`), lays out the batch (:meth:`Run.prepare_batch`), then runs
``sync_every`` decode steps without reading anything back (:meth:`Run.decode_steps`).

Its collaborators: the ``Scheduler`` decides (who runs, pages, preemption, pauses;
``fastgrpo.engine.scheduler``), the ``ModelRunner`` computes and holds the device memory (``fastgrpo.engine.runner``),
``Conversations`` keeps the host side of every trajectory (``fastgrpo.engine.turns``), and the rows' device state
(``RowState``) and the host's read of it (``StepOutput``) cross between them (``fastgrpo.engine.state``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastgrpo.engine.forward import ModelForward
from fastgrpo.engine.moe import RoutingRecorder
from fastgrpo.engine.runner import ModelRunner
from fastgrpo.engine.sampling import (
    Completion,
    SamplingParams,
    TurnHandler,
    row_seeds,
    sample_streams,
    sample_tokens,
    stream_uniforms,
    use_fused_sampling,
)
from fastgrpo.engine.scheduler import Admission, Scheduler
from fastgrpo.engine.state import RowState, new_row_state, read_step_output, read_tokens
from fastgrpo.engine.turns import Conversations


@dataclass(frozen=True)
class CallSettings:
    """The engine's settings resolved for one call (all the run reads of the engine besides its forward pieces)."""

    device: torch.device
    dtype: torch.dtype  # activations and K/V
    seed: int  # the call's seed: sample s draws from the stream h(seed, s)
    budget: int  # KV tokens
    sync_every: int  # decode steps between host reads
    cuda_graphs: bool  # replay the decode step from CUDA graphs
    page_size: int
    max_batch_size: int
    row_cache: bool | None  # the CPU row cache: on, off, or None (when it fits the budget)
    cpu_packed: bool | None  # the CPU products: packed, plain, or None (FASTGRPO_CPU_PACKED / timed)
    stop_ids: frozenset  # eos_token_ids and params.stop_token_ids
    max_context: int | None  # multi-turn: a conversation's token budget; None: single-turn
    record_routing: bool = False  # an MoE model: record each token's experts (Completion.routing)
    batch_invariant: bool = False  # log-probs by the LM head's fixed vocabulary tiles (numerics.batch_invariant)


def bucket(n: int, cap: int) -> int:
    """Smallest power of two >= n, at most cap."""
    return min(cap, 1 << max(n - 1, 0).bit_length())


class Run:
    """One ``generate`` call: ``prompts`` (checked), ``params`` and each prompt's response limit ``limits``, run
    as one wave by a :class:`Scheduler` with a :class:`ModelRunner` (see the module docstring).

    ``max_end`` given: a generation session's run (``fastgrpo.engine.session``), sized for sequences of up to
    ``max_end`` tokens and ``max_batch_size`` rows, with no prompt at first (:meth:`add` queues them); its rounds
    (:meth:`steps`) wait for more prompts instead of ending when every sample has finished."""

    def __init__(self, forward: ModelForward, settings: CallSettings, prompts: list[list[int]],
                 params: SamplingParams, limits: list[int], handler: TurnHandler | None, tokenizer,
                 cos_TD: torch.Tensor, sin_TD: torch.Tensor, max_end: int | None = None, vision=None):
        self.forward = forward
        self.vision = vision  # the prompts' images (fastgrpo.engine.vision.CallVision) or None
        self.settings = settings
        self.prompts = prompts
        self.params = params
        self.handler = handler
        self.tokenizer = tokenizer
        self.cos_TD, self.sin_TD = cos_TD, sin_TD
        self.stop_ids = torch.tensor(sorted(settings.stop_ids), dtype=torch.long, device=settings.device)
        self.limits = limits
        self.last_stats: dict | None = None  # set when run returns or raises
        lengths = [len(p) for p in prompts]
        ps, n, max_context, budget = settings.page_size, params.n, settings.max_context, settings.budget
        # the pool never needs more than every sample's full length at once (+ prompt pages, the scratch page)
        ends = [max_context or a + b for a, b in zip(lengths, limits)]  # a sequence's last position + 1
        worst = sum(n * -(-end // ps) - (-a // ps) for a, end in zip(lengths, ends)) + 1
        self.session = max_end is not None
        if self.session:  # prompts come later: the whole budget, the widest block tables
            worst, self.max_end = budget // ps, max_end
        else:
            self.max_end = max(ends)
        try:
            self.scheduler = Scheduler(
                lengths, n, limits, ps, min(budget // ps, worst), settings.max_batch_size, max_context,
            )
        except ValueError as err:
            raise ValueError(f"max_total_tokens={budget} ({budget // ps} pages of {ps}): {err}") from None

    # ------------------------------------------------------------------ the call

    def run(self, on_group_done: Callable | None) -> list[list[Completion]]:
        """Set up (:meth:`open`), run the rounds, and record ``self.last_stats`` (:meth:`close`) however they end."""
        self.open(on_group_done)
        try:
            return self.rounds()
        finally:
            self.close()

    def open(self, on_group_done: Callable | None) -> None:
        """Set up the device state, the runner and the conversations."""
        settings, sched, dev = self.settings, self.scheduler, self.settings.device
        rows = settings.max_batch_size if self.session else len(self.prompts) * self.params.n
        self.R = R = min(settings.max_batch_size, rows)
        max_pages = sched.pages_for(self.max_end)
        max_new = min(self.params.max_new_tokens, self.max_end) if self.session else max(self.limits)
        fused = use_fused_sampling(torch.empty(0, device=dev))
        # CPU draws read a table of uniforms (the kernels draw their own on CUDA)
        self.state: RowState = new_row_state(R, max_new, max_pages, not (self.params.greedy or fused), dev)
        self.recorder = RoutingRecorder(self.forward.moe, R, settings.sync_every, dev) if settings.record_routing \
            else None
        self.runner = ModelRunner(
            self.forward, self.state, R=R, num_pages=sched.num_pages, page_size=settings.page_size,
            max_pages=max_pages, cos_TD=self.cos_TD, sin_TD=self.sin_TD, dtype=settings.dtype,
            budget=settings.budget, row_cache=settings.row_cache, cpu_packed=settings.cpu_packed,
            cuda_graphs=settings.cuda_graphs, vision=self.vision, recorder=self.recorder,
        )  # fmt: skip
        if self.recorder is not None:  # each finished completion gets its routing
            on_group_done = self.recorder.attach(on_group_done, self.params.n)
        self.conversations = Conversations(self.prompts, self.params, sched, self.handler, self.tokenizer,
                                           self.forward.vocab_size, settings.max_context, on_group_done)
        self.counts = dict(decode_steps=0, prefill_tokens=0, resume_prefill_tokens=0, active_row_steps=0)
        self.last_hidden: dict[int, torch.Tensor] = {}  # [H] of each prompt whose pages are held
        self.table_rows, self.table_layout = 0, []  # the block tables in state.table: rows written, their layout

    def close(self) -> None:
        """Free the runner's memory and record ``self.last_stats``."""
        self.runner.close()
        self.last_stats = self.stats()

    def add(self, prompts: list[list[int]], limits: list[int]) -> None:
        """A session's new prompts (checked) and their response limits, queued behind the waiting samples."""
        for i, (p, limit) in enumerate(zip(prompts, limits)):
            end = self.settings.max_context or len(p) + limit
            if end > self.max_end:
                raise ValueError(f"prompt {i} ({len(p)} tokens) and its {limit}-token response do not fit the "
                                 f"session's {self.max_end} tokens per sequence (max_prompt_tokens)")
        self.prompts += prompts
        self.limits += limits
        self.scheduler.add_prompts([len(p) for p in prompts], limits)
        self.conversations.add(len(prompts))

    def new_version(self, version: int) -> None:
        """The weights changed: every unfinished sample's next token is sampled with ``version`` (call at a pause of
        :meth:`steps`)."""
        sched = self.scheduler
        mid_turn = {s.sample: s.generated for s in [*sched.rows, *sched.waiting] if s is not None and s.generated}
        self.conversations.new_version(version, mid_turn)

    def drop_caches(self) -> None:
        """Forget every cached K/V (call at a pause of :meth:`steps`): running samples are preempted (recomputed
        from their tokens at admission), paused ones evicted, prompt pages released
        (:meth:`Scheduler.drop_caches`)."""
        left = self.scheduler.drop_caches(before_leave=lambda seqs: read_tokens(self.state, seqs))
        if left:
            self.state.done[[row for _, row in left]] = True
            for _, row in left:  # its row cache is stale when it comes back (recomputed)
                self.runner.rows.forget(row)
        self.scheduler.compact()  # every row left: nothing moves
        self.table_layout = []  # the block tables are rebuilt before the next decode step

    def stats(self) -> dict:
        """The call's ``engine.last_stats`` (the keys and their meaning: ``fastgrpo.engine.engine``)."""
        sched, ps = self.scheduler, self.settings.page_size
        return dict(
            peak_running=sched.peak_running,
            preemptions=sched.preemptions,
            decode_steps=self.counts["decode_steps"],
            active_row_steps=self.counts["active_row_steps"],
            prefill_tokens=self.counts["prefill_tokens"],
            resume_prefill_tokens=self.counts["resume_prefill_tokens"],
            re_prefill_tokens=self.conversations.re_prefill_tokens,
            evictions=sched.evictions,
            peak_paused=sched.peak_paused,
            peak_kv_tokens=sched.peak_pages * ps,
            kv_capacity_tokens=(sched.num_pages - 1) * ps,
            page_size=ps,
            **self.runner.products,
            **(self.vision.stats() if self.vision is not None else {}),
        )

    def rounds(self) -> list[list[Completion]]:
        """Rounds until every sample has finished; returns ``results[prompt][sample]``."""
        for _ in self.steps():
            pass
        return self.conversations.results

    def steps(self):
        """The rounds as a generator. It pauses (yields True) after each harvest, where the finished groups have
        been handed to ``on_group_done`` and nothing is left on the device that the host has not read: a session
        may change the weights there (:meth:`new_version`, :meth:`drop_caches`) or stop, and the next round goes on
        as it would have. When every sample has finished it returns, or, in a session, yields False (idle until
        :meth:`add`)."""
        sched, conv, steps = self.scheduler, self.conversations, self.settings.sync_every
        while True:
            moved = False
            if sched.rows:
                self.harvest()
                yield True
                moved = self.reschedule()
            if conv.awaiting:
                conv.poll()
            admission = sched.admit(steps)
            self.admit(admission)
            started = admission.fresh or admission.resume
            if moved or admission.prefill or admission.recompute or started:
                self.table_layout = []  # rows may hold other sequences, or a sequence other pages: rebuild the tables
            for p in list(self.last_hidden):
                if p not in sched.prompt_pages:
                    del self.last_hidden[p]
            if started:
                continue  # a sample can finish at its first token (stop token or a limit of 1): harvest it first
            if sched.done:
                if not self.session:
                    return
                yield False
                continue
            if not sched.rows:
                if not conv.awaiting:
                    raise RuntimeError("nothing runs, waits or is paused, yet the call is not done")
                continue  # every sample left is paused on its handler: the next round waits for an answer
            S_b, n_pages = self.prepare_batch()
            self.decode_steps(S_b, n_pages)

    # ------------------------------------------------------------------ the steps of a round

    def harvest(self) -> None:
        """The round's one device-to-host read (:class:`StepOutput`); the samples whose turn ended (a stop token,
        their limit, or a stop string, seen late with ``sync_every`` > 1 and trimmed) leave their rows: finished,
        or paused for the turn handler."""
        sched, conv, state = self.scheduler, self.conversations, self.state
        steps = self.settings.sync_every
        window = torch.arange(steps, device=self.settings.device) - steps if conv.watch_stops else None
        out = read_step_output(state, len(sched.rows), window)
        for row, seq in enumerate(sched.rows):
            seq.generated = out.generated[row]
        if self.recorder is not None:
            self.recorder.harvest(sched.rows)
        cut = conv.stop_matches(out.newest) if conv.watch_stops else {}
        finished = [seq for row, seq in enumerate(sched.rows) if out.done[row] or seq in cut]
        if not finished:
            return
        read_tokens(state, finished)
        if self.handler is not None:  # one that pauses keeps its pages: they get what only its row holds
            self.runner.flush_rows([(seq.row, seq) for seq in finished])
        for seq in finished:
            keep = cut.get(seq)
            if keep is not None:  # seen late (sync_every > 1): the tokens past the match are trimmed
                seq.tokens, seq.logprobs, seq.generated = seq.tokens[:keep], seq.logprobs[:keep], keep
                if self.recorder is not None:  # and its last kept token's: a completion's last has no record
                    self.recorder.log.trim(seq.sample, seq.context - seq.prompt_len + keep - 1)
            row = seq.row
            if conv.end_turn(seq, keep is not None or seq.tokens[-1] in self.settings.stop_ids):
                self.runner.rows.forget(row)  # stale when it comes back (appended tokens)

    def reschedule(self) -> bool:
        """Every running sample gets the pages of its next ``sync_every`` tokens (the latest-admitted preempted
        when the pool runs dry), and the rows are compacted; returns whether any row changed."""
        sched, state = self.scheduler, self.state
        preempted = sched.grow(self.settings.sync_every, before_leave=lambda seqs: read_tokens(state, seqs))
        if preempted:
            state.done[[row for _, row in preempted]] = True
            for _, row in preempted:  # its row cache is stale if it comes back (recomputed)
                self.runner.rows.forget(row)
        moves = sched.compact()
        if moves:
            self.runner.flush_rows([(m[0], sched.rows[m[1]]) for m in moves])  # dst is loaded from pages
            src = torch.tensor([m[0] for m in moves], device=self.settings.device)
            dst = torch.tensor([m[1] for m in moves], device=self.settings.device)
            for t in state:
                t[dst] = t[src]
        return bool(preempted or moves)

    def admit(self, adm: Admission) -> None:
        """Prefill new prompts, recomputed samples and resumed samples' appended tokens into their pages, copy
        partial prompt pages, and start the admitted rows (:meth:`start_rows`, :meth:`restart_rows`)."""
        sched, runner, conv = self.scheduler, self.runner, self.conversations
        seqs = [(self.prompts[p], sched.prompt_pages[p], p, p) for p in adm.prefill]
        seqs += [(conv.context(self.prompts, s) + s.tokens[:-1], s.pages, None, s.prompt) for s in adm.recompute]
        seqs += [(conv.context(self.prompts, s), s.pages, s, s.prompt) for s in adm.resume if not s.kv]  # evicted
        hidden = runner.prefill(seqs) if seqs else {}
        self.counts["prefill_tokens"] += sum(len(s[0]) for s in seqs)
        appended = [(conv.context(self.prompts, s)[s.kv :], s.kv, s.pages, s) for s in adm.resume if s.kv]
        if appended:  # the last sampled token and the observation, onto the K/V in its pages
            hidden.update(runner.prefill_appended(appended))
            total = sum(len(s[0]) for s in appended)
            self.counts["prefill_tokens"] += total
            self.counts["resume_prefill_tokens"] += total
        self.last_hidden.update({k: h for k, h in hidden.items() if isinstance(k, int)})
        copies = [(sched.prompt_pages[s.prompt][s.shared], s.pages[s.shared])
                  for s in adm.fresh if s.prompt_len % self.settings.page_size]
        if copies:  # the partly filled last prompt page, one private copy per sample
            runner.copy_pages([c[0] for c in copies], [c[1] for c in copies])
        if adm.fresh or adm.resume:
            self.start_rows(adm, hidden)
        sched.release_prompts()
        for s in adm.recompute:
            self.restart_row(s)

    def start_rows(self, adm: Admission, hidden: dict) -> None:
        """New samples and resumed turns: their first token, sampled from their prefill's last hidden state, and
        their rows' state."""
        state, dev, params = self.state, self.settings.device, self.params
        starts = adm.fresh + adm.resume
        idx = torch.tensor([s.row for s in starts], device=dev)
        h = [self.last_hidden[s.prompt] for s in adm.fresh] + [hidden[s] for s in adm.resume]
        logits = self.runner.first_logits(torch.stack(h))  # [A, V]
        sample_A = torch.tensor([s.sample for s in starts], device=dev)
        stream_A = sample_streams(self.settings.seed, sample_A)
        trajectories = self.conversations.trajectories
        t0_A = torch.tensor([trajectories[s.sample].sampled for s in starts], device=dev)
        tok, lp = sample_tokens(logits, params, row_seeds(stream_A, t0_A),
                                batch_invariant=self.settings.batch_invariant)
        limits = torch.tensor([s.limit for s in starts], device=dev)
        state.tok[idx] = tok
        state.pos[idx] = torch.tensor([s.context for s in starts], device=dev)
        state.n_gen[idx] = 1
        state.out_tok[idx, 0] = tok
        state.out_lp[idx, 0] = lp
        state.limit[idx] = limits
        if self.vision is not None:  # decode's rotary position: pos + the prompt's M-RoPE delta
            state.rope[idx] = torch.tensor([self.vision.deltas[s.prompt] for s in starts], device=dev)
        state.stream[idx] = stream_A
        state.t0[idx] = t0_A
        if state.u.shape[1]:
            state.u[idx] = stream_uniforms(stream_A, t0_A, state.u.shape[1])
        state.done[idx] = torch.isin(tok, self.stop_ids) | (limits <= 1)

    def restart_row(self, s) -> None:
        """A recomputed sample continues from its last sampled token, with everything it sampled kept."""
        state, dev = self.state, self.settings.device
        c = len(s.tokens)
        state.tok[s.row] = s.tokens[-1]
        state.pos[s.row] = s.context + c - 1
        state.n_gen[s.row] = c
        state.out_tok[s.row, :c] = torch.tensor(s.tokens, device=dev)
        state.out_lp[s.row, :c] = torch.tensor(s.logprobs, device=dev)
        state.limit[s.row] = s.limit
        if self.vision is not None:
            state.rope[s.row] = self.vision.deltas[s.prompt]
        state.stream[s.row] = sample_streams(self.settings.seed, torch.tensor([s.sample], device=dev))[0]
        state.t0[s.row] = self.conversations.trajectories[s.sample].sampled
        if state.u.shape[1]:
            state.u[s.row] = stream_uniforms(state.stream[s.row, None], state.t0[s.row, None], state.u.shape[1])[0]
        state.done[s.row] = False

    def prepare_batch(self) -> tuple[int, int]:
        """The batch bucket ``S_b`` (the smallest power of two that holds the running rows; padding rows write to
        the scratch page), the block tables when they changed, and the CPU row cache; returns ``(S_b, n_pages)``
        (the widest row's pages)."""
        sched, state = self.scheduler, self.state
        running = len(sched.rows)
        S_b = bucket(running, self.R)
        # otherwise the block tables change only when a row's sequence gets a page (appended to its pages)
        layout = [(seq, len(seq.pages)) for seq in sched.rows]
        if S_b != self.table_rows or len(layout) != len(self.table_layout) or any(
            a is not b or n != m for (a, n), (b, m) in zip(layout, self.table_layout)
        ):
            width = state.table.shape[1]
            table = [seq.pages + [0] * (width - len(seq.pages)) for seq in sched.rows]
            table += [[0] * width] * (S_b - running)  # padding rows: the scratch page
            table_SP = torch.tensor(table, dtype=torch.int32, device="cpu")  # made on the host, copied in one go
            state.table[:S_b] = table_SP.to(self.settings.device, non_blocking=True)
            self.table_rows, self.table_layout = S_b, layout
        if running < S_b:
            state.done[running:S_b] = True  # padding rows: write to the scratch page, never recorded
            state.pos[running:S_b] = 0
            # and feed token 0, whatever row left them: an MoE step's expert products take every row, so a stale
            # token there (which differs between a session and its restored copy) changes the live rows' rounding
            state.tok[running:S_b] = 0
        n_pages = max(len(seq.pages) for seq in sched.rows)
        self.runner.load_rows(sched.rows, n_pages)
        return S_b, n_pages

    def decode_steps(self, S_b: int, n_pages: int) -> None:
        """``sync_every`` decode steps of rows ``[0, S_b)`` without reading anything back: each step samples one
        token per row and advances the live rows (a done row's draw lands past its tokens, read by nothing)."""
        state, params = self.state, self.params
        steps, invariant = self.settings.sync_every, self.settings.batch_invariant
        rows = torch.arange(S_b, device=self.settings.device)
        for i in range(steps):
            logits = self.runner.decode(S_b, n_pages)  # [S_b, V] fp32
            col = state.n_gen[:S_b]
            if state.u.shape[1]:
                tok, lp = sample_tokens(logits, params, None, state.u[rows, col], batch_invariant=invariant)
            else:
                tok, lp = sample_tokens(logits, params, row_seeds(state.stream[:S_b], state.t0[:S_b] + col),
                                        batch_invariant=invariant)
            live_S = ~state.done[:S_b]
            if self.recorder is not None:  # the experts of the tokens this step fed, at their positions
                self.recorder.keep_step(i, S_b, state.pos[:S_b], live_S)
            state.out_tok[rows, col] = tok
            state.out_lp[rows, col] = lp
            state.n_gen[:S_b] += live_S
            stop = torch.isin(tok, self.stop_ids) | (state.n_gen[:S_b] >= state.limit[:S_b])
            state.done[:S_b] |= live_S & stop
            state.pos[:S_b] += live_S
            state.tok[:S_b] = tok  # a done row feeds it at its pos, where nothing of it is kept or read
        self.counts["decode_steps"] += steps
        self.counts["active_row_steps"] += steps * len(self.scheduler.rows)  # the batch's occupancy
