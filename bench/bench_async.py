"""Synchronous against asynchronous rollouts on a long-tailed workload: the engine's generation session
(fastgrpo.engine.session, what ``grpo.async_grpo`` runs on) against one ``generate`` per step.

Run: ``python bench/bench_async.py`` (CPU, 3 repeats: ~10 minutes on a busy 2-core host; ``--threads 1`` is
steadier there; ``--smoke``: seconds, records nothing; on CUDA the same with ``--device cuda``; ``--weight-bound``:
a wider model whose CPU decode step costs about the same at 1 and at 16 rows, as a GPU's does).

Workload: ``STEPS`` optimizer steps of ``PROMPTS`` prompts × ``N`` samples, prompts of 8 tokens, a decode batch of
``PROMPTS · N`` rows. Each prompt's response length is drawn once, log-normal with median 0.12 · cap and σ = 1.2,
capped at the cap (256 tokens): most completions are short and a few run to the cap, the long tail of reasoning RL.
Both modes see the same lengths: the model is a 2-layer Qwen2 (hidden = vocabulary = 512) built to count
(:func:`counting_model`: its next token is the last one + 1, sampled at temperature 1 with a margin that makes it
certain), and a prompt's last token is chosen so that the count reaches the stop token after exactly the drawn
length. Its layers run at full cost. The CPU products are the plain ones (``cpu_packed=False``): MKL packs are made
per row count, so a draining batch would repack at each bucket it crosses, a CPU artefact that would flatter async.

- **sync**: each step ``generate``\\ s its prompts and trains all of them: the batch drains to the step's longest
  completion.
- **async, age a**: one session; ``(a + 1) · PROMPTS`` prompts in flight or waiting; each step trains the
  ``PROMPTS`` lowest keys not trained yet (the trainer's rule, ``fastgrpo.algorithms.async_rollout.due_groups``),
  running the session (``run``) until all of them have finished while the rest keep decoding (finished groups
  beyond them wait), ``update()`` after each step (a weight version; no weight changes, the update itself is the
  same in both modes and not timed), and adds new prompts back to ``(a + 1) · PROMPTS`` groups: a group added at step
  ``t`` trains by step ``t + a``, so none goes stale and async trains sync's prompts, long tail included. A group
  whose oldest token is more than ``a`` versions old would be dropped (the trainer's safety net; counted, with the
  tokens it decoded after it could no longer train, ``late``): ``stale_groups`` is 0 in every run.

The modes run interleaved, one step of each in turn (the order rotating), ``--repeats`` times; the counts are the
same in every repeat, the wall figures are medians. Reported per mode, for the whole run (steps 1-``STEPS``) and
for the steady state (the steps after the first ``max(ages) + 2``, while the session starts full): trained tokens,
decode steps and row-steps (a row decoding one token) per trained token, the decode batch's mean occupancy, stale
groups, the tokens sampled per trained token (trained, dropped, and the change of those left in flight), the
shares of the sampled tokens in dropped groups (``stale_pct``) and sampled after their group could no longer train
(``late_pct``), the tokens left in flight before and after the window, the wall time of generation per trained
token and the ratio of sync's to the mode's (``speedup_x``, > 1: async is faster; ``speedup_runs``: each repeat's).
The whole run's wall time per trained token charges async for the groups still in flight at the end (a 16-step run
ends with up to ``a · PROMPTS`` of them, decoded, never trained); the steady figure is the window's wall time per
sampled token × the tokens that ended in it (trained or dropped) per trained token, which leaves that boundary out
(:func:`cost_per_trained_token`). Also printed, from the same run: how a decode step's time grows from 1 row to the
workload's rows (near 1x, reading the weights dominates a step, as on a GPU; near the rows' count, the rows do) and
the load average. Rows go to ``bench/results/async.csv``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time

import torch
from common import append_rows, print_table

from fastgrpo.algorithms.async_rollout import due_groups, oldest_version
from fastgrpo.engine.engine import GenerationEngine, SamplingParams

CAP = 256
PROMPT_TOKENS = 8
STOP = 0  # the counting model's completions end at this token
STEPS, PROMPTS, N = 16, 16, 4


def counting_model(vocab: int, positions: int, device: str, hidden: int | None = None, layers: int = 2,
                   intermediate: int | None = None) -> torch.nn.Module:
    """A Qwen2 (``layers`` layers, ``hidden`` ≥ ``vocab`` wide, default ``vocab``; MLP ``intermediate``, default
    2 · hidden) whose next token is always the last one + 1 (mod ``vocab``), with a logit margin of
    ``3 · sqrt(hidden)`` (≥ 68 from hidden = 512) over every other token, so that sampling at temperature 1 follows
    it (the other tokens together have probability ~``vocab · e^-68``). The layers run at full cost but write nothing
    to the residual (o_proj and down_proj are 0): the embedding is the one-hot of the token (in the first ``vocab``
    features), the head maps one-hot ``i`` to ``i + 1``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden = hidden or vocab
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=positions, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    one_hot_VH = torch.eye(vocab, hidden)  # [V, H]
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(one_hot_VH)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.copy_(3.0 * torch.roll(one_hot_VH, 1, dims=0))  # row i + 1 reads feature i
    return model.to(device).eval()


def decode_step_ms(engine, rows: int, vocab: int) -> float:
    """The engine's mean decode step (ms) with ``rows`` rows running: ``rows`` samples of one prompt, 32 tokens."""
    params = SamplingParams(n=rows, temperature=1.0, max_new_tokens=32, seed=0)
    prompt = [prompt_for(32, vocab, random.Random(0))]
    engine.generate(prompt, params)
    start = time.perf_counter()
    engine.generate(prompt, params)
    return 1e3 * (time.perf_counter() - start) / engine.last_stats["decode_steps"]


def draw_lengths(count: int, cap: int, seed: int) -> list[int]:
    """Response lengths, log-normal (median 0.12 · cap, σ = 1.2), capped at ``cap``, at least 1."""
    rng = random.Random(seed)
    return [max(1, min(cap, round(0.12 * cap * math.exp(rng.gauss(0.0, 1.2))))) for _ in range(count)]


def prompt_for(length: int, vocab: int, rng: random.Random) -> list[int]:
    """A prompt of ``PROMPT_TOKENS`` tokens after which the counting model's completion is ``length`` tokens: its
    last token is ``vocab - length``, so the completion counts up to the stop token 0."""
    return [rng.randrange(1, vocab // 2) for _ in range(PROMPT_TOKENS - 1)] + [vocab - length]


def group_tokens(group) -> int:
    return sum(len(c.token_ids) for c in group)


def sync_steps(engine, params, prompts: list[list[int]], steps: int, per_step: int):
    """``steps`` steps of one ``generate`` each, yielding each step's figures as it ends: its wall time, decode
    steps, row-steps and trained tokens (every sampled token is trained)."""
    for s in range(steps):
        start = time.perf_counter()
        out = engine.generate(prompts[s * per_step : (s + 1) * per_step], params)
        trained = sum(map(group_tokens, out))
        yield dict(wall_s=time.perf_counter() - start, decode_steps=engine.last_stats["decode_steps"],
                   row_steps=engine.last_stats["active_row_steps"], trained_tokens=trained, stale_groups=0,
                   stale_tokens=0, late_tokens=0, left_tokens=0, buffer=0)


def async_steps(engine, params, prompts: list[list[int]], steps: int, per_step: int, age: int, end: dict):
    """``steps`` steps of one generation session at staleness bound ``age`` (module docstring), yielding each step's
    figures as it ends: sync's, the groups dropped as stale and their tokens (``stale_tokens``), of which those
    sampled after the group could no longer train (``late_tokens``: at a version past its oldest token's +
    ``age``), the tokens left at the step's end (``left_tokens``: sampled by the groups in flight or finished and
    waiting) and those groups' count after the step's new prompts (``buffer``: ``(age + 1) · per_step``). The
    first step's time includes opening the session and its first prompts; the time between yields (another mode's
    step) is not counted. At the end, ``end`` gets the trained and dropped groups' keys (their prompts' indices),
    the prompts added and the finished groups left waiting."""
    longest = max(map(len, prompts))
    ready: dict = {}  # key -> group: finished, not trained yet
    live: set[int] = set()  # keys added, not trained or dropped
    keys: list[int] = []
    dropped: list[int] = []
    start = time.perf_counter()
    with engine.session(params, max_prompt_tokens=longest) as session:
        live.update(session.add(prompts[: (age + 1) * per_step]))
        added = (age + 1) * per_step
        for _ in range(steps):
            step = dict(decode_steps=0, row_steps=0, stale_groups=0, stale_tokens=0, late_tokens=0)
            while True:
                for key, group in list(ready.items()):  # the trainer's safety net (none in order)
                    first = oldest_version(group)
                    if session.version - first > age:
                        del ready[key]
                        live.remove(key)
                        dropped.append(key)
                        step["stale_groups"] += 1
                        step["stale_tokens"] += group_tokens(group)
                        step["late_tokens"] += sum(v > first + age for c in group for v in c.versions)
                due, missing = due_groups(live, ready, per_step)  # the trainer's rule
                if len(due) < per_step:
                    raise RuntimeError("fewer groups in flight than a step trains")
                if not missing:
                    break
                ready.update(session.run(missing))
                step["decode_steps"] += engine.last_stats["decode_steps"]
                step["row_steps"] += engine.last_stats["active_row_steps"]
            step["trained_tokens"] = sum(group_tokens(ready.pop(key)) for key in due)
            keys += due
            live -= set(due)
            session.update()
            top_up = (age + 1) * per_step - len(live)  # a step's prompts + those dropped
            if added + top_up > len(prompts):
                raise RuntimeError("the workload ran out of prompts: raise its size")
            live.update(session.add(prompts[added : added + top_up]))
            added += top_up
            step["buffer"] = session.in_flight + len(ready)  # counted by the session, not by the rule's own set
            step["left_tokens"] = session.in_flight_tokens + sum(map(group_tokens, ready.values()))
            step["wall_s"] = time.perf_counter() - start
            yield step
            start = time.perf_counter()
    end.update(trained_keys=keys, dropped_keys=dropped, added=added, waiting=len(ready))


def run_sync(engine, params, prompts: list[list[int]], steps: int, per_step: int) -> dict:
    """:func:`sync_steps` run alone: the whole run's :func:`window` and its steps (``log``)."""
    log = list(sync_steps(engine, params, prompts, steps, per_step))
    return dict(window(log, 0), log=log)


def run_async(engine, params, prompts: list[list[int]], steps: int, per_step: int, age: int) -> dict:
    """:func:`async_steps` run alone: the whole run's :func:`window`, its steps (``log``) and what it ended with."""
    end: dict = {}
    log = list(async_steps(engine, params, prompts, steps, per_step, age, end))
    return dict(window(log, 0), log=log, **end)


def interleaved(runs: dict) -> dict[str, list[dict]]:
    """Each mode's steps (``runs``: name -> a generator of them) run in turn, one step of each mode at a time, in an
    order that rotates at each step, so that a change in the machine's load reaches every mode alike. Returns each
    mode's steps."""
    logs: dict[str, list[dict]] = {name: [] for name in runs}
    names = list(runs)
    while names:
        for name in list(names):
            step = next(runs[name], None)
            if step is None:
                names.remove(name)
            else:
                logs[name].append(step)
        names = names[1:] + names[:1]
    return logs


def window(log: list[dict], first: int) -> dict:
    """Steps ``first`` on of a run's ``log`` summed, with ``sampled_tokens``: the tokens decoded in them (those
    trained or dropped, and the change in those left in flight; a run starts with none left)."""
    sums = {k: sum(step[k] for step in log[first:]) for k in log[0] if k not in ("left_tokens", "buffer")}
    left_before = log[first - 1]["left_tokens"] if first else 0
    sums["sampled_tokens"] = (sums["trained_tokens"] + sums["stale_tokens"] + log[-1]["left_tokens"] - left_before)
    return dict(sums, left_before=left_before, left_after=log[-1]["left_tokens"])


def cost_per_trained_token(w: dict, steady: bool) -> float:
    """Wall seconds per trained token of a :func:`window`. Whole run: its wall time over its trained tokens.
    ``steady``: the wall time per token the window sampled × the tokens that ended in it (trained or dropped) per
    trained token: what a run many steps long pays, without the window's change in the tokens left in flight (a run
    that ends with more in flight than it started with did work that its next steps train)."""
    if not steady:
        return w["wall_s"] / w["trained_tokens"]
    return w["wall_s"] / w["sampled_tokens"] * (w["trained_tokens"] + w["stale_tokens"]) / w["trained_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="toy sizes, nothing recorded")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ages", default="1,2")
    ap.add_argument("--repeats", type=int, default=3, help="runs of every mode, interleaved; wall figures: medians")
    ap.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's; 1 is steadier on a busy host)")
    ap.add_argument("--weight-bound", action="store_true",
                    help="a model whose decode step is dominated by reading its weights at these rows (hidden 1024, "
                         "8 layers, MLP 4096: 0.5 GB fp32), 12 steps x 4 prompts x 4 samples, cap 64")
    args = ap.parse_args()
    steps, per_step, cap = (5, 4, 32) if args.smoke else (12, 4, 64) if args.weight_bound else (STEPS, PROMPTS, CAP)
    repeats = 1 if args.smoke else args.repeats
    if args.threads:
        torch.set_num_threads(args.threads)
    vocab = 2 * cap
    shape = dict(hidden=1024, layers=8, intermediate=4096) if args.weight_bound else {}
    model = counting_model(vocab, PROMPT_TOKENS + cap + 1, args.device, **shape)
    ages = [int(a) for a in args.ages.split(",")]
    warmup = max(ages) + 2  # steps left out of the steady-state window
    count = (2 * steps + max(ages) + 1) * per_step  # every prompt any mode may add (async: a step's + the dropped)
    rng = random.Random(1)
    lengths = draw_lengths(count, cap, seed=0)
    prompts = [prompt_for(r, vocab, rng) for r in lengths]
    params = SamplingParams(n=N, temperature=1.0, max_new_tokens=cap, seed=3)
    engine = GenerationEngine(model, eos_token_ids=STOP, max_batch_size=per_step * N, cpu_packed=False,
                              max_total_tokens=4 * per_step * N * (PROMPT_TOKENS + cap))
    run_sync(engine, params, prompts, 1, per_step)  # warm-up (first-call costs: allocations, the first products)
    run_async(engine, params, prompts, 1, per_step, 1)
    rows = per_step * N
    load = os.getloadavg()[0]
    times = [{r: decode_step_ms(engine, r, vocab) for r in (1, rows // 4, rows)} for _ in range(1 if args.smoke else 3)]
    steps_ms = {r: statistics.median(t[r] for t in times) for r in times[0]}  # a step's cost against its rows
    print(f"load average {load:.1f} on {os.cpu_count()} cores; decode step: " + ", ".join(
        f"{ms:.1f} ms at {r} rows ({ms / steps_ms[1]:.2f}x)" for r, ms in steps_ms.items())
        + f" (1.00x: the weights' read dominates, {rows}x: the rows do)")
    modes = ["sync", *(f"async age {a}" for a in ages)]
    runs: dict[str, list[list[dict]]] = {m: [] for m in modes}
    for _ in range(repeats):
        gens = {"sync": sync_steps(engine, params, prompts, steps, per_step)}
        ends = {a: {} for a in ages}  # each async run's trained and dropped groups (the same in every repeat)
        gens.update({f"async age {a}": async_steps(engine, params, prompts, steps, per_step, a, ends[a]) for a in ages})
        for mode, log in interleaved(gens).items():
            runs[mode].append(log)
    for mode, logs in runs.items():  # the same prompts, seeds and schedule: only the times may differ
        if any([{**st, "wall_s": 0} for st in log] != [{**st, "wall_s": 0} for st in logs[0]] for log in logs):
            raise RuntimeError(f"{mode}: the counts differ between repeats")
    table = []
    for first, name in ((0, f"1-{steps}"), (warmup, f"{warmup + 1}-{steps}")):
        base = [window(log, first) for log in runs["sync"]]
        for mode in modes:
            figures = [window(log, first) for log in runs[mode]]
            w = figures[0]  # the counts are the same in every repeat (the same prompts, seeds and schedule)
            per_token = [cost_per_trained_token(f, steady=first > 0) for f in figures]
            ratios = [cost_per_trained_token(b, steady=first > 0) / t for b, t in zip(base, per_token)]
            table.append(dict(mode=mode, steps=name, shape=f"{steps} steps x {per_step} x {N}, cap {cap}" + (
                                  ", weight-bound" if args.weight_bound else ""),
                              step_ms_rows_over_1=steps_ms[rows] / steps_ms[1], load=load,
                              trained_tokens=w["trained_tokens"],
                              mean_length=w["trained_tokens"] / ((steps - first) * per_step * N),
                              decode_steps_per_trained_token=w["decode_steps"] / w["trained_tokens"],
                              row_steps_per_trained_token=w["row_steps"] / w["trained_tokens"],
                              occupancy=w["row_steps"] / max(w["decode_steps"], 1), stale_groups=w["stale_groups"],
                              sampled_over_trained=w["sampled_tokens"] / w["trained_tokens"],
                              stale_pct=100 * w["stale_tokens"] / w["sampled_tokens"],
                              late_pct=100 * w["late_tokens"] / w["sampled_tokens"],
                              left_before=w["left_before"], left_after=w["left_after"],
                              us_per_trained_token=1e6 * statistics.median(per_token),
                              speedup_x=statistics.median(ratios),
                              speedup_runs="/".join(f"{x:.2f}" for x in ratios)))
    for age, end in ends.items():  # in order: the trained groups are sync's, the long tail included
        trained, dropped = (sorted(lengths[k] for k in end[key]) for key in ("trained_keys", "dropped_keys"))
        print(f"async age {age}: trained groups' lengths {trained[0]}-{trained[-1]} (median "
              f"{statistics.median(trained)}), dropped groups' " + (
                  f"{dropped[0]}-{dropped[-1]} (median {statistics.median(dropped)})" if dropped else "none"))
    print_table(table, f"async vs sync rollouts on a long-tailed workload ({args.device}, "
                       f"{torch.get_num_threads()} threads, {repeats} runs of each, load average "
                       f"{load:.1f} -> {os.getloadavg()[0]:.1f})")
    if not args.smoke:
        print(f"rows appended to {append_rows('async', table, args.device)}")


if __name__ == "__main__":
    main()
