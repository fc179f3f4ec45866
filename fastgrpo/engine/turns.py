"""The host side of multi-turn rollouts and stop strings (``Conversations``, a collaborator of the call's host loop,
``fastgrpo.engine.loop.Run``): what happens when a sample reaches the end of a turn, the turn handler's answers, and
the stop-string match on the decoded tail of a turn. The device step knows nothing of turns: a paused sample simply
has no row, and a resumed one is admitted like a new sample whose context is already (mostly) in its pages
(``fastgrpo.engine.scheduler``).

A trajectory, in order: prompt, turn 1 (sampled), observation 1 (appended), turn 2, ... Its host state besides the
scheduler's is a ``Trajectory``: every token after the prompt with its log-prob and loss-mask bit, how many tokens the
policy sampled (the offset of its random stream's index, so a turn's draws do not depend on what was appended), the
turns it sampled and its stop strings.

**Turn boundaries.** A turn ends at an eos/stop token (included), at the token that completes the first stop-string
match in its decoded text (included; tokens the device sampled past it before the host saw the match, at most
``sync_every - 1``, are trimmed and the pages that held only them are freed), or at its token limit. Without a
turn handler a boundary ends the completion ("stop", today's single-turn behaviour); with one the sample pauses
(pages kept) and ``turns.start(key, turn_ids, turn_text)`` is called. A limit ends the trajectory ("length") and the
handler is not called.

**Stop strings** are matched on the host, on what the device sampled since the last read: every ``sync_every``
steps the newest ``sync_every`` tokens of each running row come back with the stop flags (one transfer, only while
some running sample has stop strings). ``first_stop`` finds the first token whose decoded tail (the
``W = longest stop string + 1`` tokens that end at it) contains a stop string: the same token as the first match in
the decoded text of the whole turn whenever every token decodes to at least one character and the decoding of a
token sequence is the concatenation of its tokens' (byte-level BPE, character-level tokenizers; a SentencePiece
leading space is one character of the first token of a window, outside the ``W - 1`` that matter). One decode of a
short window per running sample per read (measured by bench/bench_multiturn.py); a sample whose window does not
contain any stop string costs nothing more. If the stop string ends inside a token, the turn ends with that
token (its text may run past the match).

**Answers.** ``turns.ready(block=False)`` is polled every ``sync_every`` steps while samples wait on it, and
``ready(block=True)`` only when nothing decodes and nothing can be admitted. An answer with ``finish`` ends the
trajectory with that reason; one with ``append_ids`` on the ``max_turns``-th turn ends it with "max_turns"
(nothing appended); ``append_ids`` that leave no room for one more sampled token within the conversation budget
(``max_sequence_tokens``, or the model's context) end it with "length" (nothing appended); otherwise the tokens are
appended (log-prob 0, mask 0) and the sample is queued to resume with a turn limit of
``min(max_new_tokens, budget - conversation length)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fastgrpo.engine.sampling import HANDLER_FINISH_REASONS, Completion, SamplingParams, TurnHandler, TurnResult
from fastgrpo.engine.scheduler import Scheduler, Seq


@dataclass(eq=False)
class Trajectory:
    """One trajectory's tokens after the prompt and its turn state (host)."""

    stop_strings: tuple[str, ...]
    ids: list[int] = field(default_factory=list)
    """Finished turns and appended observations, in order."""
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    sampled: int = 0
    """Tokens the policy sampled in finished turns: the index of its random stream's next draw is this + the
    current turn's count."""
    turns: int = 0
    """Finished (sampled) turns."""
    seen: list[int] = field(default_factory=list)
    """The current turn's tokens checked for stop strings so far."""
    versions: list[tuple[int, int]] = field(default_factory=list)
    """A generation session's weight versions: ``(s, v)``, the policy's version became ``v`` when the trajectory
    had sampled ``s`` tokens (empty outside a session)."""

    def token_versions(self) -> list[int]:
        """The version of the weights each of ``ids`` was sampled with (an appended token: the version its K/V were
        computed with when its trajectory resumed, the next sampled token's)."""
        out, sampled, v, k = [], 0, self.versions[0][1], 0
        for bit in self.mask:
            while k < len(self.versions) and self.versions[k][0] <= sampled:
                v = self.versions[k][1]
                k += 1
            out.append(v)
            sampled += bit
        return out


def first_stop(decode, turn_ids: list[int], checked: int, stop_strings: tuple[str, ...]) -> int | None:
    """Index of the first token of ``turn_ids[checked:]`` that completes a stop string in the decoded text (see the
    module docstring), or None."""
    w = max(map(len, stop_strings)) + 1  # tokens whose text a match completing at the last one can span
    text = decode(turn_ids[max(0, checked + 1 - w) :])
    if not any(s in text for s in stop_strings):
        return None
    for i in range(checked, len(turn_ids)):
        tail = decode(turn_ids[max(0, i + 1 - w) : i + 1])
        if any(s in tail for s in stop_strings):
            return i
    return None


class Conversations:
    """Every trajectory of one call on the host: its tokens (``trajectories``, by sample id), the samples paused on
    the turn handler (``awaiting``, by ``(prompt, sample index)``), and the results (``results[prompt][index]``),
    each group handed to ``on_group_done`` as soon as it is complete.

    ``handler``: the call's turn handler, None for single-turn. ``max_context``: a conversation's token budget
    (multi-turn). ``vocab_size``: the bound on appended ids. ``tokenizer``: decodes turns (stop strings, the
    handler's ``turn_text``)."""

    def __init__(self, prompts: list[list[int]], params: SamplingParams, scheduler: Scheduler,
                 handler: TurnHandler | None, tokenizer, vocab_size: int, max_context: int | None,
                 on_group_done: Callable | None):
        P, n = len(prompts), params.n
        self.params = params
        self.scheduler = scheduler
        self.handler = handler
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.on_group_done = on_group_done
        self.results: list[list[Completion | None]] = [[None] * n for _ in range(P)]
        self.unfinished = [n] * P  # samples of each prompt not finished yet
        self.trajectories = {p * n + j: Trajectory(params.stop_strings) for p in range(P) for j in range(n)}
        self.awaiting: dict = {}  # (prompt, sample index) -> paused sample waiting on its turn handler
        self.watch_stops = bool(params.stop_strings)  # some sample may have stop strings
        self.re_prefill_tokens = 0  # what re-prefilling every resumed conversation in full would have cost
        self.version: int | None = None  # a generation session's weight version (None: not tracked)

    def add(self, count: int) -> None:
        """A session's ``count`` new prompts (numbered after the known ones), at the current version."""
        n, first = self.params.n, len(self.results)
        self.results += [[None] * n for _ in range(count)]
        self.unfinished += [n] * count
        for p in range(first, first + count):
            for j in range(n):
                self.trajectories[p * n + j] = t = Trajectory(self.params.stop_strings)
                t.versions.append((0, self.version))

    def new_version(self, version: int, turn_tokens: dict[int, int]) -> None:
        """The weights became ``version``: every unfinished trajectory's next token is sampled with it
        (``turn_tokens``: sample id -> tokens its current turn has sampled so far, for those mid-turn)."""
        self.version = version
        for sample, t in self.trajectories.items():
            t.versions.append((t.sampled + turn_tokens.get(sample, 0), version))

    def context(self, prompts: list[list[int]], seq: Seq) -> list[int]:
        """The ids before ``seq``'s current turn: prompt, earlier turns, observations."""
        return prompts[seq.prompt] + self.trajectories[seq.sample].ids

    def stop_matches(self, window: list[list[int]]) -> dict:
        """Read the rows' newest tokens (``window[row]``: the last ``sync_every`` ids up to its count) into their
        trajectories; returns ``{seq: tokens it keeps}`` for the rows whose turn completed a stop string."""
        decode = self.tokenizer.decode
        cut = {}
        for row, seq in enumerate(self.scheduler.rows):
            traj = self.trajectories[seq.sample]
            if not traj.stop_strings:
                continue
            new = seq.generated - len(traj.seen)  # at most sync_every tokens since the last read
            if new <= 0:
                continue
            if new > len(window[row]):
                raise RuntimeError(f"sample {seq.sample}: {new} tokens since the last stop-string check, at most "
                                   f"{len(window[row])} expected")
            checked = len(traj.seen)
            traj.seen += window[row][len(window[row]) - new :]
            i = first_stop(decode, traj.seen, checked, traj.stop_strings)
            if i is not None:
                cut[seq] = i + 1
                del traj.seen[i + 1 :]
        return cut

    def end_turn(self, seq: Seq, boundary: bool) -> bool:
        """``seq`` (harvested, its turn's tokens read and trimmed) ended its turn: finish it, or pause it and start
        its handler. Returns whether it paused (its row cache is then stale when it comes back: appended tokens)."""
        traj = self.trajectories[seq.sample]
        turn_ids = seq.tokens
        traj.ids += turn_ids
        traj.logprobs += seq.logprobs
        traj.mask += [1] * len(turn_ids)
        traj.sampled += len(turn_ids)
        traj.turns += 1
        traj.seen = []
        seq.tokens, seq.logprobs = [], []
        if not boundary:
            self.finish(seq, "length")
            return False
        if self.handler is None:
            self.finish(seq, "stop")
            return False
        self.scheduler.pause(seq)
        key = (seq.prompt, seq.sample % self.params.n)
        self.awaiting[key] = seq
        self.handler.start(key, list(turn_ids), self.tokenizer.decode(turn_ids))
        return True

    def finish(self, seq: Seq, reason: str) -> None:
        """The trajectory of ``seq`` ends with ``reason``: its ``Completion`` is recorded, its pages freed."""
        traj = self.trajectories.pop(seq.sample)
        p, n = seq.prompt, self.params.n
        self.results[p][seq.sample % n] = Completion(traj.ids, traj.logprobs, reason, traj.mask, traj.turns,
                                                     traj.token_versions() if traj.versions else None)
        self.scheduler.finish(seq)
        self.unfinished[p] -= 1
        if self.unfinished[p] == 0 and self.on_group_done is not None:
            self.on_group_done(p, self.results[p])

    def poll(self) -> None:
        """Take the handler's answers: blocking only when nothing decodes and nothing waits for admission."""
        sched = self.scheduler
        idle = not sched.rows and not sched.waiting and not sched.resuming
        got = self.handler.ready(block=idle)
        if idle and not got:
            raise RuntimeError(f"turns.ready(block=True) returned no result while {len(self.awaiting)} samples wait")
        for key, result in got:
            self.take_result(key, result)

    def take_result(self, key, result: TurnResult) -> None:
        """Apply the handler's answer for ``key``: finish the trajectory, or append the tokens and queue the sample
        to resume (see the module docstring)."""
        seq = self.awaiting.pop(tuple(key), None)
        if seq is None:
            raise ValueError(f"turns.ready returned a result for {key!r}, which is not waiting for one")
        if not isinstance(result, TurnResult):
            raise ValueError(f"turns.ready must return TurnResult answers, got {type(result).__name__} for {key}")
        traj = self.trajectories[seq.sample]
        if result.finish is not None:
            if result.finish not in HANDLER_FINISH_REASONS:
                raise ValueError(f"TurnResult.finish for {key} must be one of {HANDLER_FINISH_REASONS} or None, "
                                 f"got {result.finish!r}")
            self.finish(seq, result.finish)
            return
        if traj.turns >= self.params.max_turns:
            self.finish(seq, "max_turns")
            return
        ids = list(result.append_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"TurnResult.append_ids for {key} must be token ids in [0, {self.vocab_size})")
        total = seq.prompt_len + len(traj.ids) + len(ids)
        if total + 1 > self.max_context:  # no room for one more sampled token
            self.finish(seq, "length")
            return
        if result.stop_strings is not None:
            strings = tuple(result.stop_strings)
            if not all(isinstance(s, str) and s for s in strings):
                raise ValueError(f"TurnResult.stop_strings for {key} must be non-empty strings, got {strings!r}")
            traj.stop_strings = strings
            self.watch_stops = self.watch_stops or bool(strings)
        traj.ids += ids
        traj.logprobs += [0.0] * len(ids)
        traj.mask += [0] * len(ids)
        self.re_prefill_tokens += total  # what prefilling the whole conversation again would cost
        self.scheduler.resume(seq, len(ids), self.params.response_limit(total, self.max_context))
