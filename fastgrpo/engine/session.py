"""A generation session: the engine's decode batch kept alive across optimizer steps (asynchronous RL on the same
GPUs, generation that never drains).

``GenerationEngine.generate`` runs one wave of prompts to the end: its batch drains, and at long, long-tailed response
lengths the last rows decode alone. A session instead keeps its sequences in flight between calls::

    session = engine.session(params, max_prompt_tokens=1024, on_group_done=score)
    session.add(prompts)             # queued behind the waiting samples; returns their keys
    groups = session.run(8)          # decode until at least 8 more groups (all n samples of a prompt) finished
    ... optimizer step on the model's own tensors ...
    session.update()                 # the next tokens are sampled with the new weights (version + 1)
    session.add(more_prompts)        # refill: the decode batch stays full
    groups = session.run(8)          # the unfinished sequences resume where they paused
    session.close()

**What a pause keeps.** :meth:`GenerationSession.run` returns at a round boundary of the engine's host loop
(``fastgrpo.engine.loop.Run.steps``: right after a harvest, where the host has read everything the device did): the
running samples keep their rows, device state and KV pages, the queued ones their places, the paused turns (multi-
turn) their handlers. With no weight change in between, the rounds go on exactly as if the session had not
paused: a session run in pieces returns bit for bit what the same session returns run at once
(tests/test_generation_session.py). Against ``generate`` of the same prompts its completions agree as two schedules
of the engine do (each sample's own random stream; log-probs within fp32 rounding: the batch buckets differ).

**Weight updates are free.** The engine reads the trainer's parameter tensors, so an in-place optimizer step is
already what the next decode step reads: :meth:`~GenerationSession.update` only records the version and drops the
CPU step's packed weight copies. The K/V already in the pages were computed with the old weights; NeMo-RL's
``recompute_kv_cache_after_weight_updates`` is :meth:`update(recompute_kv=True) <GenerationSession.update>`:
every running sample is preempted and recomputed from its tokens on the new weights at its next admission (one
prefill of prompt + tokens each), every paused one evicted (its conversation prefilled again when it resumes), every
held prompt page released. Each completion records, per token, the version that sampled it
(:attr:`Completion.versions <fastgrpo.engine.sampling.Completion.versions>`; its ``logprobs`` are the behaviour
log-probs under that version), so a trainer can bound staleness and correct by importance sampling.

**Memory.** The page pool is held for the session's life, through the optimizer steps between runs: it is sized
once (``max_total_tokens``, else 80% of the free GPU memory at the session's start, which leaves the update nothing:
set ``max_total_tokens`` to the plan's KV share) and the CPU row cache, the block tables and the output buffers for
``max_batch_size`` rows of ``max_prompt_tokens + max_new_tokens`` tokens (single-turn; multi-turn: the conversation
budget). At the DeepScaleR scale (DeepSeek-R1-Distill-Qwen-1.5B, bf16, 28 KiB of K/V per token) a 40 GiB pool
holds ~1.5M tokens, 128 sequences at 12K on average; the update's activations (the memory plan's
``python -m fastgrpo.plan``) must fit next to it, and paused sequences keep their pages meanwhile. Host state: the
samples' tokens, O(tokens of the in-flight samples).

**Checkpoints.** :meth:`~GenerationSession.state_dict` holds the sequences in flight as plain data (their tokens,
behaviour log-probs, versions, finish states, random streams' positions; not their K/V) and
:meth:`~GenerationSession.load_state_dict` puts them into a fresh session of the same parameters and seed, as
preempted samples whose K/V are recomputed at admission. Taken right after ``update(recompute_kv=True)``, the
restored session continues bit for bit as the saved one would have; otherwise its samples continue on K/V of the
current weights instead of the older ones they had (``fastgrpo.engine.snapshot``).

**FSDP2.** The engine reads the full weights, which FSDP2 gathers for a ``full_weights`` block and frees after it:
each :meth:`~GenerationSession.run` must be inside such a block (every rank's, together: the gather is a
collective), and the session made with ``moving_weights=True``, since the gathered storage may be at another address
at each run (the CUDA graphs, which read the parameters' addresses, are captured again; the page pool and every
sequence stay). Outside the runs the session reads no weight (``update``, ``state_dict``).

**Limits.** Prompt keys number the prompts in the order they were added; the random streams are keyed by them, as in
``generate``. A vision-language model's prompts carry their images (``add(prompts, images=)``,
``fastgrpo.engine.vision``: the tower once per prompt, its output kept while the group is in flight; a checkpoint
keeps the unfinished groups' images, not the tower's output); images are single-turn, as in ``generate``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager

from fastgrpo.engine.loop import Run
from fastgrpo.engine.sampling import Completion, SamplingParams, TurnHandler
from fastgrpo.engine.snapshot import capture, restore
from fastgrpo.engine.vision import CallVision, prompt_images
from fastgrpo.models.vlm import ImageInputs, is_vlm

RUN_COUNTS = ("decode_steps", "active_row_steps", "prefill_tokens", "resume_prefill_tokens", "re_prefill_tokens",
              "preemptions", "evictions")
"""The ``engine.last_stats`` counts a :meth:`GenerationSession.run` reports for itself (the peaks are the session's)."""


class GenerationSession:
    """Prompts added over time and decoded across weight updates (see the module docstring).

    Made by :meth:`fastgrpo.engine.engine.GenerationEngine.session`. ``max_prompt_tokens``: the longest prompt it
    will take (it sizes the block tables and buffers). ``on_group_done(key, completions)``: called as each group
    finishes, inside :meth:`run` (a reward pool can score it while the rest decode). ``turns``: a multi-turn handler,
    as for ``generate``. ``moving_weights``: the parameters may be at other addresses at each :meth:`run` (FSDP2
    gathers them for each run): the CUDA graphs and the CPU step's packs are made again at each run. ``version``: the
    weights' version at the start, what the first tokens record (a session that follows another on the same weights
    continues its count, so that the two sessions' completions' versions compare).
    """

    def __init__(self, engine, params: SamplingParams, *, max_prompt_tokens: int,
                 on_group_done: Callable[[int, list[Completion]], None] | None = None,
                 turns: TurnHandler | None = None, moving_weights: bool = False, version: int = 0):
        engine._check_call(params, on_group_done, turns)
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an integer >= 0, got {version!r}")
        if not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {max_prompt_tokens!r}")
        context = params.context(engine.max_positions)
        if params.response_limit(max_prompt_tokens, context) < 1:
            raise ValueError(f"max_prompt_tokens={max_prompt_tokens} leaves no room for a response within the "
                             f"sequence budget of {context} tokens")
        self.engine, self.params, self.turns = engine, params, turns
        self.moving_weights = moving_weights
        self._user_done = on_group_done
        self._finished: list[tuple[int, list[Completion]]] = []
        self._added = 0
        self._returned = 0
        self.version = self._first_version = version
        param = next(engine.model.parameters())
        self._device, self._dtype, self._param_dtype = param.device, engine._dtype or param.dtype, param.dtype
        max_context = context if turns is not None else None
        max_end = max_context or min(context, max_prompt_tokens + params.max_new_tokens)
        settings = engine._call_settings(params, self._device, self._dtype, max_context)
        with self._calling():
            cos_TD, sin_TD = engine.forward.rope_tables(max_end, self._device, self._dtype)
            # a VLM's prompts' images (fastgrpo.engine.vision): the tower once per prompt, M-RoPE in prefill
            self._vision = CallVision(engine.model, [], [], cos_TD, sin_TD) if is_vlm(engine.model) else None
            self._run = Run(engine.forward, settings, [], params, [], turns, engine.tokenizer, cos_TD, sin_TD,
                            max_end=max_end, vision=self._vision)
            self._run.open(self._group_done)
            self._run.conversations.version = self.version
        self._steps = self._run.steps()
        self._counted: dict[str, int] = {}  # the counts of RUN_COUNTS up to the last run
        self._closed = False

    @contextmanager
    def _calling(self):
        with self.engine.calling(self._device, self._dtype, self._param_dtype):
            yield

    def _group_done(self, key: int, completions: list[Completion]) -> None:
        self._finished.append((key, completions))
        if self._vision is not None:  # no sequence of it is prefilled again
            self._vision.release(key)
        if self._user_done is not None:
            self._user_done(key, completions)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"GenerationSession.{what} after close()")

    @property
    def in_flight(self) -> int:
        """Groups added and not yet returned by :meth:`run`."""
        return self._added - self._returned

    @property
    def added(self) -> int:
        """Prompts (groups) added so far: the key the next one gets."""
        return self._added

    @property
    def in_flight_tokens(self) -> int:
        """Tokens sampled (or appended, multi-turn) so far by the groups not yet returned: their finished samples'
        and the unfinished ones' (host bookkeeping only: the running rows' counts as of the last harvest)."""
        conv, sched = self._run.conversations, self._run.scheduler
        finished = sum(len(c.token_ids) for p, left in enumerate(conv.unfinished) if left for c in conv.results[p]
                       if c is not None)
        turns = sum(s.generated for s in sched.rows if s is not None) + sum(len(s.tokens) for s in sched.waiting)
        return finished + turns + sum(len(t.ids) for t in conv.trajectories.values())

    def add(self, prompt_token_ids: Sequence[Sequence[int]], images: Sequence[ImageInputs | None] | None = None
            ) -> list[int]:
        """Queue ``params.n`` samples of each prompt behind the waiting ones; returns their keys (consecutive, from
        the number of prompts added before). ``images``: each prompt's images, as for ``generate`` (default: those
        the prompts carry, ``fastgrpo.models.vlm.ImagePrompt``); single-turn only."""
        self._check_open("add")
        images = prompt_images(prompt_token_ids, images)
        prompts = self.engine._check_prompts(prompt_token_ids, self.params)
        self.engine._check_images(images, len(prompts), self.turns)
        images = list(images or [None] * len(prompts))
        if self._vision is not None:  # checked before the run takes them, added after (both or neither)
            self._vision.check(prompts, images, self._added)
        context = self.params.context(self.engine.max_positions)
        self._run.add(prompts, [self.params.response_limit(len(p), context) for p in prompts])
        if self._vision is not None:
            self._vision.add(prompts, images, self._added)
        first, self._added = self._added, self._added + len(prompts)
        return list(range(first, self._added))

    def run(self, groups: int) -> list[tuple[int, list[Completion]]]:
        """Decode until at least ``groups`` more groups have finished (or every added sample has); returns every
        group finished since the last call as ``(key, completions)``, in finishing order. The unfinished samples
        stay in flight. ``engine.last_stats`` then holds this call's counts (:data:`RUN_COUNTS`) and the session's
        peaks."""
        self._check_open("run")
        if not isinstance(groups, int) or groups < 0:
            raise ValueError(f"groups must be an integer >= 0, got {groups!r}")
        with self._calling():
            if self.moving_weights:
                self._run.runner.weights_moved()
            while len(self._finished) < groups and next(self._steps):
                pass
        out, self._finished = self._finished, []
        self._returned += len(out)
        for key, _ in out:  # the caller has them: the session forgets them (host memory stays O(in flight))
            self._run.conversations.results[key] = None
        stats = self._run.stats()
        self.engine.last_stats = {k: v - self._counted.get(k, 0) if k in RUN_COUNTS else v for k, v in stats.items()}
        self._counted = {k: stats[k] for k in RUN_COUNTS}
        return out

    def update(self, *, recompute_kv: bool = False) -> int:
        """The model's weights changed in place (an optimizer step): the next tokens are sampled with version + 1
        (returned). ``recompute_kv``: recompute every in-flight sample's K/V on the new weights (module docstring)."""
        self._check_open("update")
        self.version += 1
        with self._calling():
            self._run.new_version(self.version)
            self._run.runner.weights_changed()
            if recompute_kv:
                self._run.drop_caches()
                if self._vision is not None:
                    self._vision.forget_embeddings()
        return self.version

    def state_dict(self) -> dict:
        """The sequences in flight and the session's counters as plain data (tensors, numbers, strings; what a
        checkpoint keeps): :mod:`fastgrpo.engine.snapshot` says what it holds and what a restore recomputes (the
        K/V). Refused while a sample waits on its turn handler."""
        self._check_open("state_dict")
        stats = self._run.stats()
        pending = {k: stats[k] - self._counted.get(k, 0) for k in RUN_COUNTS}  # reported by the next run
        state = capture(self._run, {"seed": self._run.settings.seed, "version": self.version, "added": self._added,
                                    "returned": self._returned, "pending": pending})
        if self._vision is not None:  # the unfinished groups' images (their tower output is recomputed)
            state["images"] = self._vision.state(state["prompts"])
        if self._run.recorder is not None:  # an MoE model's routing record (router replay) of those groups
            state["routing"] = self._run.recorder.log.state(state["prompts"], self.params.n)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Take back a :meth:`state_dict` into this fresh session (nothing added yet; the same ``params``, seed
        included): every unfinished sample continues where it was, its K/V recomputed at its admission on the
        current weights."""
        self._check_open("load_state_dict")
        if self._added or self.version != self._first_version:
            raise RuntimeError("GenerationSession.load_state_dict needs a fresh session (nothing added, no update)")
        restore(self._run, state)
        if self._vision is not None:
            self._vision.restore(state["added"], {p: ids.tolist() for p, ids in state["prompts"].items()},
                                 state.get("images", {}))
        if self._run.recorder is not None:
            if "routing" not in state:
                raise ValueError("the session state holds no routing record (saved without record_routing)")
            self._run.recorder.log.restore(state["routing"])
        self.version = self._run.conversations.version = state["version"]
        self._added, self._returned = state["added"], state["returned"]
        self._counted = {k: -v for k, v in state["pending"].items()}  # the next run reports them

    def close(self) -> None:
        """Free the page pool and the buffers (idempotent); the unfinished samples are dropped. ``engine.last_stats``
        then holds the session's totals."""
        if self._closed:
            return
        self._closed = True
        self._steps.close()
        self._run.close()
        self.engine.last_stats = self._run.last_stats

    def __enter__(self) -> GenerationSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
