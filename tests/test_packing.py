"""Packing utilities: the packed layout, its round trip, and token-budget micro-batching."""

import pytest
import torch

from fastgrpo.models.packing import PackedBatch, pack, plan_microbatches


def test_pack_layout_and_round_trip():
    seqs = [[5, 6, 7], [8], [9, 10]]
    b = pack(seqs)
    assert isinstance(b, PackedBatch)
    assert b.input_ids.tolist() == [5, 6, 7, 8, 9, 10] and b.input_ids.dtype == torch.long
    assert b.position_ids.tolist() == [0, 1, 2, 0, 0, 1] and b.position_ids.dtype == torch.long
    assert b.cu_seqlens.tolist() == [0, 3, 4, 6] and b.cu_seqlens.dtype == torch.int32
    assert (b.max_seqlen, b.num_tokens, b.num_seqs, b.lengths) == (3, 6, 3, [3, 1, 2])
    assert [t.tolist() for t in b.unpack(b.input_ids)] == seqs
    moved = b.to("cpu")
    assert torch.equal(moved.cu_seqlens, b.cu_seqlens) and moved.max_seqlen == 3


def test_pack_tensors_keep_ids():
    seqs = [torch.tensor([1, 2], dtype=torch.int32), torch.tensor([3, 4, 5])]
    b = pack(seqs)
    assert b.input_ids.tolist() == [1, 2, 3, 4, 5] and b.input_ids.dtype == torch.long


@pytest.mark.parametrize(("seqs", "match"), [
    ([], "sequences is empty"),
    ([[1], []], r"sequences\[1\] is empty"),
    ([torch.zeros(2, 2, dtype=torch.long)], "1-D"),
    ([torch.ones(3)], "integer"),
])
def test_pack_rejects_bad_input(seqs, match):
    with pytest.raises(ValueError, match=match):
        pack(seqs)


def test_unpack_checks_length():
    with pytest.raises(ValueError, match="x_N"):
        pack([[1, 2]]).unpack(torch.zeros(3))


def test_plan_microbatches_first_fit_decreasing():
    lengths = [5, 3, 8, 2, 7, 1]
    plan = plan_microbatches(lengths, max_tokens=10)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in mb) <= 10 for mb in plan)
    # longest first: 8 → [2], 7 → [4], 5 → [0], 3 → with 7, 2 → with 8, 1 → with 5
    assert plan == [[0, 5], [1, 4], [2, 3]]
    assert plan_microbatches(lengths, max_tokens=10) == plan  # deterministic


def test_plan_microbatches_limits():
    assert plan_microbatches([4, 4, 4], max_tokens=4) == [[0], [1], [2]]
    assert plan_microbatches([4, 4, 4], max_tokens=100) == [[0, 1, 2]]
    assert plan_microbatches([], max_tokens=4) == []


@pytest.mark.parametrize(("lengths", "max_tokens", "match"), [
    ([3, 11, 2], 10, "max_tokens=10"),
    ([3], 0, "max_tokens must be a positive int"),
    ([-1], 4, r"lengths\[0\]"),
])
def test_plan_microbatches_errors(lengths, max_tokens, match):
    with pytest.raises(ValueError, match=match):
        plan_microbatches(lengths, max_tokens)
