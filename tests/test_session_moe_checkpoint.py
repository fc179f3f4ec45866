"""A generation session of a mixture-of-experts model with router replay's record, saved and restored (async GRPO's
checkpoint, ``GenerationSession.state_dict`` / ``load_state_dict``): the record of the groups in flight travels with
the checkpoint (``RoutingLog.state`` / ``restore``), so a restored session gives every completion the routing, tokens
and log-probs the uninterrupted session gives it, bit for bit, and the record is Hugging Face's routing."""

import pytest
import torch
from checks import one_thread  # noqa: F401  (an autouse fixture)
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_generation import MOE_ARCH, random_prompts, tiny_model
from test_generation_session import saved_and_continued
from test_moe_generation import check_record, router_guard_strict

from fastgrpo.engine.engine import GenerationEngine, SamplingParams


@pytest.mark.parametrize("arch", MOE_ARCH)
@settings(max_examples=8, deadline=None, derandomize=True)
@example(first_groups=2, batch=4, sync_every=1, seed=41)  # Qwen3-MoE: a padding row's stale token moved a log-prob
@given(first_groups=st.integers(0, 2), batch=st.integers(1, 4), sync_every=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16))
def test_a_restored_moe_session_keeps_its_routing_record(arch, first_groups, batch, sync_every, seed):
    model = tiny_model(arch, seed=2)
    # 8 stop ids: samples end at staggered times, so the checkpoint finds groups with some samples finished
    stops = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:8].tolist()
    params = SamplingParams(n=3, max_new_tokens=10, seed=seed, stop_token_ids=stops)
    prompts = random_prompts([4, 7, 3, 5], seed=3)

    def session():
        engine = GenerationEngine(model, eos_token_ids=None, max_batch_size=batch, sync_every=sync_every, page_size=4,
                                  record_routing=True)
        return engine.session(params, max_prompt_tokens=8)

    done, want, got = saved_and_continued(session, lambda s: s.add(prompts), first_groups)
    assert sorted(got) == sorted(want) and len(got) == len(prompts) - len(done)
    for p, group in got.items():
        for c, w in zip(group, want[p]):
            assert c.token_ids == w.token_ids and c.logprobs == w.logprobs
            assert torch.equal(c.routing, w.routing)
            router_guard_strict(model, prompts[p], c)
            check_record(model, prompts[p], c)
