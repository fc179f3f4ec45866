"""Mixture-of-experts end to end: the engine on a Qwen3-MoE model against Hugging Face ``generate``, and router
replay's effect on the engine-vs-trainer log-prob gap.

Run: ``python bench/bench_moe.py`` (CPU sizes without CUDA, GPU sizes with it; ``--quick`` shrinks either);
``python bench/bench_moe.py --replay-gap`` (CPU, bf16). Rows go to ``bench/results/moe.csv``. ``--family qwen2_moe``:
the same sizes as a Qwen2-MoE, each MoE layer with a shared expert 4 experts wide (Qwen1.5-MoE-A2.7B's ratio, 5632 to
1408), q/k/v biases and its top-k weights not renormalised.

- **Engine** (default): one sampling workload (the median of 3 alternating calls on CPU, 1 on GPU), the engine and
  transformers' ``generate`` (its own experts implementation, ``grouped_mm`` on CUDA, ``eager`` on CPU) on the same
  random weights: tokens/s, peak extra memory. GPU: the decode step (the full call minus a one-token call, per
  remaining step) against its memory roofline: per step the weights every token reads (attention, norms, routers,
  the LM head), each MoE layer's *active* experts (expected ``E·(1 − (1 − K/E)^B)`` of them for B rows routed
  independently and uniformly, ``3·H·I`` elements each) and the live K/V, over the copy bandwidth measured in this
  run. Sizes: CPU, a 4-layer model of 16
  experts (top-4); GPU, 4 layers of Qwen3-30B-A3B's layer (hidden 2048, 32/4 heads of 128, 128 experts of width 768,
  top-8) in bf16, its vocabulary.
- **Replay gap** (``--replay-gap``): a 4-layer Qwen3-MoE model in bf16 on CPU (hidden 256, Qwen3-30B-A3B's 128
  experts and top-8, of width 64), 16 prompts × 4 samples of 48 tokens at temperature 1, sampled by the engine with
  ``record_routing``; the trainer's packed forward of the same bf16 weights (``packed_logprobs``, the loss's path)
  with and without replaying the record: mean, p99 and max ``|log π_trainer − log π_engine|`` over the sampled
  tokens, and with replay ``moe/replay_mismatch``, the fraction of (token, MoE layer) pairs whose top-K the trainer's
  router, in the replayed forward, would have chosen otherwise. Both
  sides compute in bf16 with other shapes (the engine's decode rows, the trainer's packed sequences), so their router
  logits differ by bf16 rounding and near ties pick other experts; replay removes that part of the gap.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch
from common import append_rows, copy_bandwidth_gbps, peak_extra_bytes, print_table
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from fastgrpo.engine.engine import GenerationEngine, SamplingParams

CPU_CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
                  num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=1024)
GPU_CONFIG = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                  num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096)
GAP_CONFIG = dict(CPU_CONFIG, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=64, initializer_range=0.02)


def build(config: dict, device: str, dtype: torch.dtype, seed: int = 0, family: str = "qwen3_moe"):
    """A random model of ``config``'s sizes: a Qwen3-MoE, or a Qwen2-MoE with a shared expert (module docstring)."""
    torch.manual_seed(seed)
    with torch.device(device):
        if family == "qwen3_moe":
            return Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).to(dtype).eval()
        kw = {k: v for k, v in config.items() if k not in ("head_dim", "norm_topk_prob")}
        config = Qwen2MoeConfig(**kw, shared_expert_intermediate_size=4 * config["moe_intermediate_size"])
        return Qwen2MoeForCausalLM(config).to(dtype).eval()


def prompts_of(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(num)]


def timed(fn, device: str):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def hf_generate(model, prompts, n, new):
    ids = torch.tensor(prompts, device=model.device).repeat_interleave(n, 0)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=new,
                              min_new_tokens=new, pad_token_id=0, eos_token_id=None)


def decode_step_bytes(model, rows: int, context: int) -> float:
    """Bytes one decode step reads at best (module docstring): dense weights, the active experts, the live K/V."""
    c = model.config
    elt = next(model.parameters()).element_size()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size
    E, K = c.num_experts, c.num_experts_per_tok
    active = E * (1 - (1 - K / E) ** rows)  # expected experts at least one row picks, per MoE layer
    weights = (sum(p.numel() for p in model.parameters()) - experts - c.vocab_size * c.hidden_size  # the embedding
               + c.num_hidden_layers * active * per_expert)  # is a lookup of `rows` rows
    kv = rows * context * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
    return (weights + kv) * elt


def engine_rows(quick: bool, family: str) -> list[dict]:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        config, dtype = GPU_CONFIG, torch.bfloat16
        num, n, length, new = (8, 8, 128, 64) if quick else (16, 8, 128, 256)
    else:
        config, dtype = CPU_CONFIG, torch.float32
        num, n, length, new = (4, 4, 32, 16) if quick else (8, 4, 48, 64)
    model = build(config, device, dtype, family=family)
    hf_impl = "grouped_mm" if cuda else "eager"
    model.set_experts_implementation(hf_impl)
    prompts = prompts_of(num, length, config["vocab_size"])
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=num * n)
    params = SamplingParams(n=n, max_new_tokens=new, seed=0)
    engine.generate(prompts, SamplingParams(n=n, max_new_tokens=4, seed=0))  # warm-up: graphs, kernels' compile
    hf_new = min(new, 64)
    hf_generate(model, prompts[:2], 2, 4)
    eng_runs, hf_runs = [], []
    for _ in range(1 if cuda else 3):  # alternating, so a slow phase of a shared machine hits both sides
        eng_s, out = timed(functools.partial(engine.generate, prompts, params), device)
        assert all(len(c.token_ids) == new for g in out for c in g)
        eng_runs.append(eng_s)
        hf_runs.append(timed(lambda: hf_generate(model, prompts, n, hf_new), device)[0])
    eng_s, hf_s = statistics.median(eng_runs), statistics.median(hf_runs)
    shape = (f"{family} {num}x{n} prompts {length} new {new} E {config['num_experts']} "
             f"top-{config['num_experts_per_tok']} "
             f"params {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M {str(dtype).split('.')[-1]}")
    eng_tps, hf_tps = num * n * new / eng_s, num * n * hf_new / hf_s
    rows = [dict(impl="engine", shape=shape, seconds=eng_s, tokens_per_s=eng_tps, speedup_vs_hf=eng_tps / hf_tps,
                 peak_extra_MiB=peak_extra_bytes(functools.partial(engine.generate, prompts, params), device) / 2**20),
            dict(impl=f"hf_generate ({hf_impl} experts)", shape=shape, seconds=hf_s, tokens_per_s=hf_tps,
                 speedup_vs_hf=1.0, new_tokens=hf_new,
                 peak_extra_MiB=peak_extra_bytes(lambda: hf_generate(model, prompts, n, hf_new), device) / 2**20)]
    if cuda:
        one, _ = timed(lambda: engine.generate(prompts, SamplingParams(n=n, max_new_tokens=1, seed=0)), device)
        step_ms = (eng_s - one) / (new - 1) * 1e3
        gbps = copy_bandwidth_gbps()
        roof_ms = decode_step_bytes(model, num * n, length + new // 2) / (gbps * 1e9) * 1e3
        rows[0].update(decode_step_ms=step_ms, roofline_step_ms=roof_ms, roofline_fraction=roof_ms / step_ms,
                       copy_gbps=gbps)
    for r in rows:
        r["loadavg"] = round(os.getloadavg()[0], 2)
    return rows


def replay_gap_rows(family: str) -> list[dict]:
    from fastgrpo.algorithms.batch import Sample, pack_microbatches
    from fastgrpo.algorithms.forward import packed_forward, packed_logprobs
    from fastgrpo.distributed import ForwardWrapper
    from fastgrpo.models.attention import enable_packed_attention
    from fastgrpo.models.moe import MoERouting, enable_moe

    model = build(GAP_CONFIG, "cpu", torch.bfloat16, family=family)
    prompts = prompts_of(16, 32, GAP_CONFIG["vocab_size"], seed=1)
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=64, record_routing=True)
    out = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=48, seed=0))
    enable_moe(model)
    enable_packed_attention(model)
    samples = [Sample(p, c.token_ids, c.logprobs, 0.0, routing=c.routing) for p, g in zip(prompts, out) for c in g]
    forward = ForwardWrapper(model, packed_forward)
    rows = []
    for replay in (True, False):
        gaps, differ, compared = [], 0, 0
        for mb in pack_microbatches(samples, 4096, torch.device("cpu")):
            routing = MoERouting(mb.routing) if replay else None
            logp = packed_logprobs(forward, mb, 1.0, routing)
            trained = mb.mask != 0
            gaps.append((logp[trained] - mb.sample_logprobs[trained]).abs())
            if replay:  # moe/replay_mismatch: the trainer's router, in the replayed forward, against the record
                differ, compared = differ + int(routing.differ), compared + int(routing.compared)
        gap = torch.cat(gaps)
        rows.append(dict(replay=replay, tokens=gap.numel(), mean_abs_dlogp=gap.mean().item(),
                         p99_abs_dlogp=gap.quantile(0.99).item(), max_abs_dlogp=gap.max().item(),
                         replay_mismatch=differ / compared if replay else float("nan"),
                         shape=f"{family} 4 layers, hidden 256, 128 experts top-8, bf16, 16x4x48"))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller workload")
    parser.add_argument("--replay-gap", action="store_true", help="router replay's effect on the bf16 gap (CPU)")
    parser.add_argument("--family", choices=["qwen3_moe", "qwen2_moe"], default="qwen3_moe",
                        help="the model's architecture (qwen2_moe: with a shared expert)")
    args = parser.parse_args()
    if args.replay_gap:
        rows = replay_gap_rows(args.family)
        print_table(rows, "engine-vs-trainer log-prob gap, bf16, with and without router replay")
        print(f"rows appended to {append_rows('moe_replay_gap', rows, 'cpu')}")
        return
    rows = engine_rows(args.quick, args.family)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print_table(rows, f"{args.family} generation on {device}")
    print(f"rows appended to {append_rows('moe', rows, device)}")


if __name__ == "__main__":
    main()
