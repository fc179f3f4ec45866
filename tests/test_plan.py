"""The memory plan against what autograd saves and what a CPU training step uses, and the DeepScaleR verdict.

- Per layer: the bytes the packed forward of a Qwen2 / Llama / Qwen3 decoder layer saves for backward (unique
  storages seen by ``saved_tensors_hooks``, parameters excluded, attention through the varlen kernel's own autograd
  function as on a GPU) equal ``layer_saved_bytes_per_token`` × tokens exactly, in fp32 and bf16.
- Whole step: the predicted training peak of one micro-batch (``kernel_loss=False``: the CPU loss path) is within
  25% of the resident high-water mark of building the model and running two real ``PolicyUpdate`` steps on CPU
  (``bench/common.peak_extra_bytes``: exact resident-size tracking), for the tiny demo model and a ~30M model.
- Activation figure: the bytes of a 32K-token micro-batch with and without checkpointing, for the 1.5B model (bf16,
  fp32) and Qwen3-1.7B, against the docstring's formula evaluated by hand.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch
from fastgrpo.kernels.varlen_attention import varlen_attention_unchecked
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.config import load_config
from fastgrpo.models import attention
from fastgrpo.models.packing import pack
from fastgrpo.plan import main, memory_plan
from fastgrpo.shapes import layer_saved_bytes_per_token, model_shape, shape_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import peak_extra_bytes  # noqa: E402

QWEN_1P5B = str(Path(__file__).resolve().parent / "data" / "deepseek-r1-distill-qwen-1.5b")
PEAK_RTOL = 0.25


def _hf_model(family: str, dtype: torch.dtype):
    """A small random model of ``family`` with the packed attention (hidden 64, 3 layers, GQA 4/2, head dim 16)."""
    import transformers

    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
    cfg = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
           "qwen3": transformers.Qwen3Config}[family](**kw, **({"head_dim": 16} if family == "qwen3" else {}))
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    attention.enable_packed_attention(model)
    return model


def saved_bytes_per_layer(model) -> tuple[list[int], int]:
    """What the packed training forward of 3 sequences (60 tokens) saves for backward, in bytes per decoder layer
    (each tensor counted once, for the first layer whose forward saved it; parameters not counted), and the token
    count."""
    batch = pack([list(range(1, 20)), list(range(5, 34)), list(range(40, 52))])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    owner: dict[int, int] = {}  # storage -> the first layer whose forward saved it
    nbytes: dict[int, int] = {}
    current = [-1]

    def pack_hook(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in owner:
            owner[ptr], nbytes[ptr] = current[0], t.untyped_storage().nbytes()
        return t

    layers = model.get_decoder().layers
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, -1))
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        attention.packed_hidden_states(model, batch)
    return [sum(n for p, n in nbytes.items() if owner[p] == i) for i in range(len(layers))], batch.input_ids.numel()


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_saved_bytes_match_autograd(monkeypatch, family, dtype):
    # the GPU's attention: the varlen kernel's autograd function (the interpreter runs it on CPU)
    monkeypatch.setattr(attention, "varlen_attention_torch", varlen_attention_unchecked)
    model = _hf_model(family, dtype).train()
    per_layer, T = saved_bytes_per_layer(model)
    layers = model.get_decoder().layers
    expected = layer_saved_bytes_per_token(shape_of(model), dtype.itemsize) * T
    # layer 0 also saves what every layer shares (rotary cos / sin, the offsets): the later layers are exact
    assert per_layer[1:] == [expected] * (len(layers) - 1)
    assert expected <= per_layer[0] <= expected + 8 * 16 * T + 64


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_layer_saved_bytes_match_autograd(monkeypatch, dtype, family):
    """A Qwen3-MoE model (layer 1 dense, layers 0 and 2 MoE: 8 experts of width 24, top-2 renormalised) and a
    Qwen2-MoE one (the same, top-2 not renormalised, a shared expert of width 40, q/k/v biases) through fastgrpo's
    grouped experts: the later MoE layer saves exactly ``layer_saved_bytes_per_token(moe_layer=True)`` (the router's
    softmax, ids and renormalisation, the routing weights, the experts' gate/up pre-activations, the shared expert's
    MLP, output and gate), the dense layer the dense figure."""
    import transformers

    from fastgrpo.models.moe import enable_moe

    monkeypatch.setattr(attention, "varlen_attention_torch", varlen_attention_unchecked)
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
              mlp_only_layers=[1], max_position_embeddings=256)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**kw, head_dim=16, norm_topk_prob=True)
    else:
        cfg = transformers.Qwen2MoeConfig(**kw, shared_expert_intermediate_size=40)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    attention.enable_packed_attention(model)
    enable_moe(model)
    per_layer, T = saved_bytes_per_layer(model.train())
    s = shape_of(model)
    assert per_layer[1] == layer_saved_bytes_per_token(s, dtype.itemsize) * T
    assert per_layer[2] == layer_saved_bytes_per_token(s, dtype.itemsize, moe_layer=True) * T


def _policy_step_peak(cfg, seq_len: int) -> int:
    """Peak extra resident bytes of: build the model, its optimizer, and two GRPO updates of two full micro-batches
    each (the second micro-batch runs with the first one's accumulated gradients in place, as in a real step)."""
    from fastgrpo.algorithms.batch import Sample
    from fastgrpo.algorithms.forward import packed_forward
    from fastgrpo.algorithms.update import PolicyUpdate
    from fastgrpo.distributed import init_distributed, wrap_model
    from fastgrpo.models.loading import load_model
    from fastgrpo.precision import make_optimizer

    def run():
        st = init_distributed("cpu")
        model, _ = load_model(cfg.model, st.device, seed=0)
        wrapped = wrap_model(model, st, "none", forward=packed_forward)
        opt = make_optimizer(wrapped, lr=1e-4)  # bf16: fp32 masters (MasterAdamW), as the trainer
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        update = PolicyUpdate(cfg, wrapped, opt, sched, None, st.device, 1)
        g = torch.Generator().manual_seed(0)
        V = model.config.vocab_size
        n = 2 * (cfg.train.max_tokens_per_microbatch // seq_len)  # two full micro-batches per optimizer step
        P = cfg.data.max_prompt_tokens
        samples = [Sample(torch.randint(1, V, (P,), generator=g).tolist(),
                          torch.randint(1, V, (seq_len - P,), generator=g).tolist(), [-1.0] * (seq_len - P),
                          float(i % 3 - 1)) for i in range(n)]
        for _ in range(2):  # the second one runs with the optimizer state in place: the steady state
            update.run(samples, beta=0.0, epsilon_high=0.28, max_new_tokens=seq_len - P)
        return model

    return peak_extra_bytes(run, "cpu")


@pytest.mark.parametrize("size,dtype", [
    ("tiny", "float32"), ("30m", "float32"),
    # bf16 matmuls are slow on CPUs without AVX-512 BF16 (33 s for the 10m model on an AMD EPYC)
    pytest.param("10m", "bfloat16", marks=pytest.mark.slow), pytest.param("30m", "bfloat16", marks=pytest.mark.slow),
])
def test_cpu_peak_matches_plan(monkeypatch, size, dtype):
    for name in ("linear_logprobs", "grpo_loss"):  # the CPU trainer's loss path (the suite runs the interpreter)
        monkeypatch.setattr(importlib.import_module(f"fastgrpo.kernels.{name}"), "use_triton", lambda t: False)
    torch.set_num_threads(1)
    seq_len = 128
    over = [f"model.dtype={dtype}", "data.max_prompt_tokens=32", f"rollout.max_new_tokens={seq_len - 32}",
            "grpo.num_prompts_per_step=1", "grpo.num_generations=2", "rollout.max_batch_size=2"]
    if size == "tiny":
        over += ["train.max_tokens_per_microbatch=4096"]
    else:  # 28.3M parameters (8 layers) or 10.2M (2 layers), an 8K vocabulary
        over += ["train.max_tokens_per_microbatch=512", "model.tiny_hidden_size=512",
                 f"model.tiny_num_layers={8 if size == '30m' else 2}", "model.tiny_num_heads=8",
                 "model.tiny_num_kv_heads=2", "model.tiny_intermediate_size=1536"]
    cfg = load_config("tiny", overrides=over)
    if size != "tiny":
        monkeypatch.setattr("fastgrpo.models.loading.build_tiny_tokenizer", lambda: _Vocab(8192))
    plan = memory_plan(cfg, 1, 80, activation_checkpointing=False, kernel_loss=False, shape=model_shape(cfg))
    measured = _policy_step_peak(cfg, seq_len)
    predicted = plan.training_peak
    print(f"{size} {dtype} ({plan.shape.params / 1e6:.1f}M parameters, {plan.tokens} tokens): predicted "
          f"{predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert abs(measured - predicted) <= PEAK_RTOL * measured, (size, predicted / 2**20, measured / 2**20)


class _Vocab:
    """Stands in for the tiny tokenizer where only its size and special ids matter (the ~30M model's 8K vocab)."""

    def __init__(self, size: int):
        self.size = size
        self.eos_token_id = self.pad_token_id = 0

    def __len__(self):
        return self.size


def test_deepscaler_fits_8x80():
    """The recipe as shipped (fsdp2, activation checkpointing, a decoding batch of 80) fits 8 x 80 GiB."""
    cfg = load_config("deepscaler-1.5b", overrides=[f"model.path={QWEN_1P5B}"])
    s = model_shape(cfg)
    assert (s.params, s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.vocab) == (
        1_777_088_000, 28, 1536, 12, 2, 128, 151936)
    plan = memory_plan(cfg, 8, 80, shape=s)
    assert plan.fits, plan.verdict()
    assert plan.kv_bytes_per_token == 2 * 28 * 2 * 128 * 2
    # without checkpointing a 32K-token micro-batch alone needs ~85 GiB: the cure names checkpointing
    bare = memory_plan(cfg, 8, 80, activation_checkpointing=False, shape=s)
    assert not bare.fits and "train.activation_checkpointing=true" in bare.verdict()
    # the same under ddp leaves too little for the KV cache: the cure names the batch and fsdp2
    ddp = memory_plan(load_config("deepscaler-1.5b", overrides=[f"model.path={QWEN_1P5B}", "train.strategy=ddp"]),
                      8, 80, activation_checkpointing=True, shape=s)
    assert not ddp.fits and "rollout.max_batch_size<=" in ddp.verdict() and "fsdp2" in ddp.verdict()


def test_async_deepscaler_holds_its_pool_through_the_update():
    """deepscaler-1.5b-async fits 8 x 80 GiB with its session's pool in the training peak (the sync plan's peak plus
    rollout.max_total_tokens x 28 KiB); with a micro-batch twice as large the update does not fit next to the pool,
    and the cure is the pool that leaves it room."""
    cfg = load_config("deepscaler-1.5b-async", overrides=[f"model.path={QWEN_1P5B}"])
    s = model_shape(cfg)
    plan = memory_plan(cfg, 8, 80, shape=s)
    sync_cfg = load_config("deepscaler-1.5b-async",
                           overrides=[f"model.path={QWEN_1P5B}", "grpo.async_grpo.enabled=false"])
    sync = memory_plan(sync_cfg, 8, 80, shape=s)
    pool = cfg.rollout.max_total_tokens * 2 * 28 * 2 * 128 * 2
    assert plan.fits, plan.verdict()
    assert plan.session_pool == plan.kv_cache == pool and plan.training_peak == sync.training_peak + pool
    assert plan.kv_sequences >= cfg.rollout.max_batch_size and sync.session_pool == 0
    big = memory_plan(load_config("deepscaler-1.5b-async", overrides=[f"model.path={QWEN_1P5B}",
                                                                       "train.max_tokens_per_microbatch=65536"]),
                      8, 80, shape=s)  # 7.5 GiB more activations than the pool leaves room for
    room = (big.usable - big.training_peak + pool) // plan.kv_bytes_per_token  # tokens the update leaves
    assert not big.fits and f"rollout.max_total_tokens<={room} " in big.verdict()


def _qwen3_1p7b_shape():
    """Qwen3-1.7B's shape (its config.json: hidden 2048, MLP 6144, 28 layers, 16 / 8 heads of 128, q_norm / k_norm,
    tied embeddings), read from a meta-device model."""
    import transformers

    hf = transformers.Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    with torch.device("meta"):
        return shape_of(transformers.AutoModelForCausalLM.from_config(hf))


# Per-token activation bytes from the module docstring, evaluated by hand (c: compute dtype bytes, L = 28 layers).
# A = norms 2·(4h + 4 + 2ch) + [Qwen3] (4 + c)(n_q + n_kv)d + 4(n_q + n_kv) + attention c(2n_q + 2n_kv)d + 4n_q
#     + MLP 4cI;  once = (4h + 4 + ch) + ch + 2cd + 48;  transient = c(2I + 2h)
# checkpointing keeps L·c·h + A, else L·A; each plus once + transient.
ACTIVATION_CASES = {
    # DeepSeek-R1-Distill-Qwen-1.5B, bf16: h 1536, 12 / 2 heads of 128, I 8960
    # A = 24584 + 0 + (7168 + 48) + 71680 = 103480; once = 9220 + 3072 + 512 + 48 = 12852; transient = 41984
    # with: 28·3072 + 103480 = 189496 -> 244332;  without: 28·103480 = 2897440 -> 2952276
    "qwen2-1.5b-bf16": (QWEN_1P5B, "bfloat16", None, 244_332, 2_952_276),
    # the same in fp32: A = 36872 + (14336 + 48) + 143360 = 194616; once = 12292 + 6144 + 1024 + 48 = 19508;
    # transient = 83968; with: 28·6144 + 194616 = 366648 -> 470124;  without: 28·194616 = 5449248 -> 5552724
    "qwen2-1.5b-fp32": (QWEN_1P5B, "float32", None, 470_124, 5_552_724),
    # Qwen3-1.7B, bf16: h 2048, 16 / 8 heads of 128, I 6144, q_norm / k_norm
    # A = 32776 + (18432 + 96) + (12288 + 64) + 49152 = 112808; once = 12292 + 4096 + 512 + 48 = 16948;
    # transient = 32768; with: 28·4096 + 112808 = 227496 -> 277212;  without: 28·112808 = 3158624 -> 3208340
    "qwen3-1.7b-bf16": (QWEN_1P5B, "bfloat16", _qwen3_1p7b_shape, 277_212, 3_208_340),
}


@pytest.mark.parametrize("case", ACTIVATION_CASES, ids=list(ACTIVATION_CASES))
def test_activation_figure_with_and_without_checkpointing(case):
    """The activation bytes of the DeepScaleR micro-batch (32768 tokens, checkpointing on as shipped), the number
    itself against the docstring's formula evaluated by hand, with and without checkpointing."""
    path, dtype, shape, with_ckpt, without = ACTIVATION_CASES[case]
    cfg = load_config("deepscaler-1.5b", overrides=[f"model.path={path}", f"model.dtype={dtype}"])
    plan = memory_plan(cfg, 8, 80, shape=shape() if shape else model_shape(cfg))
    assert plan.checkpointing and plan.tokens == 32768
    assert plan.activations == 32768 * with_ckpt
    assert plan.activations_other == 32768 * without
    off = memory_plan(cfg, 8, 80, activation_checkpointing=False, shape=plan.shape)
    assert (off.activations, off.activations_other) == (plan.activations_other, plan.activations)


@pytest.mark.parametrize("recipe", ["dpo-1.5b", "sft-1.5b"])
def test_other_1p5b_recipes_fit_8x80(recipe):
    """DPO keeps a frozen reference and SFT neither that nor a generation phase; both fit as shipped."""
    cfg = load_config(recipe, overrides=[f"model.path={QWEN_1P5B}"])
    plan = memory_plan(cfg, 8, 80)
    assert plan.fits and plan.batch == 0, plan.verdict()
    assert plan.reference == (2 * plan.shape.params if recipe == "dpo-1.5b" else 0)


def test_cli_exit_code_and_last_line(capsys):
    assert main(["--recipe", "tiny", "--nproc", "1", "--gpu-memory-gib", "8"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("fits: ")
    assert main(["--recipe", "tiny", "train.max_tokens_per_microbatch=400000", "--gpu-memory-gib", "1"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("does not fit: ") and "train.max_tokens_per_microbatch<=" in last
    with pytest.raises(ValueError, match="--nproc"):
        main(["--recipe", "tiny", "--nproc", "0"])


def test_trainer_check_stops_on_cuda_when_it_does_not_fit(monkeypatch):
    """The start-up check (CUDA only) raises SystemExit with the plan's verdict; CPU runs are never stopped."""
    from types import SimpleNamespace

    from fastgrpo.plan import check_fits

    cfg = load_config("tiny", overrides=["train.max_tokens_per_microbatch=400000"])
    check_fits(cfg, 1, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=2**30))
    with pytest.raises(SystemExit, match="does not fit: .*train.max_tokens_per_microbatch<="):
        check_fits(cfg, 1, torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * 2**30))
    check_fits(cfg, 1, torch.device("cuda", 0))


# ---------------------------------------------------------------- LoRA (fastgrpo.models.lora)

QWEN_7B = {name: str(Path(__file__).resolve().parent / "data" / name)
           for name in ("deepseek-r1-distill-qwen-7b", "qwen2.5-7b")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_params_and_saved_bytes_match_peft_and_autograd(monkeypatch, dtype):
    """With LoRA on the seven projections: the plan's adapter count is PEFT's, and a decoder layer saves exactly the
    full fine-tune's bytes plus each adapter's ``x·A`` (``c·r`` per token and projection), minus the normalised rows
    the two frozen RMSNorms no longer keep for their weights' gradient (``2·c·h``); the frozen base's products no
    longer save their input, but ``lora_A`` saves that same tensor."""
    import peft

    from fastgrpo.config import LORA_TARGETS
    from fastgrpo.shapes import lora_params

    monkeypatch.setattr(attention, "varlen_attention_torch", varlen_attention_unchecked)
    r = 8
    model = peft.get_peft_model(_hf_model("qwen2", dtype), peft.LoraConfig(r=r, target_modules=list(LORA_TARGETS)),
                                autocast_adapter_dtype=False).get_base_model().train()
    cfg = load_config("tiny", overrides=[f"model.lora.r={r}"])
    base_shape = shape_of(_hf_model("qwen2", dtype))
    assert lora_params(base_shape, cfg) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    per_layer, T = saved_bytes_per_layer(model)
    layers = model.get_decoder().layers
    c = dtype.itemsize
    expected = (layer_saved_bytes_per_token(base_shape, c) + c * r * len(LORA_TARGETS) - 2 * c * base_shape.hidden) * T
    assert per_layer[1:] == [expected] * (len(layers) - 1)


@pytest.mark.parametrize("name", QWEN_7B)
def test_lora_7b_verdicts(name):
    """LoRA r = 64 under the DeepScaleR 8K stage (lora-deepscaler-7b): fits 1 x 80 and 8 x 80 GiB, with no reference
    copy and the adapters' masters / AdamW / gradients alone (16 bytes a parameter, 161.5M); the full fine-tune of
    the same model does not fit one GPU."""
    cfg = load_config("lora-deepscaler-7b", overrides=[f"model.path={QWEN_7B[name]}"])
    s = model_shape(cfg)
    assert (s.params, s.layers, s.hidden, s.heads, s.kv_heads, s.intermediate, s.vocab) == (
        7_615_616_512, 28, 3584, 28, 4, 18944, 152064)  # the published 7.6B
    one, eight = memory_plan(cfg, 1, 80, shape=s), memory_plan(cfg, 8, 80, shape=s)
    p = 28 * 64 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944))  # q, o; k, v; gate, up, down
    assert one.adapter_params == eight.adapter_params == p == 161_480_704
    assert (one.masters, one.optimizer, one.gradients, one.reference) == (4 * p, 8 * p, 4 * p, 0)
    assert one.fits and eight.fits, (one.verdict(), eight.verdict())
    full = memory_plan(load_config("lora-deepscaler-7b", overrides=[f"model.path={QWEN_7B[name]}", "model.lora=null"]),
                       1, 80, shape=s)
    assert not full.fits


def test_the_plan_counts_a_qwen2_moe_shared_expert_as_active():
    """Qwen1.5-MoE-A2.7B (transformers' ``Qwen2MoeConfig`` defaults: 24 layers of 60 experts of width 1408, top-4, a
    shared expert of width 5632, q/k/v biases) on the meta device: its parameters summed by hand, the active ones all
    but the 56 unchosen experts of every layer (the shared expert and its gate always run), 14.3B and 2.7B as Qwen
    publishes them; a shared expert's bytes in the block's saved bytes and transient."""
    import transformers

    with torch.device("meta"):
        s = shape_of(transformers.AutoModelForCausalLM.from_config(transformers.Qwen2MoeConfig()))
    H, L, E, K, I, I_s, V = 2048, 24, 60, 4, 1408, 5632, 151936
    layer = 4 * H * H + 3 * H + 2 * H + E * H + E * 3 * H * I + 3 * H * I_s + H  # attn + biases, norms, router, ...
    assert s.params == L * layer + 2 * V * H + H
    assert s.active_params == s.params - L * (E - K) * 3 * H * I
    assert (round(s.params / 1e8), round(s.active_params / 1e8)) == (143, 27)
    m, c = s.moe, 2
    assert (m.shared_intermediate, m.layers, m.norm_topk_prob) == (I_s, L, False)
    assert m.saved_bytes_per_token(c, H) == 4 * E + (12 + c) * K + 2 * c * K * I + c * (4 * I_s + H + 1)
    assert m.transient_bytes_per_token(c, H) == max(c * K * (3 * I + H), c * (3 * I_s + H))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_lora_params_of_an_moe_model_match_peft(family):
    """LoRA on a tiny MoE model with a dense layer between two MoE layers: the plan's count is PEFT's. Qwen2-MoE: the
    seven projections (the MLP targets adapt the dense layer and the shared experts); Qwen3-MoE: the attention's (PEFT
    maps its MLP targets onto the fused experts, which ``fastgrpo.models.lora.check_modules`` refuses at load)."""
    import peft
    import transformers

    from fastgrpo.config import LORA_TARGETS
    from fastgrpo.shapes import lora_params

    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
              mlp_only_layers=[1], max_position_embeddings=256)
    cfg = (transformers.Qwen3MoeConfig(**kw, head_dim=16) if family == "qwen3_moe"
           else transformers.Qwen2MoeConfig(**kw, shared_expert_intermediate_size=40))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    s = shape_of(model)
    targets = list(LORA_TARGETS) if family == "qwen2_moe" else ["q_proj", "k_proj", "v_proj", "o_proj"]
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets))
    want = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    cfg = load_config("tiny", overrides=["model.lora.r=8", f"model.lora.target_modules=[{','.join(targets)}]"])
    assert lora_params(s, cfg) == want


@pytest.mark.parametrize("recipe", ["moe-tiny", "sft-tiny", "dpo-tiny"])
def test_the_router_logits_of_the_aux_loss_count_in_every_algorithm(recipe):
    """The load-balancing loss keeps each MoE layer's ``[T, E]`` router logits until the loss, in GRPO, SFT and DPO
    alike: ``T·c·E·L_moe`` more activation bytes with a coefficient than without (fp32 tiny MoE)."""
    plans = [memory_plan(load_config(recipe, overrides=["model.moe.tiny_num_experts=8",
                                                        f"model.moe.router_aux_loss_coef={coef}"]), 1, 80)
             for coef in (0.01, 0.0)]
    m = plans[0].shape.moe
    assert plans[0].activations - plans[1].activations == plans[0].tokens * 4 * m.experts * m.layers > 0


@pytest.mark.parametrize("tied", [False, True])
def test_batch_invariant_mode_adds_its_grids_and_temporaries(tied):
    """``numerics.batch_invariant`` on the 1.5B recipe under ddp: the static part grows by the
    fp64 weight grids, 8 bytes an entry of every parameter of the meta model but an untied input embedding (11.5 GiB);
    generation by twice the attention's 1 GiB bound, the gathered pages' quarter of it (bf16), a prefill chunk's
    fp64 products ``8·n·(h + I)`` and the LM head's ``8·batch·V``; training by twice the bound and ``8·T·(h + I)``;
    the KV cache the rest allows shrinks by the generation's share."""
    import math

    from fastgrpo.engine.engine import PREFILL_CHUNK_TOKENS

    overrides = [f"model.path={QWEN_1P5B}", "train.strategy=ddp"]
    off_cfg = load_config("deepscaler-1.5b", overrides=overrides)
    on_cfg = load_config("deepscaler-1.5b", overrides=[*overrides, "numerics.batch_invariant=true"])
    with torch.device("meta"):
        import transformers

        hf = transformers.AutoConfig.from_pretrained(QWEN_1P5B)
        hf.tie_word_embeddings = tied
        model = transformers.AutoModelForCausalLM.from_config(hf)
    s = shape_of(model)
    assert s.tied == tied
    grids = 8 * sum(p.numel() for n, p in model.named_parameters() if tied or n != "model.embed_tokens.weight")
    assert grids / 2**30 == pytest.approx(11.5, abs=0.01)  # tied: the head's matrix is the embedding's, counted once
    off, on = memory_plan(off_cfg, 8, 141, shape=s), memory_plan(on_cfg, 8, 141, shape=s)
    assert on.static - off.static == grids
    h, inter, V, chunk = 1536, 8960, 151936, 1 << 30
    prompt_tokens = min(math.ceil(on_cfg.grpo.prompts_per_gen_batch / 8) * 1024, max(PREFILL_CHUNK_TOKENS, 8192))
    gen = 2 * chunk + chunk // 4 + 8 * prompt_tokens * (h + inter) + 8 * on.batch * V
    assert on.generation_base - off.generation_base == grids + gen
    widest = 8 * h * inter  # the reference model's products (grpo.beta > 0) make their weights' grids, one at a time
    assert on.training_peak - off.training_peak == grids + 2 * chunk + 8 * 32768 * (h + inter) + widest
    assert off.kv_cache - on.kv_cache == grids + gen and on.batch == 80
    rows = [[line for line in plan.lines() if "batch-invariant weight grids" in line] for plan in (off, on)]
    assert rows[0] == [] and "11.502 GiB" in rows[1][0]
    # fsdp2: the gathered weights' grids for a generation call only; none kept through training
    shard = [f"model.path={QWEN_1P5B}", "train.strategy=fsdp2"]
    f_off = memory_plan(load_config("deepscaler-1.5b", overrides=shard), 8, 141, shape=s)
    f_on = memory_plan(load_config("deepscaler-1.5b", overrides=[*shard, "numerics.batch_invariant=true"]), 8, 141,
                       shape=s)
    assert f_on.static == f_off.static and f_on.invariant_grids == 0
    assert f_on.generation_base - f_off.generation_base == grids + gen
    assert f_on.training_peak - f_off.training_peak == 2 * chunk + 8 * 32768 * (h + inter) + widest


@settings(derandomize=True, max_examples=30, deadline=None)
@given(gib=st.integers(40, 160), share=st.floats(0.0, 2.0), async_grpo=st.booleans(),
       microbatch=st.sampled_from([32768, 49152]))
def test_a_set_kv_pool_must_fit_beside_generation(gib, share, async_grpo, microbatch):
    """``rollout.max_total_tokens`` set (drawn as a share of the room generation leaves, 0 to 2x) is the KV cache: an
    async session allocates it whole, a synchronous call at most what its samples fill (``call_tokens``). The
    generation peak counts exactly that pool; when it overflows generation's room the plan does not fit and its cure
    is the largest pool that fits beside generation and (async) beside the update, and that pool, applied, fits
    beside generation; a batch cure, when named, counts the sequences that pool holds."""
    recipe = "deepscaler-1.5b-async" if async_grpo else "deepscaler-1.5b"

    def plan_with(tokens: int):
        overrides = [f"model.path={QWEN_1P5B}", f"rollout.max_total_tokens={tokens}",
                     f"train.max_tokens_per_microbatch={microbatch}"]
        return memory_plan(load_config(recipe, overrides=overrides), 8, gib, shape=_QWEN_1P5B_SHAPE)

    unset = plan_with(0)
    per_token, room = unset.kv_bytes_per_token, unset.usable - unset.generation_base
    assert unset.user_pool == 0 and (async_grpo or unset.kv_cache == max(0, room))
    tokens = max(2, int(share * room / per_token))
    plan = plan_with(tokens)
    pool = tokens if async_grpo else min(tokens, plan.call_tokens)
    assert plan.generation_base == unset.generation_base
    assert plan.kv_cache == plan.user_pool == pool * per_token
    assert plan.generation_peak == plan.generation_base + pool * per_token
    fits_beside = pool * per_token <= room
    assert plan.fits == (fits_beside and plan.kv_sequences >= plan.batch and plan.training_peak <= plan.usable
                         and plan.scoring_peak <= plan.usable)
    update_room = plan.usable - (plan.training_peak - plan.session_pool)  # async: the update holds the pool
    best = min(room, update_room if async_grpo else room) // per_token
    assert plan.pool_room == max(best, 0)
    verdict = plan.verdict()
    if not fits_beside:
        assert f"rollout.max_total_tokens<={best} (the KV pool" in verdict, verdict
        assert plan_with(best).generation_fits
    for wanted in re.findall(r"rollout\.max_total_tokens>=(\d+)", verdict):  # the batch's pool fits both phases
        assert int(wanted) <= best
    held = re.search(r"rollout\.max_batch_size<=(\d+)", verdict)
    if held:
        assert int(held.group(1)) == min(plan.kv_sequences, best // plan.seq_len) < plan.batch


_QWEN_1P5B_SHAPE = model_shape(load_config("deepscaler-1.5b", overrides=[f"model.path={QWEN_1P5B}"]))


def test_a_synchronous_pool_counts_what_a_call_can_fill():
    """A synchronous call allocates at most every sample of a generation batch at full length (CUDA's 64-token
    pages, and a scratch page): a pool set far above that counts that much, and the async recipe's pool on a
    synchronous run fits 8 x 48 GiB, where counting it whole refused it."""
    cfg = load_config("deepscaler-1.5b", overrides=[f"model.path={QWEN_1P5B}", "grpo.num_prompts_per_step=32",
                                                    "rollout.max_total_tokens=1769472"])
    plan = memory_plan(cfg, 8, 48, shape=_QWEN_1P5B_SHAPE)
    g = cfg.grpo
    seq = plan.seq_len
    assert plan.call_tokens == -(-g.prompts_per_gen_batch // 8) * g.num_generations * -(-seq // 64) * 64 + 64
    assert plan.user_pool == min(1769472, plan.call_tokens) * plan.kv_bytes_per_token
    assert plan.fits, plan.verdict()


def test_generation_base_alone_over_the_gpu_names_no_pool():
    """When generation's base alone leaves no room for one sequence the cure is more memory (or fsdp2), never a
    pool of 0 tokens, nor the reward models' pass of a run that has none; DPO and SFT, which do not generate, get no
    KV cure at all."""
    gen = memory_plan(load_config("deepscaler-1.5b", overrides=[f"model.path={QWEN_1P5B}"]), 1, 16,
                      shape=_QWEN_1P5B_SHAPE)
    assert not gen.fits and "a GPU with more memory" in gen.verdict()
    assert "max_total_tokens<=0" not in gen.verdict() and "max_batch_size<=0" not in gen.verdict()
    assert gen.reward_pass == 0 and "reward models' pass" not in gen.verdict()  # none to blame
    for recipe, gib in (("dpo-1.5b", 16), ("sft-1.5b", 8)):
        plan = memory_plan(load_config(recipe, overrides=[f"model.path={QWEN_1P5B}"]), 1, gib, shape=_QWEN_1P5B_SHAPE)
        assert plan.batch == 0 and plan.generation_fits
        assert "max_total_tokens" not in plan.verdict() and "max_batch_size" not in plan.verdict()


def test_the_trainer_check_stops_a_kv_pool_the_gpu_cannot_hold(monkeypatch):
    """The start-up check (CUDA) stops an async run whose ``rollout.max_total_tokens`` pool (allocated whole) does
    not fit beside generation, naming the pool that fits; the same run unset passes, and so does a synchronous run
    with that pool (its call fills a few pages of it)."""
    from types import SimpleNamespace

    from fastgrpo.plan import check_fits

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=2**30))
    check_fits(load_config("async-tiny"), 1, torch.device("cuda", 0))
    check_fits(load_config("tiny", overrides=["rollout.max_total_tokens=40000000"]), 1, torch.device("cuda", 0))
    with pytest.raises(SystemExit, match=r"does not fit: .*rollout\.max_total_tokens<=\d+ \(the KV pool of 40000000"):
        check_fits(load_config("async-tiny", overrides=["rollout.max_total_tokens=40000000"]), 1,
                   torch.device("cuda", 0))
