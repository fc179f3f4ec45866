"""Synchronous against asynchronous rollouts on a long-tailed workload: the engine's generation session
(fastgrpo.engine.session, what ``grpo.async_grpo`` runs on) against one ``generate`` per step.

Run: ``python bench/bench_async.py`` (CPU: about a minute; ``--smoke``: seconds, records nothing; on CUDA the same
with ``--device cuda``; ``--weight-bound``: a wider model whose CPU decode step costs about the same at 1 and at 16
rows, as a GPU's does, several minutes).

Workload: ``STEPS`` optimizer steps of ``PROMPTS`` prompts × ``N`` samples, prompts of 8 tokens. Each prompt's
response length is drawn once, log-normal with median 0.12 · cap and σ = 1.2, capped at the cap (256 tokens): most
completions are short and a few run to the cap, the long tail of reasoning RL. Both modes see the same lengths: the
model is a 2-layer Qwen2 (hidden = vocabulary = 512) built to count (:func:`counting_model`: its next token is the
last one + 1, sampled at temperature 1 with a margin that makes it certain), and a prompt's last token is chosen so
that the count reaches the stop token after exactly the drawn length. Its layers run at full cost.

- **sync**: each step ``generate``\\ s its prompts and trains all of them: the batch drains to the step's longest
  completion.
- **async, age a**: one session; ``(a + 1) · PROMPTS`` prompts in flight; each step ``run``\\ s until ``PROMPTS``
  groups finished, trains the first ``PROMPTS`` of them (the rest wait), drops a group whose oldest token is more
  than ``a`` versions old (``update()`` after each step: a weight version; no weight changes, the update itself is
  the same in both modes and not timed), and adds ``PROMPTS`` new prompts.

Reported per mode, from one run: trained tokens, decode steps per trained token, the decode batch's mean occupancy
(``active_row_steps / decode_steps``), wall time of generation per trained token, dropped (stale) groups, and the
ratio of sync's wall time per trained token to the mode's (> 1: async is faster), and how a decode step's time grows
from 1 row to the workload's rows (measured in the same run: near 1x, reading the weights dominates a step, as on a
GPU; near the rows' count, the rows do, as for the default model on CPU). Rows go to ``bench/results/async.csv``.
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch
from common import append_rows, print_table

from fastgrpo.engine.engine import GenerationEngine, SamplingParams

CAP = 256
PROMPT_TOKENS = 8
STOP = 0  # the counting model's completions end at this token
STEPS, PROMPTS, N = 12, 16, 4


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


def run_sync(engine, params, prompts: list[list[int]], steps: int, per_step: int) -> dict:
    trained = decode = rows = 0
    start = time.perf_counter()
    for s in range(steps):
        out = engine.generate(prompts[s * per_step : (s + 1) * per_step], params)
        trained += sum(len(c.token_ids) for group in out for c in group)
        decode += engine.last_stats["decode_steps"]
        rows += engine.last_stats["active_row_steps"]
    return dict(trained_tokens=trained, decode_steps=decode, row_steps=rows, wall_s=time.perf_counter() - start,
                stale_groups=0)


def run_async(engine, params, prompts: list[list[int]], steps: int, per_step: int, age: int) -> dict:
    longest = max(map(len, prompts))
    trained = decode = rows = stale = 0
    ready: list = []  # (key, group) finished, not trained yet
    keys: list[int] = []  # the trained groups' keys (their prompts' indices)
    start = time.perf_counter()
    with engine.session(params, max_prompt_tokens=longest) as session:
        session.add(prompts[: (age + 1) * per_step])
        added = (age + 1) * per_step
        for _ in range(steps):
            while True:
                fresh = [(k, g) for k, g in ready if session.version - min(min(c.versions) for c in g) <= age]
                stale, ready = stale + len(ready) - len(fresh), fresh
                if len(ready) >= per_step or not session.in_flight:
                    break
                ready += session.run(per_step - len(ready))
                decode += engine.last_stats["decode_steps"]
                rows += engine.last_stats["active_row_steps"]
            if len(ready) < per_step:
                raise RuntimeError("the workload ran out of prompts: raise its size")
            trained += sum(len(c.token_ids) for _, group in ready[:per_step] for c in group)
            keys += [k for k, _ in ready[:per_step]]
            ready = ready[per_step:]
            session.update()
            session.add(prompts[added : added + per_step])
            added += per_step
    return dict(trained_tokens=trained, decode_steps=decode, row_steps=rows, wall_s=time.perf_counter() - start,
                stale_groups=stale, trained_keys=keys, added=added, waiting=len(ready))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="toy sizes, nothing recorded")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ages", default="1,2")
    ap.add_argument("--weight-bound", action="store_true",
                    help="a model whose decode step is dominated by reading its weights at these rows (hidden 1024, "
                         "8 layers, MLP 4096: 0.5 GB fp32), 8 steps x 4 prompts x 4 samples, cap 64")
    args = ap.parse_args()
    steps, per_step, cap = (3, 4, 32) if args.smoke else (8, 4, 64) if args.weight_bound else (STEPS, PROMPTS, CAP)
    vocab = 2 * cap
    shape = dict(hidden=1024, layers=8, intermediate=4096) if args.weight_bound else {}
    model = counting_model(vocab, PROMPT_TOKENS + cap + 1, args.device, **shape)
    ages = [int(a) for a in args.ages.split(",")]
    count = (steps + max(ages) + 1) * per_step  # every prompt any mode may add
    rng = random.Random(1)
    lengths = draw_lengths(count, cap, seed=0)
    prompts = [prompt_for(r, vocab, rng) for r in lengths]
    params = SamplingParams(n=N, temperature=1.0, max_new_tokens=cap, seed=3)
    engine = GenerationEngine(model, eos_token_ids=STOP, max_batch_size=per_step * N,
                              max_total_tokens=4 * per_step * N * (PROMPT_TOKENS + cap))
    run_sync(engine, params, prompts, 1, per_step)  # warm-up (first-call costs: the CPU products' timing, allocations)
    run_async(engine, params, prompts, 1, per_step, 1)
    rows = per_step * N
    steps_ms = {r: decode_step_ms(engine, r, vocab) for r in (1, rows)}  # how a step's cost grows with its rows
    packed = sorted(k for k, v in engine.last_stats["cpu_packed"].items() if v)  # the CPU products packed for MKL
    print(f"decode step: {steps_ms[1]:.1f} ms at 1 row, {steps_ms[rows]:.1f} ms at {rows} "
          f"({steps_ms[rows] / steps_ms[1]:.2f}x; 1.00x: the weights' read dominates, {rows}x: the rows do)")
    runs = {"sync": run_sync(engine, params, prompts, steps, per_step)}
    for age in ages:
        runs[f"async age {age}"] = run_async(engine, params, prompts, steps, per_step, age)
    base = runs["sync"]["wall_s"] / runs["sync"]["trained_tokens"]
    table = []
    for mode, r in runs.items():
        per_token = r["wall_s"] / r["trained_tokens"]
        table.append(dict(mode=mode, shape=f"{steps} steps x {per_step} x {N}, cap {cap}" + (
                              ", weight-bound" if args.weight_bound else ""),
                          step_ms_rows_over_1=steps_ms[rows] / steps_ms[1], cpu_packed="+".join(packed) or "none",
                          trained_tokens=r["trained_tokens"],
                          decode_steps_per_trained_token=r["decode_steps"] / r["trained_tokens"],
                          occupancy=r["row_steps"] / max(r["decode_steps"], 1), stale_groups=r["stale_groups"],
                          us_per_trained_token=1e6 * per_token, speedup_x=base / per_token))
    print_table(table, f"async vs sync rollouts on a long-tailed workload ({args.device}, "
                       f"{torch.get_num_threads()} threads)")
    if not args.smoke:
        print(f"rows appended to {append_rows('async', table, args.device)}")


if __name__ == "__main__":
    main()
