"""The host scheduler without a model: random rollouts (prompt lengths, response lengths, page sizes, pools from the
smallest allowed upwards, sync intervals) driven round by round as the engine drives it. After every round its
invariants hold (reference counts = block tables, written pages private, pages cover the cached tokens); every
sample finishes exactly once with its full length (preempted ones resume where they were); every page is free at
the end; with room for everything, nothing is preempted and each prompt is prefilled once. Against a model of the
policy kept by the test (the engine's outputs are the same whichever sample is preempted, so only this level sees it):
the pages reserved for the next ``steps`` tokens, exactly, and the preemption victims (the latest admitted, no more
than the shortage needs, requeued at the front)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.engine.scheduler import Scheduler


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


def written_positions(seq, steps: int) -> range:
    """The cache positions the next ``steps`` decode steps of ``seq`` may write: each step feeds its last token, at
    position ``prompt_len + generated − 1``, and a row that reached its limit keeps writing its last token's
    position ``prompt_len + limit − 1`` until the host harvests it."""
    first = seq.prompt_len + seq.generated - 1
    return range(first, min(first + steps, seq.prompt_len + seq.limit))


def check_reservation(sched, steps: int) -> None:
    """Every running sample holds exactly the pages up to the last position its next ``steps`` steps may write (not
    one fewer: the write would miss its page; not one more: the pool is what limits the batch), and the pages written
    are its private ones."""
    for s in sched.rows:
        if s is None:
            continue
        pos = written_positions(s, steps)
        assert len(s.pages) == pos[-1] // sched.page_size + 1, (s.sample, s.generated, len(s.pages))
        assert pos[0] // sched.page_size >= s.shared, "a sample would write into its prompt's shared pages"


def freed_pages(refs: list[int], tables: list[list[int]]) -> int:
    """Pages that return to the pool when the block ``tables`` are dropped: those no one else references."""
    count: dict[int, int] = {}
    for pages in tables:
        for pg in pages:
            count[pg] = count.get(pg, 0) + 1
    return sum(refs[pg] == k for pg, k in count.items())


def shortage(running, held: dict[int, list[int]], steps: int, page_size: int) -> int:
    """Pages the running samples lack for their next ``steps`` steps (from :func:`written_positions`), ``held``:
    each one's block table."""
    return sum(max(0, written_positions(s, steps)[-1] // page_size + 1 - len(held[s.sample])) for s in running)


@settings(max_examples=150)
@given(rollouts())
def test_reservation_and_preemption_order(case):
    """Driven as the engine drives it, against a model of the policy kept by the test: after every round each running
    sample holds the pages of the positions its next ``steps`` tokens write, exactly; when the pool runs dry the
    samples preempted are the latest admitted, latest first, and only as many as the shortage needs (with the ones
    before the last still short), and they wait at the front of the queue in their admission order."""
    prompts, n, limits, targets, page, steps, rows, pages = case
    sched = Scheduler(prompts, n, limits, page, pages, rows)
    target = {p * n + j: targets[p][j] for p in range(len(prompts)) for j in range(n)}
    order: list[int] = []  # running samples in admission order, as the test saw them admitted
    for _ in range(10_000):
        for seq in [s for s in sched.rows if s is not None and s.generated >= target[s.sample]]:
            order.remove(seq.sample)
            sched.finish(seq)
        running = [s for s in sched.rows if s is not None]
        refs, free, held = list(sched.refs), len(sched.free), {s.sample: list(s.pages) for s in running}
        preempted = [seq for seq, _ in sched.grow(steps)]
        k = len(preempted)
        by_sample = {s.sample: s for s in running}
        latest = [by_sample[i] for i in reversed(order)]  # latest admitted first
        assert [s.sample for s in preempted] == [s.sample for s in latest[:k]], "not the latest admitted"
        room = [free + freed_pages(refs, [held[s.sample] for s in latest[:j]]) for j in range(k + 1)]  # j preempted
        for j in range(k):  # each victim was needed: without it the pool was still short
            assert shortage(latest[j:], held, steps, page) > room[j]
        if len(running) - k > 1:  # and no more than needed (one left: its prompts' holders go instead)
            assert shortage(latest[k:], held, steps, page) <= room[k]
        assert [s.sample for s in list(sched.waiting)[:k]] == order[len(order) - k :], "requeued at the front"
        del order[len(order) - k :]
        check_reservation(sched, steps)
        sched.compact()
        before = len(sched.rows)
        sched.admit(steps)
        order += [s.sample for s in sched.rows[before:]]  # admitted rows are appended in admission order
        sched.release_prompts()
        check_reservation(sched, steps)
        assert order == [s.sample for s in sorted(sched.rows, key=lambda s: s.admitted)]
        if sched.done:
            break
        for s in sched.rows:
            s.generated = min(s.generated + steps, target[s.sample])
    assert sched.done


def test_preempts_the_latest_admitted_by_hand():
    """One 4-token prompt (one full shared page of 4), three samples, 6 free pages, 4 steps per round: the three are
    admitted (prompt page + one private page each: 4 used); after 4 steps each needs a third page for positions 8-11
    (3 short, 2 free): the last admitted (sample 2) is preempted, its private page freed, and the other two grow."""
    sched = Scheduler([4], 3, [12], page_size=4, num_pages=7, max_running=3)
    adm = sched.admit(4)
    sched.release_prompts()
    assert [s.sample for s in adm.fresh] == [0, 1, 2] and sched.used_pages == 4
    for s in sched.rows:
        s.generated = 5
    preempted = sched.grow(4)
    assert [(s.sample, row) for s, row in preempted] == [(2, 2)]
    assert [s.sample for s in sched.waiting] == [2] and sched.used_pages == 5
    assert [len(s.pages) for s in sched.rows if s is not None] == [3, 3]


@st.composite
def conversations(draw):
    """Multi-turn rollouts: per sample, its turns' lengths and the observation after each turn but the last, and how
    many rounds its handler takes to answer each turn."""
    P = draw(st.integers(1, 4))
    n = draw(st.integers(1, 5))
    prompts = draw(st.lists(st.integers(1, 30), min_size=P, max_size=P))
    plans = {}
    for p in range(P):
        for j in range(n):
            k = draw(st.integers(1, 4))
            turns = draw(st.lists(st.integers(1, 20), min_size=k, max_size=k))
            obs = draw(st.lists(st.integers(0, 12), min_size=k - 1, max_size=k - 1))
            delays = draw(st.lists(st.integers(0, 3), min_size=k - 1, max_size=k - 1))
            plans[p * n + j] = (turns, obs, delays)
    page = draw(st.sampled_from([1, 4, 16]))
    steps = draw(st.sampled_from([1, 3, 8]))
    rows = draw(st.integers(1, P * n))
    context = max(prompts[s // n] + sum(t) + sum(o) for s, (t, o, _) in plans.items())
    spare = draw(st.sampled_from([0, 1, 5, 1000]))
    return prompts, n, plans, page, steps, rows, context, -(-context // page) + 2 + spare


@settings(max_examples=80)
@given(conversations())
def test_pause_resume_and_eviction_keep_the_invariants(case):
    """Driven as the engine drives it with a turn handler: a sample that ends a turn pauses (its row left, the pages
    of its cached tokens kept, exactly), its answer comes after a random number of rounds, it resumes with the
    observation in its context. After every round the invariants hold (paused samples included); every sample
    finishes once with its whole conversation; every page is free at the end; no round leaves nothing running while
    samples wait for admission (no deadlock); with room for everything nothing is evicted or preempted and every
    resumed sample kept its K/V (kv = its cached tokens before the observation)."""
    prompts, n, plans, page, steps, rows, context, pages = case
    limits = [max(plans[p * n + j][0][0] for j in range(n)) for p in range(len(prompts))]
    sched = Scheduler(prompts, n, limits, page, pages, rows, max_context=context)
    turn = dict.fromkeys(plans, 0)
    target = {s: plans[s][0][0] for s in plans}  # tokens of the current turn
    answers: dict[int, list] = {}  # paused sample -> [rounds left, seq]
    finished, kept = [], []
    for _ in range(10_000):
        for seq in [s for s in sched.rows if s is not None and s.generated >= target[s.sample]]:
            turns, obs, delays = plans[seq.sample]
            if turn[seq.sample] == len(turns) - 1:
                finished.append((seq.sample, seq.context + seq.generated))
                sched.finish(seq)
            else:
                cached = seq.context + seq.generated - 1
                sched.pause(seq)
                assert seq.row < 0 and len(seq.pages) == sched.pages_for(cached) and seq.cached == cached
                answers[seq.sample] = [delays[turn[seq.sample]], seq]
        sched.grow(steps)
        sched.check()
        sched.compact()
        for sample in list(answers):
            left, seq = answers[sample]
            if left > 0:
                answers[sample][0] -= 1
                continue
            del answers[sample]
            turns, obs, _ = plans[sample]
            before = seq.cached
            sched.resume(seq, obs[turn[sample]], turns[turn[sample] + 1])
            kept.append(seq.kv == before)
            turn[sample] += 1
            target[sample] = turns[turn[sample]]
        sched.admit(steps)
        sched.release_prompts()
        sched.check()
        assert len(sched.rows) <= rows
        if sched.done:
            break
        assert sched.rows or answers, "nothing runs while samples wait: a deadlock"
        for s in sched.rows:
            s.generated = min(s.generated + steps, target[s.sample])
    assert sorted(finished) == sorted((s, prompts[s // n] + sum(t) + sum(o)) for s, (t, o, _) in plans.items())
    assert sched.used_pages == 0 and not any(sched.refs) and not sched.paused
    room = sum(n * -(-context // page) + -(-a // page) for a in prompts)
    if pages - 1 >= room:
        assert sched.preemptions == sched.evictions == 0 and all(kept)
