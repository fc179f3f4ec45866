"""The host scheduler without a model: random rollouts (prompt lengths, response lengths, page sizes, pools from the
smallest allowed upwards, sync intervals) driven round by round as the engine drives it. After every round its
invariants hold (reference counts = block tables, written pages private, pages cover the cached tokens); every
sample finishes exactly once with its full length (preempted ones resume where they were); every page is free at
the end; with room for everything, nothing is preempted and each prompt is prefilled once."""

from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.scheduler import Scheduler


@st.composite
def rollouts(draw):
    P = draw(st.integers(1, 5))
    n = draw(st.integers(1, 6))
    prompts = draw(st.lists(st.integers(1, 40), min_size=P, max_size=P))
    limits = draw(st.lists(st.integers(1, 60), min_size=P, max_size=P))
    targets = [[draw(st.integers(1, limits[p])) for _ in range(n)] for p in range(P)]
    page = draw(st.sampled_from([1, 4, 16]))
    steps = draw(st.sampled_from([1, 3, 8]))
    rows = draw(st.integers(1, P * n))
    longest = max(-(-(a + b) // page) for a, b in zip(prompts, limits))
    spare = draw(st.sampled_from([0, 1, 5, 1000]))
    return prompts, n, limits, targets, page, steps, rows, longest + 2 + spare


@settings(max_examples=60)
@given(rollouts())
def test_invariants_and_completion(case):
    prompts, n, limits, targets, page, steps, rows, pages = case
    sched = Scheduler(prompts, n, limits, page, pages, rows)
    target = {p * n + j: targets[p][j] for p in range(len(prompts)) for j in range(n)}
    finished, prefilled = [], 0
    for _ in range(10_000):
        for seq in [s for s in sched.rows if s is not None and s.generated >= target[s.sample]]:
            finished.append((seq.sample, seq.generated))
            sched.finish(seq)
        sched.grow(steps)
        sched.check()
        sched.compact()
        adm = sched.admit(steps)
        prefilled += sum(prompts[p] for p in adm.prefill)
        sched.release_prompts()
        sched.check()
        assert len(sched.rows) <= rows
        if sched.done:
            break
        assert sched.rows, "nothing runs while samples wait: a deadlock"
        for s in sched.rows:
            s.generated = min(s.generated + steps, target[s.sample])
    assert sorted(finished) == sorted(target.items())
    assert sched.used_pages == 0 and not any(sched.refs)
    if pages - 1 >= sum(n * -(-(a + b) // page) + -(-a // page) for a, b in zip(prompts, limits)):
        assert sched.preemptions == 0 and prefilled == sum(prompts)
