"""SFT on the trainer's loop (fastgrpo/algorithms/sft.py): the packed step against an unpacked fp32 reference, the mask
(which
packed positions are trained, on what target, from rows of both formats), the validation loss, and the warm-up's
noisy examples."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.algorithms.sft import lm_batch
from fastgrpo.config import DataConfig, load_config
from fastgrpo.data.responses import Renderer, SFTExample, sft_example
from fastgrpo.models.loading import build_tiny_tokenizer

SMALL = ["model.tiny_hidden_size=32", "model.tiny_intermediate_size=64", "data.synthetic_num_terms=2",
         "data.synthetic_eval_size=16", "data.max_length=24", "train.max_tokens_per_microbatch=40", "sft.batch_size=8",
         "eval.num_prompts=4", "logging.progress_bar=false", "train.num_threads=1", "train.max_grad_norm=0"]


def trainer(tmp_path, *overrides):
    from fastgrpo.trainer import Trainer

    return Trainer(load_config("sft-tiny", overrides=[*SMALL, f"logging.output_dir={tmp_path}", *overrides]))


def nll(model, ex: SFTExample) -> tuple[torch.Tensor, int]:
    """Σ −log p over the trained tokens of one sequence alone through the HF forward (fp32), and their count."""
    ids = torch.tensor([ex.input_ids])
    logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)  # [T-1, V]
    lp = logp.gather(-1, ids[0, 1:, None])[:, 0]  # [T-1]
    mask = torch.tensor(ex.loss_mask[1:])
    return -(lp * mask).sum(), int(mask.sum())


def test_packed_step_matches_unpacked_fp32_reference(tmp_path):
    """One SFT step over 8 examples in several micro-batches (40-token budget), with a multi-turn conversation
    whose first (user) turn is untrained, vs each sequence through the HF forward: loss = Σ NLL / Σ trained
    tokens, and its gradient (the SGD weight change at lr 1)."""
    t = trainer(tmp_path)
    sft, model = t.algorithm, t.model
    chat = SFTExample([3, 7, 43, 8, 4, 9, 0, 3, 10, 4, 11, 12, 0],
                      [False] * 5 + [True, True, False, False, False, True, True, True])
    sft.train_data.items.append(chat)
    indices = [len(sft.train_data) - 1, 0, 11, 50, 42, 7, 30, 12]
    t.ctx.optimizer = torch.optim.SGD(t.wrapped.parameters(), lr=1.0)
    t.ctx.scheduler = torch.optim.lr_scheduler.LambdaLR(t.optimizer, lambda s: 1.0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    m = sft.step(indices, {})
    delta = {k: before[k] - v.detach() for k, v in model.named_parameters()}
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(before[k])
    model.zero_grad()
    parts = [nll(model, sft.train_data.items[i]) for i in indices]
    n = sum(c for _, c in parts)
    loss = sum(x for x, _ in parts) / n
    loss.backward()
    assert m["loss_tokens"] == n and m["bad_steps"] == 0
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert m["tokens"] == sum(len(sft.train_data.items[i].input_ids) for i in indices)
    for k, p in model.named_parameters():
        torch.testing.assert_close(delta[k], p.grad, rtol=1e-4, atol=1e-6, msg=lambda s, k=k: f"{k}: {s}")


def test_validation_loss_and_accuracy(tmp_path):
    t = trainer(tmp_path)
    m = t.algorithm.validate()
    parts = [nll(t.model, ex) for ex in t.algorithm.held_out.items]
    with torch.no_grad():
        want = sum(x for x, _ in parts) / sum(c for _, c in parts)
    assert m["eval/loss"] == pytest.approx(want.item(), rel=1e-5)
    assert m["eval/num_prompts"] == 4 and 0 <= m["eval/accuracy"] <= 1


def test_warmup_noise_swaps_responses_only(tmp_path, monkeypatch):
    """The warm-up's examples keep their prompts; a swapped response is another row's, whole."""
    import fastgrpo.algorithms.sft as S
    from fastgrpo.trainer import Trainer

    seen = []
    monkeypatch.setattr(S, "sft_backward", lambda model, opt, batch, *a: (seen.extend(batch), (0.0, 1.0, {}))[1])
    t = Trainer(load_config("tiny", overrides=["sft.warmup_steps=3", "sft.batch_size=16", "sft.answer_noise=0.5",
                                               f"logging.output_dir={tmp_path}", "train.num_threads=1"]))
    try:
        examples, responses = t.algorithm.warmup_examples()
        S.sft_warmup(t.ctx, examples, responses)
    finally:
        t.close()  # the GRPO algorithm's reward workers
    prompts = {tuple(ex.input_ids[: ex.loss_mask.index(True)]) for ex in examples}
    swapped = 0
    assert len(seen) == 48
    for ex in seen:
        cut = ex.loss_mask.index(True)
        assert tuple(ex.input_ids[:cut]) in prompts and all(ex.loss_mask[cut:])
        assert ex.input_ids[cut:] in responses
        swapped += ex not in examples
    assert 5 < swapped < 40  # about half are swapped (some swaps land on an equal answer)


def trained_pairs(mb) -> list[tuple[int, int]]:
    """``(packed position, target)`` of every trained position of an :class:`LMBatch`."""
    return [(t, int(mb.targets[t])) for t in torch.nonzero(mb.mask).flatten().tolist()]


def test_lm_batch_trains_from_the_last_prompt_position():
    """Two packed sequences, by hand: position t predicts token t + 1, so the first trained position is the last
    prompt token's (its target is the first completion token), and a sequence's last position is never trained."""
    a = SFTExample([5, 6, 7, 8, 9], [False, False, True, True, True])  # prompt [5, 6], completion [7, 8, 9]
    b = SFTExample([1, 2, 3], [False, True, True])  # prompt [1], completion [2, 3]; packed at positions 5-7
    mb = lm_batch([a, b], torch.device("cpu"))
    assert trained_pairs(mb) == [(1, 7), (2, 8), (3, 9), (5, 2), (6, 3)]
    assert mb.num_loss_tokens == 5


TOK = build_tiny_tokenizer()
TEXT = st.text(alphabet="0123456789+= ", min_size=1, max_size=10)


@given(rows=st.lists(st.tuples(TEXT, TEXT, st.booleans()), min_size=1, max_size=4))
def test_rows_train_exactly_their_completions(rows):
    """Rows as users write them (``{prompt, completion}`` or a user / assistant conversation), tokenised by
    ``fastgrpo.data.datasets`` and packed by ``lm_batch``: the trained targets are each completion's tokens then EOS, in
    order, from the last prompt position on (the tiny tokenizer's template renders ``<|user|>q<|assistant|>a``)."""
    cfg = DataConfig(max_prompt_tokens=64, max_length=64)

    def ids(text):
        return TOK(text, add_special_tokens=False)["input_ids"]

    examples, want, offset = [], [], 0
    for q, a, chat in rows:
        row = ({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} if chat
               else {"prompt": q, "completion": a})
        examples.append(sft_example(row, Renderer(TOK, cfg), cfg))
        prompt, completion = ids(f"<|user|>{q}<|assistant|>"), ids(a) + [TOK.eos_token_id]
        assert examples[-1].input_ids == prompt + completion
        want += [(offset + len(prompt) - 1 + i, t) for i, t in enumerate(completion)]
        offset += len(prompt) + len(completion)
    mb = lm_batch(examples, torch.device("cpu"))
    assert trained_pairs(mb) == want
    assert mb.num_loss_tokens == len(want)
