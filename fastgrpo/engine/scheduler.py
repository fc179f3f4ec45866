"""Host bookkeeping of one ``GenerationEngine.generate`` call: the queue, the KV pages, admission, harvest,
preemption and which batch row holds which sample. Plain Python, no tensors: the engine's device step reads the
block tables and lengths it produces, and tests (and ``bench/bench_scheduler.py``) drive it without a model.

The KV cache is a pool of ``num_pages`` pages of ``page_size`` tokens (page 0 is a scratch page: the padding rows
of a batch bucket write there). A sequence's K/V live in the pages of its block table, in order: token ``t`` is at
``(pages[t // page_size], t % page_size)``.

- **Shared prompt pages.** A prompt is prefilled once into pages the prompt holds; each of its ``n`` samples
  references the prompt's *full* pages (a reference count per page) and gets a private copy of the partly filled
  last one, so samples only ever write to private pages.
- **One wave.** Every sample is queued at once, prompt-major. Before each chunk of ``steps`` decode steps the
  scheduler (1) harvests finished samples and frees their pages, (2) gives every running sample the pages its next
  ``steps`` tokens need, preempting the latest-admitted running sample while the pool is short (its pages are freed;
  it is requeued at the front with its tokens and log-probs kept, and later recomputed: prompt + generated tokens
  prefilled again into private pages; when one sample is left, the prompts held for queued samples are released
  instead and prefilled again later), then (3) admits queued samples while pages and rows allow, keeping one free
  page per running sample in reserve so that admission does not immediately force a preemption.
- **Rows.** Running samples occupy rows ``[0, running)``; when one leaves, the last row moves into its place
  (:meth:`Scheduler.compact` returns the moves for the device state).
- **Turns (multi-turn).** A sample that ends a turn at a boundary *pauses* (:meth:`Scheduler.pause`): it leaves its
  row and keeps the pages of its cached tokens (those of tokens sampled past a stop string are freed), while the
  others go on decoding. When its turn handler answers, :meth:`Scheduler.resume` queues it with the appended tokens
  counted in its context; admission (resumed samples first) gives it the pages of the appended tokens and its next
  ``steps`` tokens, and the engine prefills the appended tokens (and the last sampled one, whose K/V were not
  cached) into its own pages against the K/V already there. When the pool is short, paused samples are evicted
  before any running sample is preempted, the latest paused first (a paused sample is idle, maybe for seconds of
  environment time; a running one is not): its pages are freed and, when it resumes, its whole conversation is
  prefilled again into private pages. A sample preempted mid-turn is recomputed from all its tokens (prompt,
  earlier turns, observations, this turn's tokens).

Invariants (:meth:`Scheduler.check`): a page's reference count equals the number of block tables and prompt
holders that list it; free pages have count 0 and are not listed; no private (written) page is listed twice;
after the call every page is free.

Memory: the pool is the only large allocation, ``num_pages · page_size`` tokens × (2 · layers · Hkv · D · bytes)
(28 KiB per token for DeepSeek-R1-Distill-Qwen-1.5B in bf16). Host state is O(pages + samples). Paused samples hold
their pages: 28 KiB × the conversation's length each, e.g. 224 MiB for a 8K-token conversation, 672 MiB at 24K; a
40 GiB pool holds ~180 paused 8K conversations or ~60 at 24K, so with many slow environment steps in flight the pool
fills with paused samples and eviction (a full re-prefill at resume) takes over from KV reuse.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

SCRATCH_PAGE = 0  # never allocated: padding rows of a batch bucket read and write it


@dataclass(eq=False)
class Seq:
    """One sample (completion) of one prompt."""

    prompt: int
    """Index of its prompt in the call."""
    sample: int
    """Its id in the call (prompt · n + j): the key of its random stream."""
    prompt_len: int
    limit: int
    """Most tokens it may generate (in its current turn)."""
    tokens: list[int] = field(default_factory=list)
    """Generated tokens known to the host (filled at harvest or preemption)."""
    logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    """Block table: the pages holding its K/V, in token order (the first ones may be its prompt's shared pages)."""
    shared: int = 0
    """How many leading pages are its prompt's (read-only); the rest are private (it writes them)."""
    generated: int = 0
    """Tokens generated so far (the last one is fed at the next step, so its K/V are not cached yet)."""
    admitted: int = -1
    """Admission counter (the latest admitted is preempted first); -1 while queued."""
    row: int = -1
    context: int = -1
    """Tokens before its current turn: the prompt, earlier turns and appended observations (-1: the prompt's)."""
    kv: int = 0
    """Resuming: tokens whose K/V are still in its pages (0: evicted, the whole conversation is prefilled again)."""
    paused: int = -1
    """Pause counter (the latest paused is evicted first); -1 while not paused."""

    def __post_init__(self):
        if self.context < 0:
            self.context = self.prompt_len

    @property
    def cached(self) -> int:
        """Tokens whose K/V are in the cache (the last sampled token's are written when it is fed)."""
        return self.context + self.generated - 1


@dataclass
class Admission:
    """What the device must do for one admission round."""

    prefill: list[int]
    """Prompts to prefill into their (new) prompt pages."""
    fresh: list[Seq]
    """New samples of prefilled prompts: copy the partial last prompt page, sample the first token."""
    recompute: list[Seq]
    """Preempted samples: prefill prompt + generated[:-1] into their pages, then continue."""
    resume: list[Seq] = field(default_factory=list)
    """Resumed samples (multi-turn): prefill their tokens ``[kv, context)`` into their pages against the K/V of
    ``[0, kv)`` already there (kv = 0: all of them, into private pages), then sample the first token of the turn."""


class Scheduler:
    """Queue, pages and rows of one generate call (see the module docstring).

    Args:
        prompt_lens: token count of each prompt.
        n: samples per prompt.
        limits: response limit of each prompt.
        page_size: tokens per page.
        num_pages: pages in the pool (page 0 included, never allocated).
        max_running: most samples decoded at once (rows).
        max_context: multi-turn: most tokens a conversation may reach (the pool must hold one); None: prompt + limit.
    """

    def __init__(self, prompt_lens: list[int], n: int, limits: list[int], page_size: int, num_pages: int,
                 max_running: int, max_context: int | None = None):
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_running = max_running
        self.prompt_lens = prompt_lens
        self.refs = [0] * num_pages
        self.free = list(range(num_pages - 1, SCRATCH_PAGE, -1))  # pop() gives the lowest page first
        self.waiting: deque[Seq] = deque(
            Seq(p, p * n + j, prompt_lens[p], limits[p]) for p in range(len(prompt_lens)) for j in range(n)
        )
        self.rows: list[Seq | None] = []
        self.prompt_pages: dict[int, list[int]] = {}
        self.paused: dict[int, Seq] = {}  # sample id -> a sample between turns (awaiting its handler or resuming)
        self.resuming: deque[Seq] = deque()  # paused samples with their appended tokens, to be admitted first
        self.unadmitted = [n] * len(prompt_lens)  # samples of each prompt never admitted yet
        self._counter = 0
        self.preemptions = 0
        self.peak_running = 0
        self.peak_pages = 0
        self.evictions = 0
        self.peak_paused = 0
        self._paused_counter = 0
        self.n = n
        self.max_context = max_context
        if max_context is not None:
            need = self.pages_for(max_context) + 1
            if need > num_pages - 1:
                raise ValueError(f"cannot hold a {max_context}-token conversation: that needs {need + 1} pages")
        elif prompt_lens:
            self._check_fits(max(range(len(prompt_lens)), key=lambda p: prompt_lens[p] + limits[p]), limits)

    def _check_fits(self, p: int, limits: list[int]) -> None:
        """Prompt ``p`` plus its response fits the pool: its pages, one more for its prompt's partial page, the
        scratch page."""
        need = self.pages_for(self.prompt_lens[p] + limits[p]) + 1
        if need > self.num_pages - 1:
            raise ValueError(
                f"cannot hold prompt {p} ({self.prompt_lens[p]} tokens) plus its {limits[p]}-token "
                f"response: that needs {need + 1} pages"
            )

    def add_prompts(self, prompt_lens: list[int], limits: list[int]) -> None:
        """Queue ``n`` samples of each of these prompts behind the waiting ones (a generation session's refill);
        they are numbered after the prompts already known."""
        first = len(self.prompt_lens)
        self.prompt_lens += prompt_lens
        for i, (length, limit) in enumerate(zip(prompt_lens, limits)):
            p = first + i
            if self.max_context is None:
                self._check_fits(p, {p: limit})
            self.waiting.extend(Seq(p, p * self.n + j, length, limit) for j in range(self.n))
        self.unadmitted += [self.n] * len(prompt_lens)

    def drop_caches(self, before_leave=None) -> list[tuple[Seq, int]]:
        """Free every cached K/V (the weights changed and the caller wants them recomputed): each running sample is
        preempted (``before_leave`` as in :meth:`grow`; requeued at the front in admission order, with its tokens,
        recomputed at admission), each paused one evicted (its conversation prefilled again when it resumes) and
        every prompt holder released. Returns ``(sample, row it left)`` per preempted sample."""
        running = sorted((s for s in self.rows if s is not None), key=lambda s: s.admitted)
        if running and before_leave is not None:
            before_leave(running)
        left = [(s, s.row) for s in running]
        for s in reversed(running):  # the earliest admitted ends up first in the queue
            self._release(s.pages)
            s.pages, s.shared, s.admitted = [], 0, -1
            self._leave(s)
            self.waiting.appendleft(s)
        self.preemptions += len(running)
        while self._evict_paused():
            pass
        self._drop_prompts()
        return left

    # ------------------------------------------------------------------ pages

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def used_pages(self) -> int:
        return self.num_pages - 1 - len(self.free)

    def _alloc(self, k: int) -> list[int]:
        pages = [self.free.pop() for _ in range(k)]
        for pg in pages:
            self.refs[pg] = 1
        self.peak_pages = max(self.peak_pages, self.used_pages)
        return pages

    def _release(self, pages: list[int]) -> None:
        for pg in pages:
            self.refs[pg] -= 1
            if self.refs[pg] == 0:
                self.free.append(pg)

    def _need(self, seq: Seq, steps: int) -> int:
        """Pages ``seq`` must hold to run ``steps`` more decode steps (capped at its last position)."""
        return self.pages_for(min(seq.cached + steps, seq.context + seq.limit))

    # ------------------------------------------------------------------ one round

    def finish(self, seq: Seq) -> None:
        """A harvested sample leaves its row (or, paused, the paused set); its pages go back to the pool."""
        self._release(seq.pages)
        seq.pages, seq.shared = [], 0
        if seq.row >= 0:
            self._leave(seq)
        self.paused.pop(seq.sample, None)
        seq.paused = -1

    def pause(self, seq: Seq) -> None:
        """A running sample ended a turn at a boundary (its ``generated`` tokens, trimmed at a stop string): it leaves
        its row and keeps the pages of its cached tokens, the turn becomes part of its context."""
        seq.context += seq.generated
        seq.generated = 0
        keep = self.pages_for(seq.cached)  # the last sampled token's K/V are not cached: written at resume
        self._release(seq.pages[keep:])
        seq.pages = seq.pages[:keep]
        self._leave(seq)
        seq.admitted = -1
        seq.paused = self._paused_counter
        self._paused_counter += 1
        self.paused[seq.sample] = seq
        self.peak_paused = max(self.peak_paused, len(self.paused))

    def resume(self, seq: Seq, appended: int, limit: int) -> None:
        """A paused sample's handler answered with ``appended`` tokens: queue it (before the waiting queue) with
        those tokens in its context and a turn of at most ``limit`` tokens."""
        seq.kv = seq.cached if seq.pages else 0
        seq.context += appended
        seq.limit = limit
        self.resuming.append(seq)

    def add_resuming(self, seq: Seq) -> None:
        """A restored sample between turns whose handler had answered (``fastgrpo.engine.snapshot``): paused with no
        pages (its whole conversation is prefilled at admission) and queued to resume."""
        seq.pages, seq.kv, seq.paused = [], 0, self._paused_counter
        self._paused_counter += 1
        self.paused[seq.sample] = seq
        self.resuming.append(seq)
        self.peak_paused = max(self.peak_paused, len(self.paused))

    def _evict_paused(self, keep: Seq | None = None) -> bool:
        """Free the pages of the latest-paused sample that holds any (not ``keep``); False when there is none."""
        holders = [s for s in self.paused.values() if s.pages and s is not keep]
        if not holders:
            return False
        victim = max(holders, key=lambda s: s.paused)
        self._release(victim.pages)
        victim.pages, victim.shared, victim.kv = [], 0, 0
        self.evictions += 1
        return True

    def _leave(self, seq: Seq) -> None:
        self.rows[seq.row] = None
        seq.row = -1

    def compact(self) -> list[tuple[int, int]]:
        """Close the holes left by finished/preempted samples: returns the ``(src, dst)`` row moves."""
        moves = []
        live = [s for s in self.rows if s is not None]
        for dst, seq in enumerate(live):
            if seq.row != dst:
                moves.append((seq.row, dst))
                seq.row = dst
        self.rows = live
        return moves

    def grow(self, steps: int, before_leave=None) -> list[tuple[Seq, int]]:
        """Give each running sample the pages of its next ``steps`` tokens, preempting the latest-admitted ones
        while the pool is short. ``before_leave([seq])`` runs while a victim still has its row (the engine reads its
        tokens there). Returns ``(sample, row it left)`` per preempted sample, already requeued at the front."""
        preempted = []
        while True:
            running = [s for s in self.rows if s is not None]
            short = sum(max(0, self._need(s, steps) - len(s.pages)) for s in running)
            if short <= len(self.free):
                break
            if self._evict_paused():
                continue
            if len(running) == 1:  # the rest of the pool is held for queued samples' prompts: let those go
                if not self.prompt_pages:
                    raise RuntimeError("the KV pool cannot hold one sequence (checked at construction)")
                self._drop_prompts()
                continue
            victim = max(running, key=lambda s: s.admitted)
            if before_leave is not None:
                before_leave([victim])
            preempted.append((victim, victim.row))
            self._release(victim.pages)
            victim.pages, victim.shared = [], 0
            victim.admitted = -1
            self._leave(victim)
            self.waiting.appendleft(victim)
            self.preemptions += 1
        for s in self.rows:
            if s is not None:
                s.pages += self._alloc(max(0, self._need(s, steps) - len(s.pages)))
        return preempted

    def admit(self, steps: int) -> Admission:
        """Admit queued samples (front first) while rows and pages allow; allocates their pages and rows."""
        out = Admission([], [], [])
        ps = self.page_size
        while self.resuming or self.waiting:
            running = sum(s is not None for s in self.rows)
            if running >= self.max_running:
                break
            resume = bool(self.resuming)
            seq = self.resuming[0] if resume else self.waiting[0]
            full = seq.prompt_len // ps
            if resume:  # the appended tokens and the turn's first steps (its first token is sampled at admission)
                need, prefill = self.pages_for(seq.context + min(steps, seq.limit)) - len(seq.pages), 0
            elif seq.generated:  # recompute: everything private
                need, prefill = self._need(seq, steps), 0
            else:  # its first token is sampled at admission, then fed at position prompt_len
                need = self.pages_for(seq.prompt_len + min(steps, seq.limit)) - full
                prefill = 0 if seq.prompt in self.prompt_pages else self.pages_for(seq.prompt_len)
            if need + prefill + running > len(self.free):  # keep a page per running sample in reserve
                if running:
                    break
                if need + prefill > len(self.free):  # paused samples and prompt holders left: let them go
                    if not self._evict_paused(keep=seq):
                        if not self.prompt_pages:
                            raise RuntimeError("the KV pool cannot hold one sequence (checked at construction)")
                        self._drop_prompts()
                    continue
            (self.resuming if resume else self.waiting).popleft()
            if resume:
                del self.paused[seq.sample]
                seq.paused = -1
                seq.pages += self._alloc(need)
                seq.generated = 1
                out.resume.append(seq)
            elif seq.generated:
                seq.pages = self._alloc(need)
                out.recompute.append(seq)
            else:
                if prefill:
                    self.prompt_pages[seq.prompt] = self._alloc(prefill)
                    out.prefill.append(seq.prompt)
                shared = self.prompt_pages[seq.prompt][:full]
                for pg in shared:
                    self.refs[pg] += 1
                seq.pages, seq.shared = shared + self._alloc(need), full
                seq.generated = 1
                out.fresh.append(seq)
                self.unadmitted[seq.prompt] -= 1
            seq.admitted = self._counter
            self._counter += 1
            seq.row = len(self.rows)
            self.rows.append(seq)
            self.peak_running = max(self.peak_running, sum(s is not None for s in self.rows))
        return out

    def _drop_prompts(self) -> None:
        """Release every prompt holder (their prompts are prefilled again when their next sample is admitted)."""
        for pages in self.prompt_pages.values():
            self._release(pages)
        self.prompt_pages.clear()

    def release_prompts(self) -> None:
        """Drop the prompt holders' references once every sample of the prompt has been admitted (call after the
        admitted samples copied their partial page)."""
        for p in [p for p in self.prompt_pages if self.unadmitted[p] == 0]:
            self._release(self.prompt_pages.pop(p))

    @property
    def done(self) -> bool:
        return not self.waiting and not self.paused and all(s is None for s in self.rows)

    def check(self) -> None:
        """Assert the invariants of the module docstring."""
        refs = [0] * self.num_pages
        holders = [s.pages for s in self.rows if s is not None] + list(self.prompt_pages.values())
        holders += [s.pages for s in self.paused.values()]
        for pages in holders:
            for pg in pages:
                refs[pg] += 1
        assert refs == self.refs, "reference counts differ from the block tables"
        for s in self.rows:
            if s is not None:
                assert all(refs[pg] == 1 for pg in s.pages[s.shared :]), "a written page is listed twice"
                assert len(s.pages) * self.page_size >= s.cached, "a sequence's tokens outgrew its pages"
        resuming = set(map(id, self.resuming))
        assert resuming <= set(map(id, self.paused.values())), "a resuming sample is not paused"
        for s in self.paused.values():
            assert s.row < 0 and all(refs[pg] == 1 for pg in s.pages[s.shared :]), "a paused page is listed twice"
            kept = s.kv if id(s) in resuming else s.cached  # tokens whose K/V its pages hold
            assert not s.pages or len(s.pages) == self.pages_for(kept), "a paused sample holds other pages"
        assert SCRATCH_PAGE not in self.free and refs[SCRATCH_PAGE] == 0
        assert sorted(self.free) == [pg for pg in range(1, self.num_pages) if refs[pg] == 0], "free list"
