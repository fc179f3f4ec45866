"""The paged scheduler against the static cache on a DeepScaleR-shaped rollout, with no model (issue 10).

Run: ``python bench/bench_scheduler.py`` (a few seconds; CPU only, nothing is allocated).

Workload: one GRPO step of 128 prompts × 8 samples over 8 ranks, so 16 prompts × 8 = 128 samples per rank; prompts
of 100-200 tokens (uniform); response lengths log-normal with median 0.3 · cap and σ = 0.8, capped at the stage's
cap (8K, 16K, 24K): most completions end far below the cap, about 7% reach it. DeepSeek-R1-Distill-Qwen-1.5B in bf16
(28 KiB of K/V per token). KV budget: 80% of what training leaves free, taken as the GPU's memory minus 30 GiB
(bf16 weights, fp32 master weights and Adam state, gradients, workspace): 40 GiB on an 80 GiB GPU, 88.8 GiB on a
141 GiB one. The decode loop syncs every 8 steps (the CUDA setting); a step advances every running sample by one
token.

- paged: the engine's real :class:`fastgrpo.engine.scheduler.Scheduler` (64-token pages, 256 rows), driven with the
drawn
  lengths: decode steps, peak running sequences, preemptions, prefill tokens (prompts once, plus recomputes).
- static: the previous engine's plan from the same budget: each sample reserves ``longest prompt + cap`` tokens,
  prompts go in sequential waves whose prompt store plus slots fit, slots are refilled within a wave; a wave lasts
  until its last sample ends. Peak running = slots.
"""

from __future__ import annotations

import math
import random

from common import append_rows, print_table

from fastgrpo.engine.scheduler import Scheduler

KV_BYTES_PER_TOKEN = 28 * 2 * 2 * 128 * 2  # layers × (K, V) × kv heads × head dim × bf16
GIB = 2**30
TRAINING_GIB = 30  # what training holds while the engine runs (see the module docstring)
MEMORY_FRACTION = 0.8
SAMPLES_PER_RANK = (16, 8)  # prompts, n
PAGE_SIZE = 64
MAX_ROWS = 256
SYNC_EVERY = 8


def draw_rollout(cap: int, seed: int = 0):
    rng = random.Random(seed)
    P, n = SAMPLES_PER_RANK
    prompts = [rng.randint(100, 200) for _ in range(P)]
    lengths = [[min(cap, max(1, int(rng.lognormvariate(math.log(0.3 * cap), 0.8)))) for _ in range(n)] for _ in prompts]
    return prompts, lengths


def simulate_paged(prompts, lengths, cap: int, budget_tokens: int) -> dict:
    n = len(lengths[0])
    sched = Scheduler(prompts, n, [cap] * len(prompts), PAGE_SIZE, budget_tokens // PAGE_SIZE, MAX_ROWS)
    target = {p * n + j: lengths[p][j] for p in range(len(prompts)) for j in range(n)}
    steps = prefill = 0
    while True:
        for seq in [s for s in sched.rows if s is not None and s.generated >= target[s.sample]]:
            sched.finish(seq)
        sched.grow(SYNC_EVERY)
        sched.compact()
        adm = sched.admit(SYNC_EVERY)
        prefill += sum(prompts[p] for p in adm.prefill) + sum(s.prompt_len + s.generated - 1 for s in adm.recompute)
        sched.release_prompts()
        if sched.done:
            break
        for s in sched.rows:
            s.generated = min(s.generated + SYNC_EVERY, target[s.sample])
        steps += SYNC_EVERY
    assert sched.used_pages == 0
    return dict(decode_steps=steps, peak_running=sched.peak_running, preemptions=sched.preemptions,
                prefill_tokens=prefill)


def simulate_static(prompts, lengths, cap: int, budget_tokens: int) -> dict:
    n = len(lengths[0])
    row = max(prompts) + cap  # tokens each slot reserves
    steps = peak = 0
    first = 0
    while first < len(prompts):
        store, last = 0, first
        while last < len(prompts):  # the previous engine's _plan_waves
            wanted = min(MAX_ROWS, n * (last + 1 - first))
            if store + prompts[last] + wanted * row > budget_tokens and last > first:
                break
            store += prompts[last]
            last += 1
        slots = min(MAX_ROWS, n * (last - first), (budget_tokens - store) // row)
        peak = max(peak, slots)
        queue = [lengths[p][j] for p in range(first, last) for j in range(n)]
        ends = []  # when each slot frees, refilled from the queue at the next sync
        for length in queue:
            if len(ends) < slots:
                ends.append(length)
            else:
                ends.sort()
                ends[0] = -(-ends[0] // SYNC_EVERY) * SYNC_EVERY + length
        steps += -(-max(ends) // SYNC_EVERY) * SYNC_EVERY
        first = last
    return dict(decode_steps=steps, peak_running=peak, preemptions=0, prefill_tokens=sum(prompts))


def main():
    rows = []
    for gpu_gib in (80, 141):
        budget = int((gpu_gib - TRAINING_GIB) * MEMORY_FRACTION * GIB) // KV_BYTES_PER_TOKEN
        for cap in (8192, 16384, 24576):
            prompts, lengths = draw_rollout(cap)
            paged = simulate_paged(prompts, lengths, cap, budget)
            static = simulate_static(prompts, lengths, cap, budget)
            shape = f"{gpu_gib}GiB cap {cap // 1024}K budget {budget // 1000}K tokens"
            mean = sum(map(sum, lengths)) / sum(map(len, lengths))
            for impl, r in (("paged", paged), ("static", static)):
                rows.append(dict(impl=impl, shape=shape, mean_response=mean, **r,
                                 concurrency_x=r["peak_running"] / static["peak_running"],
                                 fewer_steps_x=static["decode_steps"] / r["decode_steps"]))
    print_table(rows, "scheduler (no model): paged vs static cache, per rank")
    print(f"rows appended to {append_rows('scheduler', rows, 'cpu')}")


if __name__ == "__main__":
    main()
