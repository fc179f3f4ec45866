"""The host loop of one ``generate`` call (``_DecodeLoop``, a mixin of ``fastgrpo.generation._Run``): every
``sync_every`` steps it reads the flags and counts, harvests finished samples, lets the scheduler grow, preempt,
compact and admit (``fastgrpo.scheduler.Scheduler`` is the one place that knows which sample is where), prefills
admitted prompts in packed chunks, samples first tokens, rebuilds the block tables when they change, then runs
``sync_every`` decode steps without reading anything back. The rows' device state is ``_RowState``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fastgrpo.engine_sampling import Completion, _row_seeds, _sample, _sample_streams
from fastgrpo.scheduler import Admission

PREFILL_CHUNK_TOKENS = 16384  # prompts are prefilled in packed chunks of at most this many tokens (bounds activations)


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


def _bucket(n: int, cap: int) -> int:
    """Smallest power of two >= n, at most cap."""
    return min(cap, 1 << max(n - 1, 0).bit_length())


class _DecodeLoop:
    """The ``_Run`` host loop, admission and prefill."""

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
