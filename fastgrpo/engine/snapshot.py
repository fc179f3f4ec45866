"""A generation session's sequences in flight as plain data (``GenerationSession.state_dict`` /
``load_state_dict``): what a checkpoint keeps of them, and how a fresh session takes them back.

**What it holds.** For every group not yet returned by ``run``: its prompt ids and response limit, and each of its
samples, finished (its :class:`Completion`) or not. An unfinished sample is its trajectory (``turns.Trajectory``:
every token after the prompt with its log-prob, loss-mask bit and weight version, the tokens the policy sampled,
its turns, its stop strings and the part of its turn already checked for them) plus the tokens and log-probs of the
turn it is in. A sample's random stream is ``h(seed, sample id, t)`` (``fastgrpo.engine.sampling``), so the call's
seed, its id (``prompt key · n + j``) and ``t`` (the tokens it sampled) are the whole of it. Also: the queue's order
(running samples in admission order, then the waiting ones), the session's version and key counters, its peaks and
the counts it has not reported yet.

**What it does not hold: the K/V pages.** A restored sample is a preempted one: its prompt and tokens are prefilled
again at its admission, on the weights of that moment. With ``update(recompute_kv=True)`` before the snapshot (the
session has just recomputed every K/V anyway: running samples preempted, paused ones evicted, prompt pages released)
the restored session is the very state the saved one was in, and it continues bit for bit. Without it, the saved
session's running samples held K/V the older weights wrote; the restored ones read K/V of the current weights, so
their next tokens are drawn from a (slightly) different distribution: the same versions and behaviour log-probs
(exact for what was sampled), another continuation. Keeping the pages instead would cost the pool's bytes per
checkpoint and rank (DeepScaleR 1.5B in bf16: 28 KiB a token, up to the pool, e.g. 40 GiB per GPU, 320 GiB for 8).

**Size.** 4 + 4 bytes a token of tokens and log-probs (int32 / fp32 tensors), 1 of mask, 4 of versions per
update, for every in-flight and finished-but-unreturned sample: at the DeepScaleR scale, 256 samples per rank at
12K tokens on average, ~40 MB per rank.

A sample waiting on its turn handler (multi-turn, not answered yet) cannot be saved: the handler's work is not the
session's. :func:`capture` refuses then.
"""

from __future__ import annotations

import torch

from fastgrpo.engine.sampling import Completion
from fastgrpo.engine.scheduler import Seq
from fastgrpo.engine.state import read_tokens
from fastgrpo.engine.turns import Trajectory

FORMAT = 1


def ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def floats(values: list[float]) -> torch.Tensor:
    """fp32: the engine's log-probs are fp32 values, so the round trip is exact."""
    return torch.tensor(values, dtype=torch.float32)


def completion_state(c: Completion) -> dict:
    """A :class:`Completion` as plain data (tensors, numbers, strings)."""
    return {"token_ids": ints(c.token_ids), "logprobs": floats(c.logprobs), "finish_reason": c.finish_reason,
            "loss_mask": ints(c.loss_mask), "num_turns": c.num_turns,
            "versions": None if c.versions is None else ints(c.versions)}


def completion_from_state(d: dict) -> Completion:
    return Completion(d["token_ids"].tolist(), d["logprobs"].tolist(), d["finish_reason"], d["loss_mask"].tolist(),
                      d["num_turns"], None if d["versions"] is None else d["versions"].tolist())


def trajectory_state(t: Trajectory) -> dict:
    return {"ids": ints(t.ids), "logprobs": floats(t.logprobs), "mask": ints(t.mask), "sampled": t.sampled,
            "turns": t.turns, "seen": ints(t.seen), "versions": ints([x for sv in t.versions for x in sv]),
            "stop_strings": list(t.stop_strings)}


def trajectory_from_state(d: dict) -> Trajectory:
    flat = d["versions"].tolist()
    return Trajectory(tuple(d["stop_strings"]), d["ids"].tolist(), d["logprobs"].tolist(), d["mask"].tolist(),
                      d["sampled"], d["turns"], d["seen"].tolist(), list(zip(flat[::2], flat[1::2])))


def seq_state(seq: Seq, traj: Trajectory) -> dict:
    return {"sample": seq.sample, "limit": seq.limit, "context": seq.context, "tokens": ints(seq.tokens),
            "logprobs": floats(seq.logprobs), "trajectory": trajectory_state(traj)}


def capture(run, counters: dict) -> dict:
    """The state of a session's ``run`` (``fastgrpo.engine.loop.Run``) at a pause of its rounds; ``counters``: the
    session's own (``version``, ``added``, ``returned``, ``seed``, ``pending``: counts not reported yet)."""
    sched, conv, n = run.scheduler, run.conversations, run.params.n
    if conv.awaiting:
        raise RuntimeError(f"{len(conv.awaiting)} samples wait on their turn handler: the handler's work is not "
                           "part of the session's state (save when none waits)")
    running = sorted((s for s in sched.rows if s is not None), key=lambda s: s.admitted)
    if running:  # their tokens are on the device (the K/V stay there too: not saved)
        read_tokens(run.state, running)
    keys = [p for p, left in enumerate(conv.unfinished) if left]
    return {
        "format": FORMAT, **counters, "n": n,
        "prompts": {p: ints(run.prompts[p]) for p in keys},
        "limits": {p: run.limits[p] for p in keys},
        "finished": {p: {j: completion_state(c) for j, c in enumerate(conv.results[p]) if c is not None} for p in keys},
        "queue": [seq_state(s, conv.trajectories[s.sample]) for s in [*running, *sched.waiting]],
        "resuming": [seq_state(s, conv.trajectories[s.sample]) for s in sched.resuming],
        "peaks": {"running": sched.peak_running, "pages": sched.peak_pages, "paused": sched.peak_paused},
    }


def restore(run, state: dict) -> None:
    """Put the saved sequences into a fresh session's ``run`` (nothing added yet): every unfinished sample queued as
    a preempted one (its K/V recomputed at admission), the resuming ones evicted, the finished ones recorded."""
    if state.get("format") != FORMAT:
        raise ValueError(f"session state format {state.get('format')!r}, expected {FORMAT}")
    sched, conv, n = run.scheduler, run.conversations, run.params.n
    if state["n"] != n or state["seed"] != run.settings.seed:
        raise ValueError(f"the session state was saved with n={state['n']} and seed {state['seed']}; this session "
                         f"has n={n} and seed {run.settings.seed}")
    added = state["added"]
    prompts = {p: ids.tolist() for p, ids in state["prompts"].items()}
    run.prompts[:] = [prompts.get(p, []) for p in range(added)]  # a returned group's prompt is never read again
    run.limits[:] = [state["limits"].get(p, 0) for p in range(added)]
    sched.prompt_lens[:] = [len(p) for p in run.prompts]
    sched.unadmitted[:] = [0] * added
    conv.results[:] = [[None] * n if p in prompts else None for p in range(added)]
    conv.unfinished[:] = [n if p in prompts else 0 for p in range(added)]
    for p, done in state["finished"].items():
        for j, c in done.items():
            conv.results[p][j] = completion_from_state(c)
            conv.unfinished[p] -= 1

    def seq(d: dict) -> Seq:
        s = Seq(d["sample"] // n, d["sample"], len(prompts[d["sample"] // n]), d["limit"], d["tokens"].tolist(),
                d["logprobs"].tolist(), context=d["context"])
        s.generated = len(s.tokens)
        traj = conv.trajectories[s.sample] = trajectory_from_state(d["trajectory"])
        conv.watch_stops = conv.watch_stops or bool(traj.stop_strings)
        return s

    for d in state["queue"]:
        s = seq(d)
        sched.waiting.append(s)
        sched.unadmitted[s.prompt] += int(not s.generated)
    for d in state["resuming"]:  # answered by the handler: its whole conversation is prefilled at admission
        sched.add_resuming(seq(d))
    sched.peak_running, sched.peak_pages, sched.peak_paused = (state["peaks"][k] for k in ("running", "pages",
                                                                                         "paused"))
