"""The host loop of one ``generate`` call (``_DecodeLoop``, a mixin of ``fastgrpo.engine.engine._Run``): every
``sync_every`` steps it reads the flags and counts (and, with stop strings, the newest tokens), ends the turns of
finished samples (``fastgrpo.engine.turns``: finish, or pause for the turn handler), lets the scheduler grow,
preempt, compact, take the handler's answers and admit (``fastgrpo.engine.scheduler.Scheduler`` is the one place that
knows which sample is where), prefills admitted prompts in packed chunks and resumed samples' appended tokens onto
their cached K/V, samples first tokens, rebuilds the block tables when they change, then runs ``sync_every`` decode
steps without reading anything back. The rows' device state is ``_RowState``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fastgrpo.engine.sampling import Completion, _row_seeds, _sample, _sample_streams, _stream_uniforms
from fastgrpo.engine.scheduler import Admission
from fastgrpo.engine.turns import _Traj

PREFILL_CHUNK_TOKENS = 16384  # prompts are prefilled in packed chunks of at most this many tokens (bounds activations)


class _RowState(NamedTuple):
    """Per-row decode state on the device (rows [0, running) hold the scheduler's running samples)."""

    tok: torch.Tensor  # [R] int64
    pos: torch.Tensor  # [R] int64
    n_gen: torch.Tensor  # [R] int64: tokens sampled in the current turn
    done: torch.Tensor  # [R] bool
    limit: torch.Tensor  # [R] int64
    stream: torch.Tensor  # [R] int64: the key of the sample's random stream, h(seed, sample) (``_sample_streams``)
    t0: torch.Tensor  # [R] int64: tokens it sampled in earlier turns (its draw index is t0 + n_gen)
    # the step writes column n_gen of every row, done or not: the last column (n_gen = max_new) is scratch
    out_tok: torch.Tensor  # [R, max_new + 1] int64
    out_lp: torch.Tensor  # [R, max_new + 1] fp32
    u: torch.Tensor  # [R, max_new + 1] fp64: uniforms of its draws t0 + j (CPU, ``_stream_uniforms``); [R, 0] on CUDA
    table: torch.Tensor  # [R, max_pages] int32


def _bucket(n: int, cap: int) -> int:
    """Smallest power of two >= n, at most cap."""
    return min(cap, 1 << max(n - 1, 0).bit_length())


class _DecodeLoop:
    """The ``_Run`` host loop, admission and prefill."""

    def _loop(self, cache, R, on_group_done) -> list[list[Completion]]:
        P, n, st, sched = len(self.prompts), self.params.n, self.st, self.sched
        self.results: list[list[Completion | None]] = [[None] * n for _ in range(P)]
        self.unfinished = [n] * P  # samples of each prompt not finished yet
        self.on_group_done = on_group_done
        self.trajs = {p * n + j: _Traj(self.params.stop_strings) for p in range(P) for j in range(n)}
        self.awaiting: dict = {}  # (prompt, sample index) -> paused sample waiting on its turn handler
        self.watch_stops = bool(self.params.stop_strings)  # some sample may have stop strings
        last_hidden: dict[int, torch.Tensor] = {}  # [H] of each prompt whose pages are held
        rows = torch.arange(R, device=self.device)
        steps = self.sync_every
        window = torch.arange(steps, device=self.device) - steps  # the newest sync_every tokens' columns, from n_gen
        S_b = 0  # rows [0, S_b) are stepped
        table_rows, table_layout = 0, []  # the block tables in st.table: rows written, (sequence, pages) per row
        while True:
            # ---- host bookkeeping: one device->host read of the flags and counts per sync_every steps
            running = len(sched.rows)
            preempted = moves = None
            if running:
                flags = [st.done[:running, None].long(), st.n_gen[:running, None]]
                if self.watch_stops:  # and the newest tokens, for the stop strings
                    cols = (st.n_gen[:running, None] + window).clamp(min=0)  # [S, steps]
                    flags.append(st.out_tok[:running].gather(1, cols))
                flags = torch.cat(flags, dim=1).tolist()
                for row, seq in enumerate(sched.rows):
                    seq.generated = flags[row][1]
                cut = self._stop_matches([f[2:] for f in flags]) if self.watch_stops else {}
                finished = [seq for row, seq in enumerate(sched.rows) if flags[row][0] or seq in cut]
                if finished:
                    self._read_tokens(finished)
                    if self.turns is not None:  # one that pauses keeps its pages: they get what only its row holds
                        self._flush_rows(cache, [(seq.row, seq) for seq in finished])
                    for seq in finished:
                        keep = cut.get(seq)
                        if keep is not None:  # seen late (sync_every > 1): the tokens past the match are trimmed
                            seq.tokens, seq.logprobs, seq.generated = seq.tokens[:keep], seq.logprobs[:keep], keep
                        self._end_turn(seq, keep is not None or seq.tokens[-1] in self.stop_set)
                preempted = sched.grow(steps, before_leave=self._read_tokens)
                if preempted:
                    st.done[[row for _, row in preempted]] = True
                    for _, row in preempted:  # its row cache is stale if it comes back (recomputed)
                        self.row_owner[row] = None
                moves = sched.compact()
                if moves:
                    self._flush_rows(cache, [(m[0], sched.rows[m[1]]) for m in moves])  # dst is loaded from pages
                    src = torch.tensor([m[0] for m in moves], device=self.device)
                    dst = torch.tensor([m[1] for m in moves], device=self.device)
                    for t in st:
                        t[dst] = t[src]
            if self.awaiting:
                self._poll_turns()
            admission = sched.admit(steps)
            self._admit(cache, admission, last_hidden)
            started = admission.fresh or admission.resume
            if running and (preempted or moves) or admission.prefill or admission.recompute or started:
                table_layout = []  # rows may hold other sequences, or a sequence other pages: rebuild the tables
            for p in list(last_hidden):
                if p not in sched.prompt_pages:
                    del last_hidden[p]
            if started:
                continue  # a sample can finish at its first token (stop token or a limit of 1): harvest it first
            if sched.done:
                break
            if not sched.rows:
                if not self.awaiting:
                    raise RuntimeError("nothing runs, waits or is paused, yet the call is not done")
                continue  # every sample left is paused on its handler: the next round waits for an answer
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
            if cache.work is not None and cache.work.kv_rows is not None:
                self._refresh_rows(cache.work, cache, n_pages)

            # ---- sync_every decode steps without reading anything back
            for _ in range(steps):
                logits = self._step(cache, S_b, n_pages)  # [S_b, V] fp32
                r, col = rows[:S_b], st.n_gen[:S_b]  # a done row's draw lands past its tokens, read by nothing
                if st.u.shape[1]:
                    tok, lp = _sample(logits, self.params, None, st.u[r, col])
                else:
                    tok, lp = _sample(logits, self.params, _row_seeds(st.stream[:S_b], st.t0[:S_b] + col))
                live_S = ~st.done[:S_b]
                st.out_tok[r, col] = tok
                st.out_lp[r, col] = lp
                st.n_gen[:S_b] += live_S
                stop = torch.isin(tok, self.stop_ids) | (st.n_gen[:S_b] >= st.limit[:S_b])
                st.done[:S_b] |= live_S & stop
                st.pos[:S_b] += live_S
                st.tok[:S_b] = tok  # a done row feeds it at its pos, where nothing of it is kept or read
            self.stats["decode_steps"] += steps
        return self.results

    def _read_tokens(self, seqs) -> None:
        """Copy the generated tokens and log-probs of ``seqs`` (at their rows) to the host."""
        idx = torch.tensor([s.row for s in seqs], device=self.device)
        toks, lps = self.st.out_tok[idx].tolist(), self.st.out_lp[idx].tolist()
        for s, tk, lp in zip(seqs, toks, lps):
            s.tokens, s.logprobs = tk[: s.generated], lp[: s.generated]

    def _admit(self, cache, adm: Admission, last_hidden) -> None:
        """Prefill new prompts, recomputed samples and resumed samples' appended tokens into their pages, copy
        partial prompt pages, sample first tokens (of new samples and of resumed turns), and fill the admitted rows'
        state."""
        sched, st, dev, ps = self.sched, self.st, self.device, self.ps

        def context(s):  # the ids before its current turn: prompt, earlier turns, observations
            return self.prompts[s.prompt] + self.trajs[s.sample].ids

        seqs = [(self.prompts[p], sched.prompt_pages[p], p) for p in adm.prefill]
        seqs += [(context(s) + s.tokens[:-1], s.pages, None) for s in adm.recompute]
        seqs += [(context(s), s.pages, s) for s in adm.resume if not s.kv]  # evicted while paused: all of it
        hidden = self._prefill_all(cache, seqs) if seqs else {}
        appended = [s for s in adm.resume if s.kv]
        if appended:  # the last sampled token and the observation, onto the K/V in its pages
            hidden.update(self._prefill_appended(cache, [(context(s)[s.kv :], s.kv, s.pages, s) for s in appended]))
        last_hidden.update({k: h for k, h in hidden.items() if isinstance(k, int)})
        fresh = adm.fresh
        if fresh:
            copies = [
                (sched.prompt_pages[s.prompt][s.shared], s.pages[s.shared]) for s in fresh if s.prompt_len % ps
            ]
            if copies:  # the partly filled last prompt page, one private copy per sample
                src = torch.tensor([c[0] for c in copies], device=dev)
                dst = torch.tensor([c[1] for c in copies], device=dev)
                cache.copy_pages(src, dst)
        starts = fresh + adm.resume  # their first token comes from the prefill's last hidden state
        if starts:
            idx = torch.tensor([s.row for s in starts], device=dev)
            h = [last_hidden[s.prompt] for s in fresh] + [hidden[s] for s in adm.resume]
            logits = self.e._logits(self.ops, torch.stack(h))  # [A, V]
            sample_A = torch.tensor([s.sample for s in starts], device=dev)
            stream_A = _sample_streams(self.seed, sample_A)
            t0_A = torch.tensor([self.trajs[s.sample].sampled for s in starts], device=dev)
            tok, lp = _sample(logits, self.params, _row_seeds(stream_A, t0_A))
            limits = torch.tensor([s.limit for s in starts], device=dev)
            st.tok[idx] = tok
            st.pos[idx] = torch.tensor([s.context for s in starts], device=dev)
            st.n_gen[idx] = 1
            st.out_tok[idx, 0] = tok
            st.out_lp[idx, 0] = lp
            st.limit[idx] = limits
            st.stream[idx] = stream_A
            st.t0[idx] = t0_A
            if st.u.shape[1]:
                st.u[idx] = _stream_uniforms(stream_A, t0_A, st.u.shape[1])
            st.done[idx] = torch.isin(tok, self.stop_ids) | (limits <= 1)
        sched.release_prompts()
        for s in adm.recompute:  # continue from the last sampled token, with everything kept
            c = len(s.tokens)
            st.tok[s.row] = s.tokens[-1]
            st.pos[s.row] = s.context + c - 1
            st.n_gen[s.row] = c
            st.out_tok[s.row, :c] = torch.tensor(s.tokens, device=dev)
            st.out_lp[s.row, :c] = torch.tensor(s.logprobs, device=dev)
            st.limit[s.row] = s.limit
            st.stream[s.row] = _sample_streams(self.seed, torch.tensor([s.sample], device=dev))[0]
            st.t0[s.row] = self.trajs[s.sample].sampled
            if st.u.shape[1]:
                st.u[s.row] = _stream_uniforms(st.stream[s.row, None], st.t0[s.row, None], st.u.shape[1])[0]
            st.done[s.row] = False

    def _prefill_appended(self, cache, seqs) -> dict:
        """Prefill ``(tokens, start, pages, key)``: each sequence's new tokens at positions ``start, start + 1, ...``
        against the K/V of ``[0, start)`` already in its pages (a chunked prefill: nothing before is recomputed), in
        packed chunks; returns the last hidden state ``[H]`` of each key."""
        e, dev, ps = self.e, self.device, self.ps
        out = {}
        i = 0
        while i < len(seqs):
            chunk, total = [], 0
            while i < len(seqs) and (not chunk or total + len(seqs[i][0]) <= PREFILL_CHUNK_TOKENS):
                chunk.append(seqs[i])
                total += len(seqs[i][0])
                i += 1
            tokens, positions, slots, spans, tables = [], [], [], [], []
            for toks, start, pages, _ in chunk:
                end = start + len(toks)
                spans.append((len(tokens), len(toks), start))
                tokens += toks
                positions += range(start, end)
                slots += [pages[t // ps] * ps + t % ps for t in range(start, end)]
                tables.append(torch.tensor(pages[: -(-end // ps)], device=dev))
            x = e._prefill_onto(
                self.ops, torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev), spans, tables,
                self.cos_TD, self.sin_TD, cache, torch.tensor(slots, device=dev), self.dtype,
            )  # [N_chunk, H]  # fmt: skip
            self.stats["prefill_tokens"] += total
            self.stats["resume_prefill_tokens"] += total
            for (at, m, _), (_, _, _, key) in zip(spans, chunk):
                out[key] = x[at + m - 1]
        return out

    def _prefill_all(self, cache, seqs) -> dict[int, torch.Tensor]:
        """Prefill ``(tokens, pages, key or None)`` sequences in packed chunks (longest first), K/V into their
        pages; returns the last hidden state ``[H]`` of each key (a prompt index or a resumed sample; None: a
        recompute, whose next token is known)."""
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
