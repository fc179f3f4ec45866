"""A model of one GRPO step's time on 8 GPUs: co-located sync, co-located async (grpo.async_grpo, age 1), and a split
node (k GPUs generating, 8 - k training, one step off), for docs/split_node.md. Nothing is built or timed here.

Run: ``python bench/split_node_model.py`` (seconds, CPU; ``--decode-bandwidth``, ``--step-overhead-ms``,
``--train-tflops`` take measured GPU rates once ``bench/gpu_check.sh`` has recorded them).

**What is simulated** (no model, no GPU): the engine's real scheduler (:class:`fastgrpo.engine.scheduler.Scheduler`,
as ``bench/bench_scheduler.py`` drives it) on bench_scheduler's DeepScaleR-shaped workload: 128 prompts x 8 a step
over the generating GPUs, prompts of 100-200 tokens, responses log-normal with median 0.3 x cap and sigma 0.8,
capped; 64-token pages, 8 decode steps between host reads. Per decode step it records the running rows and their
contexts, so the K/V bytes each step reads are known.

- sync: each rank's 128 samples, ``rollout.max_batch_size`` 80 rows, the pool of deepscaler-1.5b's plan (what
  generation leaves: 62.5 GiB); the step drains to its longest completion.
- async: a rank keeps 2 steps' prompts in flight (age 1), runs until the 16 groups added first and not trained yet
  have finished (the trainer's in-order rule), trains them, adds the next 16 prompts; 72 rows and the 47.3 GiB
  pool that deepscaler-1.5b-async holds through the update.
- split, k generating GPUs: each takes 128 / k prompts a step (rounded), keeps 2 steps in flight, 256 rows and the
  whole GPU but the weights and workspace as its pool (69 GiB).

**Rates (estimates until measured on a GPU: bench/results/ holds no GPU row yet).** A decode step costs
``t0 + (weights + K/V read) / B``: the bf16 weights (3.55 GB) and every running row's K/V (28 KiB a token of
context) read once from HBM at an effective bandwidth B (default 60% of the H200's 4.8 TB/s) plus a fixed ``t0``
(launches, sampling, the host read; default 0.5 ms with CUDA graphs). Prefill and the update cost FLOPs at an
effective rate R (default 40% of 989 bf16 TFLOP/s): the update ``10 P`` per trained token (forward, backward,
the checkpointed forward again, the old-log-prob forward) plus attention ``3 x 4 L h x context`` per token; the
prefill ``2 P`` per token prefilled (prompts, and preempted samples recomputed). The split broadcasts the weights
(3.55 GB) over NVLink each step at 100 GB/s effective (an estimate) while its generation goes on.
"""

from __future__ import annotations

import argparse
import math
import random

from fastgrpo.algorithms.async_rollout import due_groups
from fastgrpo.engine.scheduler import Scheduler

P_PARAMS, LAYERS, HIDDEN = 1.777e9, 28, 1536  # DeepSeek-R1-Distill-Qwen-1.5B
WEIGHT_BYTES = 2 * P_PARAMS  # bf16
KV_BYTES = 28 * 2 * 2 * 128 * 2  # layers x (K, V) x kv heads x head dim x bf16 = 28 KiB a token
GIB = 2**30
PAGE, SYNC = 64, 8
PROMPTS, N, GPUS = 128, 8, 8


def draw(count: int, cap: int, rng: random.Random) -> list[tuple[int, list[int]]]:
    """``count`` prompts: (prompt length, the lengths of its N responses)."""
    return [(rng.randint(100, 200), [min(cap, max(1, int(rng.lognormvariate(math.log(0.3 * cap), 0.8))))
                                     for _ in range(N)]) for _ in range(count)]


class Simulation:
    """One GPU's generation under the real scheduler: decode steps and the K/V they read, prefill tokens."""

    def __init__(self, cap: int, rows: int, pool_gib: float):
        self.cap = cap
        self.sched = Scheduler([], N, [], PAGE, int(pool_gib * GIB) // KV_BYTES // PAGE, rows)
        self.target: dict[int, int] = {}
        self.left: dict[int, int] = {}  # prompt -> its samples not finished
        self.steps = self.kv_token_reads = self.prefill = 0

    def add(self, prompts) -> None:
        first = len(self.sched.prompt_lens)
        self.sched.add_prompts([p for p, _ in prompts], [self.cap] * len(prompts))
        for i, (_, lengths) in enumerate(prompts):
            self.left[first + i] = N
            self.target.update({(first + i) * N + j: n for j, n in enumerate(lengths)})

    def run(self, groups: int) -> list[int]:
        """Decode until ``groups`` prompts have all their samples done (or nothing is left); returns them."""
        done = []
        sched = self.sched
        while len(done) < groups:
            for seq in [s for s in sched.rows if s is not None and s.generated >= self.target[s.sample]]:
                sched.finish(seq)
                self.left[seq.prompt] -= 1
                if not self.left[seq.prompt]:
                    done.append(seq.prompt)
            if len(done) >= groups or (not sched.waiting and all(s is None for s in sched.rows)):
                break
            sched.grow(SYNC)
            sched.compact()
            adm = sched.admit(SYNC)
            self.prefill += sum(sched.prompt_lens[p] for p in adm.prefill)
            self.prefill += sum(s.prompt_len + s.generated - 1 for s in adm.recompute)
            sched.release_prompts()
            for s in sched.rows:  # SYNC decode steps: a row reads its context's K/V at each step it is live
                m = min(SYNC, self.target[s.sample] - s.generated)
                self.kv_token_reads += m * (s.prompt_len + s.generated) + m * (m - 1) // 2
                s.generated += m
            self.steps += SYNC
        return done


def generation_seconds(sim: Simulation, a) -> float:
    decode = sim.steps * a.step_overhead_ms * 1e-3 + (sim.steps * WEIGHT_BYTES + sim.kv_token_reads * KV_BYTES) / (
        a.decode_bandwidth * 1e12)
    return decode + 2 * P_PARAMS * sim.prefill / (a.train_tflops * 1e12)


def update_gpu_seconds(prompts, a) -> float:
    """GPU-seconds of the update of these groups (the module docstring's FLOPs at rate R)."""
    flops = 0.0
    for p, lengths in prompts:
        for n in lengths:
            t = p + n
            flops += 10 * P_PARAMS * t + 3 * 4 * LAYERS * HIDDEN * t * t / 2
    return flops / (a.train_tflops * 1e12)


def steady(sim: Simulation, share: int, steps: int, rng: random.Random, cap: int) -> None:
    """``steps`` async steps of ``share`` groups each, two steps' prompts in flight (age 1), in order as the trainer
    trains them (``fastgrpo.algorithms.async_rollout.due_groups``): the first adds two batches, each step decodes
    until the ``share`` groups added first and not trained yet have all finished and adds the next batch."""
    live, done = set(range(share)), set()
    sim.add(draw(share, cap, rng))
    for _ in range(steps):
        live.update(range(len(sim.sched.prompt_lens), len(sim.sched.prompt_lens) + share))
        sim.add(draw(share, cap, rng))
        due, missing = due_groups(live, done, share)
        while missing:
            done.update(sim.run(missing))
            due, missing = due_groups(live, done, share)
        live -= set(due)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode-bandwidth", type=float, default=4.8 * 0.6, help="effective HBM TB/s of a decode step")
    ap.add_argument("--step-overhead-ms", type=float, default=0.5, help="fixed cost of a decode step")
    ap.add_argument("--train-tflops", type=float, default=989 * 0.4, help="effective bf16 TFLOP/s of the update")
    ap.add_argument("--steps", type=int, default=8, help="async steps simulated (2 fill the buffer)")
    a = ap.parse_args()
    print(f"rates: decode {a.decode_bandwidth:.2f} TB/s + {a.step_overhead_ms} ms a step, update and prefill "
          f"{a.train_tflops:.0f} TFLOP/s, broadcast 100 GB/s (estimates unless given)")
    for cap in (8192, 24576):
        rng = random.Random(0)
        step = draw(PROMPTS, cap, rng)
        u = update_gpu_seconds(step, a)  # GPU-seconds of one step's update
        sync = Simulation(cap, 80, 62.5)
        sync.add(step[: PROMPTS // GPUS])
        sync.run(PROMPTS // GPUS)
        t_sync = generation_seconds(sync, a) + u / GPUS
        share = PROMPTS // GPUS
        sim = Simulation(cap, 72, 47.3)
        steady(sim, share, a.steps, random.Random(1), cap)
        per_step = generation_seconds(sim, a) / a.steps
        t_async = per_step + u / GPUS
        print(f"\ncap {cap}: mean response {sum(sum(x) for _, x in step) / PROMPTS / N:.0f} tokens, update "
              f"{u:.0f} GPU-s a step")
        print(f"  co-located sync   {t_sync:7.1f} s a step (generation {generation_seconds(sync, a):.1f} s, "
              f"{sync.steps} decode steps)")
        print(f"  co-located async  {t_async:7.1f} s a step (generation {per_step:.1f} s, "
              f"{sim.steps / a.steps:.0f} decode steps a step)")
        for k in range(1, GPUS):
            g = Simulation(cap, 256, 69.0)
            steady(g, round(PROMPTS / k), a.steps, random.Random(2), cap)
            t_gen = generation_seconds(g, a) / a.steps
            t_upd = u / (GPUS - k)
            t = max(t_gen, t_upd + WEIGHT_BYTES / 100e9)
            print(f"  split k={k}         {t:7.1f} s a step (generation {t_gen:.1f} s on {k}, update "
                  f"{t_upd:.1f} s on {GPUS - k})")


if __name__ == "__main__":
    main()
