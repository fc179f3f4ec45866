"""LoRA (fastgrpo/models/lora.py): the engine reads base + adapters unmerged, the reference is the base with the
adapters
disabled, PEFT loads what fastgrpo saves, and the unsupported variants are refused at start-up.

The references are PEFT's own modules run by Hugging Face: a teacher-forced forward and ``generate`` of the
``PeftModel`` (fp32: the engine's products differ from PEFT's by summation order only, ~1e-6, hence the harness's
1e-4), and a base model loaded separately for the reference.
"""

import json
import math

import pytest
import torch
from checks import one_thread  # noqa: F401  (an autouse fixture)
from hypothesis import given, settings
from test_generation import tiny_model
from test_generation_fidelity import cases, check_case

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_lora(model, seed, *, dropout=0.1, targets=TARGETS):
    """A PeftModel with random non-zero A and B (PEFT's init_lora_weights=False: both Kaiming-uniform) of a random
    rank, alpha, rsLoRA choice and subset of ``targets``; dropout > 0, which generation and eval forwards must not
    apply."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(targets), generator=g)[: 1 + seed % len(targets)].tolist()
    r = (1, 4, 8)[seed % 3]
    cfg = peft.LoraConfig(r=r, lora_alpha=float(1 + seed % 16), lora_dropout=dropout, use_rslora=bool(seed % 2),
                          target_modules=[targets[i] for i in sorted(pick)], init_lora_weights=False)
    torch.manual_seed(seed)
    return peft.get_peft_model(model, cfg).eval()


@settings(max_examples=8, deadline=None)
@given(cases())
def test_engine_with_lora_matches_peft_under_random_schedules(case):
    check_case(*case, adapt=random_lora)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(cases(max_prompts=6, max_samples=64))
def test_engine_with_lora_matches_peft_sweep(case):
    check_case(*case, adapt=random_lora)


def test_adapter_changes_the_engine_output():
    """The check above is not vacuous: with the adapters the engine's log-probs differ from the base's."""
    from fastgrpo.engine.engine import GenerationEngine, SamplingParams

    model = random_lora(tiny_model("qwen2", seed=1), seed=3)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, seed=0)
    engine = GenerationEngine(model, eos_token_ids=[])
    with_lora = engine.generate([[1, 2, 3]], params)[0][0]
    from fastgrpo.models.lora import adapters_disabled

    with adapters_disabled(model):
        base = engine.generate([[1, 2, 3]], params)[0][0]
    plain = GenerationEngine(tiny_model("qwen2", seed=1), eos_token_ids=[]).generate([[1, 2, 3]], params)[0][0]
    assert base.token_ids == plain.token_ids
    torch.testing.assert_close(torch.tensor(base.logprobs), torch.tensor(plain.logprobs), atol=1e-5, rtol=0)
    assert max(abs(a - b) for a, b in zip(with_lora.logprobs, base.logprobs)) > 1e-2


@pytest.mark.parametrize("row_cache", [True, False], ids=["row-cache", "pages"])
def test_bf16_base_with_peft_default_fp32_adapters_runs_as_peft(row_cache):
    """PEFT's defaults (``autocast_adapter_dtype=True``) keep the adapters in fp32 on a bf16 base (issue 37: the
    engine's prefill raised "expected m1 and m2 to have the same dtype"). The engine runs them as PEFT's forward
    does (the input cast to fp32 for the adapter, the sum rounded once to bf16), in the prefill, the q/k/v products
    and the MLP's buffered products (bf16 is never packed), decoding from the row cache or through the pages.

    Sampled log-probs against the exact (fp64) forward of the same PeftModel, flash-attn's rule with PEFT's own
    bf16 forward as the low-precision reference: ``|engine − exact| ≤ 2 |peft_bf16 − exact| + 2 · 2⁻⁸ · max|z|``.
    The floor: one bf16 rounding of the logits ``z`` (relative 2⁻⁸ at worst) moves a log-softmax by at most twice
    the largest change, so a bound below it would ask the engine to be luckier than bf16 allows. Not vacuous:
    the adapters move the exact log-probs by far more than the bound."""
    import copy

    from test_generation import random_prompts, teacher_forced_logp

    from fastgrpo.engine.engine import GenerationEngine, SamplingParams
    from fastgrpo.models.lora import adapters_disabled

    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_model("qwen2").to(torch.bfloat16), cfg).eval()
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all((d == torch.float32) == (".lora_" in n) for n, d in dtypes.items())  # PEFT's default mix
    exact = copy.deepcopy(model).double()
    prompts = [[1, 2, 3], *random_prompts([6, 9])]
    engine = GenerationEngine(model, eos_token_ids=[], row_cache=row_cache)
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=10, seed=0))
    for prompt, comps in zip(prompts, out):
        for c in comps:
            got = torch.tensor(c.logprobs, dtype=torch.float64)
            ref64 = teacher_forced_logp(exact, prompt, c.token_ids)
            with torch.no_grad():
                z = exact(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
            bound = 2 * (teacher_forced_logp(model, prompt, c.token_ids).double() - ref64).abs().max()
            bound += 2 * 2.0**-8 * z.abs().max()
            assert (got - ref64).abs().max() <= bound
            with adapters_disabled(exact):
                assert (teacher_forced_logp(exact, prompt, c.token_ids) - ref64).abs().max() > 4 * bound


# ---------------------------------------------------------------- the trainer's model: config, files, reference


def lora_model(tmp_path, dtype="float32", **lora):
    """The trainer's tiny model with ``model.lora`` (its base saved in ``tmp_path/base``) and a MasterAdamW."""
    from fastgrpo.config import LoRAConfig, ModelConfig
    from fastgrpo.models.loading import load_model

    cfg = ModelConfig(path="tiny", dtype=dtype, lora=LoRAConfig(**{"r": 4, **lora}))
    torch.manual_seed(0)
    model, tok = load_model(cfg, torch.device("cpu"), base_dir=tmp_path / "base")
    return model, tok, cfg


def train_steps(model, optimizer, steps=3, seed=0):
    """A few AdamW steps of a mean log-sum-exp loss through the mixed-precision path: B moves off 0."""
    from fastgrpo.precision import accumulate

    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 40, (2, 12), generator=g)
        optimizer.zero_grad()
        with accumulate(model, optimizer, last=True):
            model(ids).logits.float().logsumexp(-1).mean().backward()
        optimizer.step()


def test_base_is_frozen_in_the_compute_dtype_and_only_adapters_get_masters(tmp_path):
    from fastgrpo.precision import MasterAdamW, make_optimizer

    model, _, _ = lora_model(tmp_path, dtype="bfloat16")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # base and adapters: the compute dtype
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = make_optimizer(model, lr=1e-2)
    assert isinstance(opt, MasterAdamW)
    assert sum(m.numel() for m in opt.masters) == sum(p.numel() for n, p in model.named_parameters() if n in trainable)
    assert all(m.dtype == torch.float32 for m in opt.masters)
    train_steps(model, opt)
    for n, p in model.named_parameters():
        if n in base_before:
            assert torch.equal(p, base_before[n]) and p.grad is None  # bit for bit what was built
    assert any(p.abs().max() > 0 for n, p in model.named_parameters() if ".lora_B." in n)


def test_saved_adapter_loads_in_peft_with_equal_logits_and_resumes_exactly(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fastgrpo.checkpoint import save_checkpoint
    from fastgrpo.precision import make_optimizer

    model, tok, _ = lora_model(tmp_path)
    opt = make_optimizer(model, lr=1e-2)
    train_steps(model, opt)
    path = save_checkpoint(tmp_path / "run", 3, model=model, tokenizer=tok, optimizer=opt, dtype=torch.float32)
    assert (path / "adapter_model.safetensors").is_file() and (path / "adapter_config.json").is_file()
    assert not (path / "model.safetensors").exists()
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "base").resolve())

    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(path)).eval()
    ids = torch.randint(0, 40, (3, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, theirs = model.eval()(ids).logits, peft_model(ids).logits
        with peft_model.disable_adapter():
            plain = peft_model(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)  # fp32, same modules, attention kernels differ
    assert (theirs - plain).abs().max() > 1e-3  # the adapter is in the logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapter_checkpoint_resumes_bit_for_bit(tmp_path, dtype):
    """A fresh model (other adapters) and optimizer loaded from a checkpoint take the same next steps as the run that
    kept going: the adapters' fp32 masters (bf16) and AdamW state are in trainer_state.pt."""
    from fastgrpo.checkpoint import load_checkpoint, save_checkpoint
    from fastgrpo.models.loading import DTYPES
    from fastgrpo.precision import make_optimizer

    model, tok, _ = lora_model(tmp_path, dtype=dtype)
    opt = make_optimizer(model, lr=1e-2)
    train_steps(model, opt)
    path = save_checkpoint(tmp_path / "run", 3, model=model, tokenizer=tok, optimizer=opt, dtype=DTYPES[dtype])
    again, _, _ = lora_model(tmp_path, dtype=dtype)
    with torch.no_grad():
        for p in again.parameters():
            if p.requires_grad:
                p.normal_()
    opt2 = make_optimizer(again, lr=1e-2)
    load_checkpoint(path, model=again, optimizer=opt2)
    train_steps(model, opt, steps=2, seed=9)
    train_steps(again, opt2, steps=2, seed=9)
    for (n, a), b in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(a, b), n


SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations=4", "rollout.max_new_tokens=6", "sft.warmup_steps=0",
         "eval.num_prompts=8", "logging.progress_bar=false", "train.num_threads=1", "model.lora.r=4"]


def test_grpo_reference_is_the_base_with_adapters_disabled(tmp_path, monkeypatch):
    """β > 0 with LoRA: no second model; the reference log-probs the loss receives equal those of the base loaded
    separately (from <run dir>/base), while the adapters (non-zero) change the policy's."""
    import fastgrpo.algorithms.update as U
    from fastgrpo.algorithms.batch import Sample, pack_microbatches
    from fastgrpo.algorithms.forward import packed_forward, packed_logprobs
    from fastgrpo.config import ModelConfig, load_config
    from fastgrpo.distributed import ForwardWrapper
    from fastgrpo.models.loading import load_model
    from fastgrpo.trainer import Trainer

    t = Trainer(load_config(overrides=[*SMALL, "grpo.beta=0.1", f"logging.output_dir={tmp_path}"]))
    t.close()  # the reward workers: not needed here
    assert t.algorithm.ref_model is None and t.algorithm.update.ref_forward is None
    with torch.no_grad():
        for p in t.model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.2)
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(3, 40, (5 + i,), generator=g).tolist(),
                        torch.randint(3, 40, (4 + i % 3,), generator=g).tolist(), [-1.0] * (4 + i % 3), 0.5 - i % 2)
               for i in range(6)]
    seen = []
    real = U.fused_linear_grpo_loss
    monkeypatch.setattr(U, "fused_linear_grpo_loss", lambda *a, **k: seen.append(k["ref_logprobs"]) or real(*a, **k))
    mbs = pack_microbatches(samples, 4096, torch.device("cpu"))
    t.algorithm.update.run(samples, beta=0.1, epsilon_high=None, max_new_tokens=6)
    base, _ = load_model(ModelConfig(path=str(tmp_path / "base")), torch.device("cpu"))
    want = [packed_logprobs(ForwardWrapper(base, packed_forward), mb, 1.0) for mb in mbs]
    policy = [packed_logprobs(ForwardWrapper(t.model, packed_forward), mb, 1.0) for mb in pack_microbatches(
        samples, 4096, torch.device("cpu"))]
    assert len(seen) == len(want) == 1
    torch.testing.assert_close(seen[0], want[0], rtol=0, atol=1e-6)
    assert (policy[0] - want[0]).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_merged_rounds_once_and_eval_takes_the_adapter(tmp_path, dtype):
    """export_merged: W + s·BA in fp32, rounded once, equals PEFT's fp32 merge rounded to the dtype (bit for bit);
    the merged model's logits equal the adapter's. ``python -m fastgrpo.eval`` on the adapter checkpoint gives the
    merged model's accuracy (greedy)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fastgrpo import eval as fg_eval
    from fastgrpo.checkpoint import save_checkpoint
    from fastgrpo.export_merged import main as export_main
    from fastgrpo.models.loading import DTYPES
    from fastgrpo.precision import make_optimizer

    model, tok, _ = lora_model(tmp_path, dtype=dtype)
    opt = make_optimizer(model, lr=3e-2)
    train_steps(model, opt)
    ckpt = save_checkpoint(tmp_path / "run", 3, model=model, tokenizer=tok, optimizer=opt, dtype=DTYPES[dtype])
    assert export_main([str(ckpt), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.dtype == DTYPES[dtype]
    base32 = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    want = PeftModel.from_pretrained(base32, str(ckpt)).merge_and_unload()
    for (n, a), b in zip(merged.state_dict().items(), want.state_dict().values()):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=0, atol=0, msg=n)
    if dtype == "float32":
        ids = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            torch.testing.assert_close(merged(ids).logits, model.eval()(ids).logits, rtol=0, atol=1e-5)
        common = ["--k", "1", "eval.temperature=0", "eval.num_prompts=16", "train.num_threads=1"]
        adapter = fg_eval.main([str(ckpt), *common])
        full = fg_eval.main([str(tmp_path / "merged"), *common])
        assert adapter == full


# ---------------------------------------------------------------- refused at start-up, naming the field


@pytest.mark.parametrize("override,field", [
    ("model.lora.target_modules=[q_proj,lm_head]", "model.lora.target_modules"),
    ("model.lora.target_modules=[embed_tokens]", "model.lora.target_modules"),
    ("model.lora.target_modules=[]", "model.lora.target_modules"),
    ("model.lora.r=0", "model.lora.r"),
    ("model.lora.alpha=0", "model.lora.alpha"),
    ("model.lora.dropout=1.0", "model.lora.dropout"),
    ("model.lora.path=/no/such/adapter", "model.lora.path"),
    ("stages=[{at_step: 0, max_new_tokens: 6, reset_reference: true}]", "stages[0].reset_reference"),
])
def test_bad_lora_config_fails_naming_the_field(override, field):
    from fastgrpo.config import load_config

    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_config(overrides=["model.lora.r=4", override])


def test_dpo_warmup_with_lora_is_refused():
    from fastgrpo.config import load_config

    with pytest.raises(ValueError, match="sft.warmup_steps"):
        load_config("dpo-tiny", overrides=["model.lora.r=4", "sft.warmup_steps=2"])


@pytest.mark.parametrize("field,value", [("use_dora", True), ("bias", "all"), ("bias", "lora_only"),
                                         ("modules_to_save", ["lm_head"]), ("lora_bias", True),
                                         ("target_modules", ["q_proj", "lm_head"])])
def test_unsupported_adapter_files_are_refused_naming_the_field(tmp_path, field, value):
    """An existing adapter (model.lora.path) of a variant the unmerged engine does not compute fails at start-up,
    naming its adapter_config.json field; the engine also refuses such modules when handed a PeftModel directly."""
    from fastgrpo.config import LoRAConfig, ModelConfig
    from fastgrpo.engine.engine import GenerationEngine
    from fastgrpo.models.loading import load_model

    base = tiny_model("qwen2")
    kwargs = {"r": 4, "target_modules": ["q_proj", "v_proj"], field: value}
    peft.get_peft_model(base, peft.LoraConfig(**kwargs)).save_pretrained(tmp_path / "adapter")
    cfg = ModelConfig(path="tiny", lora=LoRAConfig(path=str(tmp_path / "adapter")))
    with pytest.raises(ValueError, match=f"adapter_config.json.{field}"):
        load_model(cfg, torch.device("cpu"))
    if field in ("use_dora", "lora_bias"):
        with pytest.raises(ValueError, match="not supported"):
            GenerationEngine(peft.get_peft_model(tiny_model("qwen2"), peft.LoraConfig(**kwargs)), eos_token_ids=[])


# ---------------------------------------------------------------- the trainer: GRPO, DPO, SFT; one process, FSDP2

def run_train(tmp_path, *overrides, recipe="lora-tiny", nproc=1):
    import os
    import subprocess
    import sys
    from pathlib import Path

    train = Path(__file__).resolve().parents[1] / "fastgrpo" / "train.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(train),
           "--recipe", recipe, "logging.progress_bar=false", "train.num_threads=1", "eval.at_start=false",
           "eval.every_steps=0", f"logging.output_dir={tmp_path / 'run'}", *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from fastgrpo.metrics import read_jsonl

    return [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r], tmp_path / "run"


# a random policy scores 0 everywhere: keep the zero-variance groups so every step trains (its KL term alone)
GRPO_SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations=4", "rollout.max_new_tokens=6",
              "sft.warmup_steps=0", "eval.num_prompts=8", "train.max_steps=2", "grpo.mask_zero_std_groups=false"]


@pytest.mark.parametrize("recipe", ["dpo-tiny", pytest.param("sft-tiny", marks=pytest.mark.slow)])
def test_dpo_and_sft_train_adapters_only(tmp_path, recipe):
    """DPO (its reference: the policy with adapters disabled) and SFT on LoRA: finite losses, an adapter checkpoint,
    the base untouched (the checkpoint holds no base weight)."""
    rows, run = run_train(tmp_path, "model.lora.r=4", "sft.warmup_steps=0", "train.max_steps=2",
                          "eval.num_prompts=8", recipe=recipe)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    ckpt = sorted((run / "checkpoints").iterdir())[-1]
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()


@pytest.mark.slow  # 30 s: 2 processes; FSDP2 in the default tier: test_grpo, test_rm
def test_fsdp2_bf16_grpo_with_kl_to_the_base_and_resume(tmp_path):
    """2 processes, FSDP2, bf16, continuing a random non-zero adapter (model.lora.path): the frozen base stays bf16
    shards, β > 0 takes the reference from the adapters disabled (padded no-grad forwards on every rank), so the KL
    is > 0 from the first step; the adapter checkpoint loads back for a resume that continues the log."""
    from fastgrpo.models.lora import save_adapter

    model, _, _ = lora_model(tmp_path, dtype="bfloat16")
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)
    (tmp_path / "adapter").mkdir()
    save_adapter(model, tmp_path / "adapter", None, torch.bfloat16)
    over = [*GRPO_SMALL, "train.strategy=fsdp2", "model.dtype=bfloat16", "grpo.beta=0.05", "checkpoint.every_steps=1",
            f"model.lora.path={tmp_path / 'adapter'}"]
    rows, run = run_train(tmp_path, *over, nproc=2)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and r["kl"] > 1e-4 for r in rows)
    rows2, _ = run_train(tmp_path, *over, "train.max_steps=3", nproc=2)
    assert len(rows2) == 3 and [r["loss"] for r in rows2[:2]] == [r["loss"] for r in rows[:2]]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_cuda_graph_decode_with_lora_matches_peft(arch):
    """The CUDA path (compiled elementwise ops, the decode step captured in CUDA graphs, the adapters' x·A then ·B
    inside them): greedy == HF generate of the PeftModel, sampled log-probs == its teacher-forced forward (fp32)."""
    from test_generation import hf_greedy, random_prompts, teacher_forced_logp

    from fastgrpo.engine.engine import GenerationEngine, SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    model = random_lora(tiny_model(arch).cuda(), seed=5)
    prompts = random_prompts([5, 11, 3, 8])
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=4)
    greedy = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=24))
    for p, comps in zip(prompts, greedy):
        assert all(c.token_ids == hf_greedy(model, p, 24, None) for c in comps)
    sampled = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=24, seed=1))
    for p, comps in zip(prompts, sampled):
        for c in comps:
            ref = teacher_forced_logp(model, p, c.token_ids).cpu()
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_ddp_two_processes_lora_tiny(tmp_path):
    """2 processes under DDP (bf16: the adapters' fp32 master gradients all-reduced by MasterAdamW): the run trains
    and saves an adapter checkpoint that PEFT's config reader accepts."""
    rows, run = run_train(tmp_path, *GRPO_SMALL, "train.strategy=ddp", "model.dtype=bfloat16", "model.lora.r=4",
                          nproc=2)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    ckpt = sorted((run / "checkpoints").iterdir())[-1]
    assert peft.PeftConfig.from_pretrained(str(ckpt)).r == 4


def test_dpo_reference_table_is_the_base_model(tmp_path):
    """DPO with LoRA (non-zero adapters): the precomputed reference table equals the one a run without LoRA (the
    same base, built from the same seed, a separate model) computes, bit for bit; the adapters do change the
    policy's sequence log-probs."""
    from fastgrpo.config import load_config
    from fastgrpo.trainer import Trainer

    common = ["sft.warmup_steps=0", "train.num_threads=1", "logging.progress_bar=false"]
    lora = Trainer(load_config("dpo-tiny", overrides=[*common, "model.lora.r=4", f"logging.output_dir={tmp_path}/a"]))
    base = Trainer(load_config("dpo-tiny", overrides=[*common, f"logging.output_dir={tmp_path}/b"]))
    with torch.no_grad():
        for p in lora.model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.2)
    ref = lora.algorithm._table("eval")
    assert torch.equal(ref, base.algorithm._table("eval"))
    lora.algorithm.base_reference = False  # the same table from the policy itself: the adapters move it
    assert (lora.algorithm._table("eval") - ref).abs().max() > 1e-2
