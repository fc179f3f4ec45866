"""bench/bench_async.py's workload at toy sizes: every completion ends exactly at its forced length in both modes, sync
trains every prompt's tokens (the closed form), async trains the same prompts in the same order (the in-order rule:
step t trains keys t·per_step to (t + 1)·per_step - 1, whatever their lengths), each once, whole, at its forced
lengths, drops none as stale, and keeps (age + 1) x per_step groups in flight; the tokens left in flight agree with
the engine's row-steps, and a window's figures and those of the steps before it add up to the whole run's. (No time
is asserted.)"""

import random
import sys
from pathlib import Path

from checks import one_thread  # noqa: F401  (one_thread: a module fixture)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_async as B  # noqa: E402

from fastgrpo.engine.engine import GenerationEngine, SamplingParams  # noqa: E402


def test_the_forced_lengths_hold_and_the_tokens_add_up():
    steps, per_step, cap, n = 3, 3, 24, 2
    model = B.counting_model(2 * cap, B.PROMPT_TOKENS + cap + 1, "cpu")
    lengths = B.draw_lengths((2 * steps + 3) * per_step, cap, seed=5)
    rng = random.Random(0)
    prompts = [B.prompt_for(r, 2 * cap, rng) for r in lengths]
    params = SamplingParams(n=n, max_new_tokens=cap, seed=1)
    engine = GenerationEngine(model, eos_token_ids=B.STOP, max_batch_size=per_step * n, max_total_tokens=4096)
    out = engine.generate(prompts, params)
    for p, r, group in zip(prompts, lengths, out):  # the count from the prompt's last token up to the stop token
        assert all(c.token_ids == [(p[-1] + i) % (2 * cap) for i in range(1, r + 1)] for c in group)
    sync = B.run_sync(engine, params, prompts, steps, per_step)
    assert sync["trained_tokens"] == n * sum(lengths[: steps * per_step]) and sync["stale_groups"] == 0
    # every sample's first token comes from its prefill, the others from decode steps
    assert sync["row_steps"] == sync["sampled_tokens"] - steps * per_step * n
    for age in (1, 2):
        got = B.run_async(engine, params, prompts, steps, per_step, age)
        keys, dropped = got["trained_keys"], got["dropped_keys"]
        assert keys == list(range(steps * per_step))  # sync's prompts, in order: no length bias
        assert dropped == [] and got["stale_groups"] == got["stale_tokens"] == got["late_tokens"] == 0
        assert got["trained_tokens"] == sync["trained_tokens"]  # whole groups at their forced lengths
        assert [st["trained_tokens"] for st in got["log"]] == [st["trained_tokens"] for st in sync["log"]]
        assert got["row_steps"] <= got["decode_steps"] * per_step * n  # never more samples than rows
        assert len(keys) + got["waiting"] <= got["added"]  # the rest were still in flight
        assert all(step["buffer"] == (age + 1) * per_step for step in got["log"])  # the buffer kept full
        # the tokens left in flight: sampled = row-steps + the samples started (every finished one, at most all)
        finished = len(keys) + got["waiting"]
        assert n * finished <= got["sampled_tokens"] - got["row_steps"] <= n * got["added"]
        for first in range(1, steps):  # a window and the steps before it add up to the whole run
            before, after = B.window(got["log"][:first], 0), B.window(got["log"], first)
            assert before["left_after"] == after["left_before"]
            assert before["sampled_tokens"] + after["sampled_tokens"] == got["sampled_tokens"]
