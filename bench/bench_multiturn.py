"""Multi-turn rollouts: the engine keeping each conversation's KV across turns against the same engine re-prefilling
the whole conversation from its ids every turn (what TRL 1.16 does: one ``generate`` per turn on prompt + history).

Run: ``python bench/bench_multiturn.py`` (CPU sizes without CUDA, GPU sizes with it; ``--quick`` shrinks either;
``--smoke`` is a few-second CPU run that records nothing, tests/test_bench_multiturn.py). bench/gpu_check.sh runs
``--quick`` on the GPU.

Workload (scripted, identical work on both sides): P prompts × n samples, ``--turns`` sampled turns of exactly
``--turn-tokens`` tokens each, an observation of ``--obs-tokens`` tokens (deterministic ids from a seed) after every
turn but the last. A turn's length is fixed with a stop string: the bench's tokenizer decodes every token to "x"
and the stop string is ``"x" * turn_tokens`` (``max_new_tokens`` is the same, so nothing is sampled past it), so both
sides sample the same number of tokens per turn at the same positions (the token ids differ between the sides,
which does not change the cost). Sampling at temperature 1, no top-k/top-p; the environment answers at once (the
engine's cost is measured, not an environment's).

- **kv_kept**: one ``generate(..., turns=)`` call: a sample that ends a turn pauses with its pages kept, its
  observation (and the one sampled token whose K/V were not cached) is prefilled into its pages against the cached
  K/V, decoding resumes.
- **re_prefill**: ``turns`` ``generate`` calls; the first samples n per prompt (the prompt prefilled once per
  group, as in kv_kept), every later one gets each trajectory's prompt + history as a new prompt (n = 1) and
  prefills all of it.

Both sides get the same KV budget (``max_total_tokens``: every conversation at its full length, + 25%), so the pool
is allocated once per call at the same size and nothing is preempted. Figures, from one run: prefill tokens
(``last_stats["prefill_tokens"]`` summed over the calls), wall time (the median of ``--repeats`` calls per side,
alternating; timed in the default process state, ``common.assert_timing_state``), decode steps, and the ratios
re_prefill / kv_kept. Rows go to ``bench/results/multiturn.csv``.

CPU: the ~10M-parameter Qwen2-shaped model of bench_generation.py, fp32. GPU: the Qwen2.5-1.5B-shaped model of
bench_generation.py with random bf16 weights.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics

import torch
from bench_generation import CPU_CONFIG, QWEN25_15B_CONFIG, build_model, make_prompts, timed
from common import append_rows, print_table

from fastgrpo.engine.engine import GenerationEngine, SamplingParams, TurnResult


class UniformText:
    """A tokenizer for the engine's stop strings: every token decodes to "x" (a turn's text is ``"x" * tokens``)."""

    def decode(self, ids) -> str:
        return "x" * len(ids)


def observation(seed: int, key: tuple[int, int], turn: int, length: int, vocab: int) -> list[int]:
    """The observation after ``turn`` of trajectory ``key``: ``length`` ids, the same on both sides."""
    rng = random.Random(f"{seed}/{key[0]}/{key[1]}/{turn}")
    return [rng.randrange(vocab) for _ in range(length)]


class ScriptedObservations:
    """A turn handler that answers every turn at once with its observation (``max_turns`` ends the trajectory)."""

    def __init__(self, seed: int, length: int, vocab: int):
        self.seed, self.length, self.vocab = seed, length, vocab
        self.turns: dict[tuple[int, int], int] = {}
        self.pending: list = []

    def start(self, key, turn_ids, turn_text) -> None:
        turn = self.turns[key] = self.turns.get(key, 0) + 1
        self.pending.append((key, TurnResult(observation(self.seed, key, turn, self.length, self.vocab))))

    def ready(self, block: bool):
        out, self.pending = self.pending, []
        return out


def run_kv_kept(engine, prompts, w) -> tuple[list[list[int]], dict]:
    """One multi-turn call; returns each trajectory's tokens (prompt-major) and the call's prefill tokens."""
    params = SamplingParams(n=w["n"], max_new_tokens=w["turn_tokens"], stop_strings=("x" * w["turn_tokens"],),
                            max_turns=w["turns"], max_sequence_tokens=w["conversation"], seed=0)
    out = engine.generate(prompts, params, turns=ScriptedObservations(1, w["obs_tokens"], w["vocab"]))
    assert all(c.finish_reason == "max_turns" and c.num_turns == w["turns"] for comps in out for c in comps)
    stats = engine.last_stats
    return [c.token_ids for comps in out for c in comps], dict(prefill_tokens=stats["prefill_tokens"],
                                                              decode_steps=stats["decode_steps"],
                                                              peak_kv_tokens=stats["peak_kv_tokens"])


def run_re_prefill(engine, prompts, w) -> tuple[list[list[int]], dict]:
    """``turns`` calls, each on every trajectory's prompt + history (see the module docstring)."""
    n, k = w["n"], w["turn_tokens"]
    keys = [(p, j) for p in range(len(prompts)) for j in range(n)]
    history = {key: [] for key in keys}
    totals = dict(prefill_tokens=0, decode_steps=0, peak_kv_tokens=0)
    for turn in range(1, w["turns"] + 1):
        params = SamplingParams(n=n if turn == 1 else 1, max_new_tokens=k, stop_strings=("x" * k,), seed=turn)
        if turn == 1:
            out = [c for comps in engine.generate(prompts, params) for c in comps]
        else:
            out = [comps[0] for comps in engine.generate([prompts[p] + history[(p, j)] for p, j in keys], params)]
        for key, c in zip(keys, out):
            assert c.finish_reason == "stop" and len(c.token_ids) == k
            history[key] += c.token_ids
            if turn < w["turns"]:
                history[key] += observation(1, key, turn, w["obs_tokens"], w["vocab"])
        stats = engine.last_stats
        totals["prefill_tokens"] += stats["prefill_tokens"]
        totals["decode_steps"] += stats["decode_steps"]
        totals["peak_kv_tokens"] = max(totals["peak_kv_tokens"], stats["peak_kv_tokens"])
    return [history[key] for key in keys], totals


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller workload")
    parser.add_argument("--smoke", action="store_true", help="a few seconds on CPU at toy sizes; records nothing")
    parser.add_argument("--turns", type=int, default=None, help="sampled turns per trajectory")
    parser.add_argument("--turn-tokens", type=int, default=None, help="tokens sampled per turn")
    parser.add_argument("--obs-tokens", type=int, default=None, help="tokens appended after each turn but the last")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per side, alternating (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    # (prompts, n, prompt tokens, turns, turn tokens, observation tokens)
    if args.smoke:
        config, dtype, sizes = dict(CPU_CONFIG, num_hidden_layers=2, vocab_size=512), torch.float32, (2, 2, 8, 3, 4, 6)
    elif cuda:
        config, dtype = QWEN25_15B_CONFIG, torch.bfloat16
        sizes = (8, 8, 256, 4, 64, 128) if args.quick else (32, 8, 256, 4, 256, 256)
    else:
        config, dtype = CPU_CONFIG, torch.float32
        sizes = (2, 4, 64, 4, 16, 64) if args.quick else (4, 4, 64, 6, 16, 64)
    P, n, prompt_len, turns, turn_tokens, obs_tokens = sizes
    w = dict(n=n, turns=args.turns or turns, turn_tokens=args.turn_tokens or turn_tokens,
             obs_tokens=args.obs_tokens if args.obs_tokens is not None else obs_tokens, vocab=config["vocab_size"])
    model = build_model(config, device, dtype)
    prompts = make_prompts(P, prompt_len, prompt_len, config["vocab_size"])
    conversation = prompt_len + w["turns"] * w["turn_tokens"] + (w["turns"] - 1) * w["obs_tokens"]
    w["conversation"] = conversation  # kv_kept's max_sequence_tokens (it sizes the row cache and block tables)
    budget = int(1.25 * P * n * conversation) + 64 * 4  # every conversation at its full length, + 25%
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=P * n, max_total_tokens=budget,
                              tokenizer=UniformText())

    load_start = os.getloadavg()[0]
    run_kv_kept(engine, prompts[:1], dict(w, n=2, turns=2))  # warm-up: first-call costs (compile, graphs)
    run_re_prefill(engine, prompts[:1], dict(w, n=2, turns=2))
    repeats = args.repeats or (1 if cuda or args.smoke else 3)
    seconds = {"kv_kept": [], "re_prefill": []}
    for _ in range(repeats):  # alternating, so a slow phase of a shared machine hits both sides
        kv_s, (kv_ids, kv) = timed(lambda: run_kv_kept(engine, prompts, w), device)
        re_s, (re_ids, re) = timed(lambda: run_re_prefill(engine, prompts, w), device)
        seconds["kv_kept"].append(kv_s)
        seconds["re_prefill"].append(re_s)
    assert [len(t) for t in kv_ids] == [len(t) for t in re_ids] == [conversation - prompt_len] * (P * n)
    kv_s, re_s = statistics.median(seconds["kv_kept"]), statistics.median(seconds["re_prefill"])
    shape = (f"{P}x{n} prompts {prompt_len} turns {w['turns']}x{w['turn_tokens']} obs {w['obs_tokens']} "
             f"params {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M {str(dtype).split('.')[-1]}")
    if not cuda:
        shape += f" threads {torch.get_num_threads()}"
    rows = []
    for impl, s, stats in (("kv_kept", kv_s, kv), ("re_prefill", re_s, re)):
        rows.append({"impl": impl, "shape": shape, "seconds": s, **stats,
                     "prefill_ratio": stats["prefill_tokens"] / kv["prefill_tokens"], "time_ratio": s / kv_s,
                     "repeats": repeats, "loadavg_start": round(load_start, 2),
                     "loadavg_end": round(os.getloadavg()[0], 2)})
    print_table(rows, f"multi-turn rollouts on {device} (ratios: re_prefill / kv_kept)")
    if not args.smoke:
        print(f"rows appended to {append_rows('multiturn', rows, device)}")


if __name__ == "__main__":
    main()
