"""LoRA (fastgrpo/lora.py): the engine reads base + adapters unmerged, the reference is the base with the adapters
disabled, PEFT loads what fastgrpo saves, and the unsupported variants are refused at start-up.

The references are PEFT's own modules run by Hugging Face: a teacher-forced forward and ``generate`` of the
``PeftModel`` (fp32: the engine's products differ from PEFT's by summation order only, ~1e-6, hence the harness's
1e-4), and a base model loaded separately for the reference.
"""

import pytest
import torch
from checks import one_thread  # noqa: F401  (an autouse fixture)
from hypothesis import given, settings
from test_generation import tiny_model
from test_generation_fidelity import cases, check_case

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_lora(model, seed, *, dropout=0.1):
    """A PeftModel with random non-zero A and B (PEFT's init_lora_weights=False: both Kaiming-uniform) of a random
    rank, alpha, rsLoRA choice and target subset; dropout > 0, which generation and eval forwards must not apply."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(TARGETS), generator=g)[: 1 + seed % len(TARGETS)].tolist()
    r = (1, 4, 8)[seed % 3]
    cfg = peft.LoraConfig(r=r, lora_alpha=float(1 + seed % 16), lora_dropout=dropout, use_rslora=bool(seed % 2),
                          target_modules=[TARGETS[i] for i in sorted(pick)], init_lora_weights=False)
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
    from fastgrpo.generation import GenerationEngine, SamplingParams

    model = random_lora(tiny_model("qwen2", seed=1), seed=3)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, seed=0)
    engine = GenerationEngine(model, eos_token_ids=[])
    with_lora = engine.generate([[1, 2, 3]], params)[0][0]
    from fastgrpo.lora import adapters_disabled

    with adapters_disabled(model):
        base = engine.generate([[1, 2, 3]], params)[0][0]
    plain = GenerationEngine(tiny_model("qwen2", seed=1), eos_token_ids=[]).generate([[1, 2, 3]], params)[0][0]
    assert base.token_ids == plain.token_ids
    torch.testing.assert_close(torch.tensor(base.logprobs), torch.tensor(plain.logprobs), atol=1e-5, rtol=0)
    assert max(abs(a - b) for a, b in zip(with_lora.logprobs, base.logprobs)) > 1e-2
