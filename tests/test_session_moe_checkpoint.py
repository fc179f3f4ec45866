"""A generation session of a mixture-of-experts model with router replay's record, saved and restored (async GRPO's
checkpoint, ``GenerationSession.state_dict`` / ``load_state_dict``): the record of the groups in flight travels with
the checkpoint (``RoutingLog.state`` / ``restore``), so a restored session gives every completion the routing, tokens
and log-probs the uninterrupted session gives it, bit for bit, and the record is Hugging Face's routing."""

import io

import pytest
import torch
from checks import one_thread  # noqa: F401  (an autouse fixture)
from hypothesis import given, settings
from hypothesis import strategies as st
from test_generation import MOE_ARCH, random_prompts, tiny_model
from test_moe_generation import check_record, router_guard_strict

from fastgrpo.engine.engine import GenerationEngine, SamplingParams


@pytest.mark.parametrize("arch", MOE_ARCH)
@settings(max_examples=8, deadline=None, derandomize=True)
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

    with session() as a:
        a.add(prompts)
        done = a.run(first_groups)  # at least first_groups groups: several can end at one step
        a.update(recompute_kv=True)  # what a checkpoint follows in a run that recomputes (no weight change here)
        buf = io.BytesIO()
        torch.save(a.state_dict(), buf)
        want = dict(a.run(10**6))
    buf.seek(0)
    with session() as b:
        b.load_state_dict(torch.load(buf, weights_only=True))
        got = dict(b.run(10**6))
    assert sorted(got) == sorted(want) and len(got) == len(prompts) - len(done)
    for p, group in got.items():
        for c, w in zip(group, want[p]):
            assert c.token_ids == w.token_ids and c.logprobs == w.logprobs
            assert torch.equal(c.routing, w.routing)
            router_guard_strict(model, prompts[p], c)
            check_record(model, prompts[p], c)
