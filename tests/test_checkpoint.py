"""fastgrpo.checkpoint: round trip, HF loading, atomicity under a crash, pruning, bad input; 2-process resume.

The round trip is checked against the saved objects themselves (weights, optimizer and scheduler state, the
next random numbers of every generator) and against an uninterrupted run: a model resumed from a checkpoint
takes the same next optimizer step, bit for bit, as the model that kept going.
"""

from __future__ import annotations

import copy
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fastgrpo import checkpoint as C
from fastgrpo import distributed as D
from fastgrpo.precision import MasterAdamW, make_optimizer

VOCAB = ["<pad>", "<unk>", "<eos>", *"0123456789+=ab"]


def tiny_config(layers: int = 2):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)


def tiny_model(seed: int, layers: int = 2):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_config(layers))


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def train_step(model, optimizer, scheduler, ids_BT) -> float:
    loss = model(input_ids=ids_BT, labels=ids_BT).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return loss.item()


def make_optim(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def batch(step: int, rows: int = 4):
    return torch.randint(0, len(VOCAB), (rows, 7), generator=torch.Generator().manual_seed(1000 + step))


def draws() -> list[float]:
    return [random.random(), float(np.random.rand()), float(np.random.randn()), torch.rand(()).item()]


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def optim_tensors(opt) -> dict:
    return {f"{i}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items()}


# ---------------------------------------------------------------- one process


def test_round_trip_and_resume(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = tiny_model(0), tiny_tokenizer()
    opt, sched = make_optim(model)
    for s in range(2):
        train_step(model, opt, sched, batch(s))
    seed_all(7)
    torch.randn(5)  # advance the streams off their seed
    path = C.save_checkpoint(tmp_path, 2, model=model, tokenizer=tok, optimizer=opt, scheduler=sched,
                             trainer_state={"data_pos": 8, "history": [0.5, 0.25], "name": "tiny"},
                             rank_state={"in_flight": {3: torch.arange(5, dtype=torch.int32)}, "order": [3]})
    assert path == tmp_path / "checkpoints" / "step_00000002" and C.latest_checkpoint(tmp_path) == path
    expected_draws = draws()
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved_optim = {k: v.clone() for k, v in optim_tensors(opt).items()}
    saved_sched = copy.deepcopy(sched.state_dict())
    loss3 = train_step(model, opt, sched, batch(2))  # the uninterrupted run's next step

    fresh = tiny_model(1)
    fresh_opt, fresh_sched = make_optim(fresh)
    params_before = {n: (p, p.data_ptr()) for n, p in fresh.named_parameters()}
    seed_all(99)
    trainer = C.load_checkpoint(path, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched)
    own = trainer.pop("rank_state")  # this rank's own file
    assert trainer == {"data_pos": 8, "history": [0.5, 0.25], "name": "tiny", "step": 2}
    assert own["order"] == [3] and torch.equal(own["in_flight"][3], torch.arange(5, dtype=torch.int32))
    assert draws() == expected_draws
    assert_same_tensors(fresh.state_dict(), saved_weights)
    assert_same_tensors(optim_tensors(fresh_opt), saved_optim)
    assert fresh_sched.state_dict() == saved_sched
    assert fresh_sched.get_last_lr() == pytest.approx([1e-2 / 3])
    # In place: the same Parameter objects and storages (a generation engine holding them sees the weights).
    for n, p in fresh.named_parameters():
        assert p is params_before[n][0] and p.data_ptr() == params_before[n][1]
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    # Resumed = uninterrupted, bit for bit.
    assert train_step(fresh, fresh_opt, fresh_sched, batch(2)) == loss3
    assert_same_tensors(fresh.state_dict(), model.state_dict())

    hf = AutoModelForCausalLM.from_pretrained(path)
    assert_same_tensors(hf.state_dict(), saved_weights)
    assert AutoTokenizer.from_pretrained(path)("1+2=3").input_ids == tok("1+2=3").input_ids


def test_save_before_any_optimizer_step(tmp_path):
    """A checkpoint of a fresh optimizer holds no state and leaves the optimizer untouched (no fake step)."""
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    path = C.save_checkpoint(tmp_path, 0, model=model, optimizer=opt)
    assert not opt.state
    other = nn.Linear(4, 3)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    C.load_checkpoint(path, model=other, optimizer=other_opt)
    assert not other_opt.state and other_opt.param_groups[0]["lr"] == 0.1
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (other, other_opt)):
        m(x).square().sum().backward()
        o.step()
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)


def test_crash_during_save_keeps_previous(tmp_path, monkeypatch):
    model = tiny_model(0)
    opt, _ = make_optim(model)
    first = C.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, trainer_state={})

    def crash(model, out, sd, dtype):
        (out / "model.safetensors").write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(C, "save_model", crash)
    with pytest.raises(OSError, match="disk full"):
        C.save_checkpoint(tmp_path, 2, model=model, optimizer=opt, trainer_state={})
    assert C.latest_checkpoint(tmp_path) == first
    assert (tmp_path / "checkpoints" / ".tmp-step_00000002").is_dir()  # the half-written one, not picked
    monkeypatch.undo()
    second = C.save_checkpoint(tmp_path, 3, model=model, optimizer=opt, trainer_state={})
    assert C.latest_checkpoint(tmp_path) == second
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001", "step_00000003"]
    # A directory without the marker (e.g. copied by hand, half done) is never "latest".
    (tmp_path / "checkpoints" / "step_00000009").mkdir()
    assert C.latest_checkpoint(tmp_path) == second


def test_prune_and_resave(tmp_path):
    model = nn.Linear(3, 2)
    for step in (1, 2, 3, 4):
        C.save_checkpoint(tmp_path, step, model=model, keep_last=2)
    assert [p.name for p in C.list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    # The checkpoint just written survives even when it is older than keep_last newer ones.
    C.save_checkpoint(tmp_path, 2, model=model, keep_last=2)
    assert [p.name for p in C.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003", "step_00000004"]
    # Re-saving a step replaces it.
    with torch.no_grad():
        model.weight.fill_(3.0)
    C.save_checkpoint(tmp_path, 4, model=model, keep_last=None)
    other = nn.Linear(3, 2)
    C.load_checkpoint(C.latest_checkpoint(tmp_path), model=other)
    assert torch.equal(other.weight, model.weight)
    assert C.latest_checkpoint(tmp_path / "nowhere") is None


def test_plain_module_with_tied_weights(tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    path = C.save_checkpoint(tmp_path, 0, model=model)
    other = Tied()
    C.load_checkpoint(path, model=other)
    assert torch.equal(other.embed.weight, model.embed.weight) and other.head.weight is other.embed.weight


def test_bad_input(tmp_path):
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="step"):
        C.save_checkpoint(tmp_path, -1, model=model)
    with pytest.raises(ValueError, match="keep_last"):
        C.save_checkpoint(tmp_path, 1, model=model, keep_last=0)
    with pytest.raises(ValueError, match="model"):
        C.save_checkpoint(tmp_path, 1, model={"w": 1})
    with pytest.raises(ValueError, match=r"trainer_state\['pos'\]"):
        C.save_checkpoint(tmp_path, 1, model=model, trainer_state={"pos": np.int64(3)})
    with pytest.raises(ValueError, match=r"rank_state\['queue'\]\[0\]"):
        C.save_checkpoint(tmp_path, 1, model=model, rank_state={"queue": [object()]})
    assert C.latest_checkpoint(tmp_path) is None
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        C.load_checkpoint(tmp_path, model=model)
    path = C.save_checkpoint(tmp_path, 1, model=model)
    with pytest.raises(ValueError, match="missing"):
        C.load_checkpoint(path, model=nn.Sequential(nn.Linear(3, 2)))
    with pytest.raises(ValueError, match="size mismatch"):
        C.load_checkpoint(path, model=nn.Linear(4, 2))
    with pytest.raises(ValueError, match="no optimizer state"):
        C.load_checkpoint(path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    (path / "rng_rank0.pt").unlink()  # as if saved by a different world size
    with pytest.warns(UserWarning, match="rng_rank0.pt"):
        C.load_checkpoint(path, model=model)


@pytest.mark.gpu
def test_round_trip_cuda(tmp_path):
    model = tiny_model(0).cuda()
    opt, sched = make_optim(model)
    train_step(model, opt, sched, batch(0).cuda())
    torch.cuda.manual_seed(5)
    path = C.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, scheduler=sched)
    expected = torch.rand(4, device="cuda")
    loss2 = train_step(model, opt, sched, batch(1).cuda())
    fresh = tiny_model(1).cuda()
    fresh_opt, fresh_sched = make_optim(fresh)
    torch.cuda.manual_seed(0)
    C.load_checkpoint(path, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched)
    assert torch.equal(torch.rand(4, device="cuda"), expected)  # the CUDA generator is restored too
    assert all(v.is_cuda for s in fresh_opt.state.values() for v in s.values() if v.dim())
    assert train_step(fresh, fresh_opt, fresh_sched, batch(1).cuda()) == loss2


# ---------------------------------------------------------------- two processes (torchrun, gloo)


def clone(sd: dict | None) -> dict | None:
    return None if sd is None else {k: v.detach().clone() for k, v in sd.items()}



def hidden_and_head(model, ids_BT):
    """The trainer's pattern: the decoder's last hidden state, the LM head weight for a fused loss."""
    return model.get_decoder()(input_ids=ids_BT).last_hidden_state, model.lm_head.weight


def dp_train_step(model, optimizer, scheduler, ids_BT) -> float:
    from fastgrpo.precision import accumulate

    with accumulate(model, optimizer, last=True):  # DDP / FSDP2 reduce, or (bf16 masters) fold + fp32 all-reduce
        hidden_BTH, weight_VH = model(ids_BT)
        logits_BTV = hidden_BTH[:, :-1].float() @ weight_VH.float().T
        loss = nn.functional.cross_entropy(logits_BTV.flatten(0, 1), ids_BT[:, 1:].flatten())
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss.item()


def _worker(out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    state = D.init_distributed("cpu", timeout_s=120)  # a hang fails fast instead of in 30 minutes
    r, report = state.rank, {}
    shard = slice(2 * r, 2 * r + 2)  # this rank's half of the global batch of 4

    def fresh(strategy, seed, dtype):
        model = D.wrap_model(tiny_model(seed).to(dtype), state, strategy, forward=hidden_and_head)
        opt = make_optimizer(model, lr=1e-2, weight_decay=0.1)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    def masters(model, opt):  # the fp32 values behind the weights: MasterAdamW's, or FSDP2's fp32 shards gathered
        if isinstance(opt, MasterAdamW):
            names = {id(p): n for n, p in D.unwrap_model(model).named_parameters()}
            return {names[id(p)]: m.detach().clone() for p, m in zip(opt.model_params, opt.masters)}
        sd = D.full_state_dict(model, state)  # on rank 0; tied weights once, as named_parameters() names them
        return None if sd is None else {n: sd[n].clone() for n, _ in D.unwrap_model(model).named_parameters()}

    for saved_by, dtype in [(s, d) for d in (torch.float32, torch.bfloat16) for s in ("ddp", "fsdp2")]:
        tag = "" if dtype == torch.float32 else "bf16:"
        model, opt, sched = fresh(saved_by, 0, dtype)
        for s in range(2):
            dp_train_step(model, opt, sched, batch(s)[shard])
        seed_all(100 + r)  # a different stream on each rank: each must get its own back
        path = C.save_checkpoint(out_dir / f"{tag}{saved_by}", 2, model=model, optimizer=opt, scheduler=sched,
                                 trainer_state={"data_pos": 16}, state=state, dtype=dtype)
        expected = draws()
        saved = masters(model, opt)
        loss3 = dp_train_step(model, opt, sched, batch(2)[shard])
        after3 = masters(model, opt)
        for resumed_by in ("ddp", "fsdp2"):
            model2, opt2, sched2 = fresh(resumed_by, 1, dtype)
            seed_all(0)
            trainer = C.load_checkpoint(path, model=model2, optimizer=opt2, scheduler=sched2, state=state)
            rep = {"path": str(path.relative_to(out_dir)), "trainer": trainer, "rng_equal": draws() == expected,
                   "rng_files": sorted(p.name for p in path.glob("rng_rank*.pt"))}
            loaded = masters(model2, opt2)  # DDP's is a live view: copied before training
            rep["loss3_diff"] = abs(dp_train_step(model2, opt2, sched2, batch(2)[shard]) - loss3)
            resumed3 = masters(model2, opt2)
            if r == 0:
                rep["weights_equal"] = all(torch.equal(loaded[k], v) for k, v in saved.items())
                rep["resumed_maxdiff"] = max((resumed3[k] - v).abs().max().item() for k, v in after3.items())
                hf = AutoModelForCausalLM.from_pretrained(path).state_dict()  # the safetensors: compute dtype
                rep["hf_equal"] = all(hf[k].dtype == dtype and torch.equal(hf[k], v.to(dtype))
                                      for k, v in saved.items())
            report[f"{tag}{saved_by}->{resumed_by}"] = rep
    (out_dir / f"rank{r}.json").write_text(json.dumps(report))
    del model, opt, sched, model2, opt2, sched2  # destroy() then collects the FSDP2 cycles that hold the group
    D.barrier()  # no rank tears down while another still uses the group
    D.destroy()


@pytest.mark.slow  # 16 s: 2 processes; one-process resume stays in the default tier (test_train)
def test_two_processes_save_and_resume(tmp_path):
    """DDP and FSDP2 checkpoints, each resumed under DDP and under FSDP2: same weights, RNG streams per rank,
    and the same next step as the run that kept going; in fp32, and in bf16 with fp32 masters (bf16 safetensors,
    fp32 masters in the trainer state, the masters compared)."""
    from test_distributed import run_torchrun

    run_torchrun(__file__, "worker", str(tmp_path))
    for r in range(2):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        cases = ["ddp->ddp", "ddp->fsdp2", "fsdp2->ddp", "fsdp2->fsdp2"]
        assert sorted(report) == sorted(cases + [f"bf16:{c}" for c in cases])
        for case, rep in report.items():
            assert rep["path"] == f"{case.split('->')[0]}/checkpoints/step_00000002"
            assert rep["trainer"] == {"data_pos": 16, "step": 2, "rank_state": None}  # none saved
            assert rep["rng_files"] == ["rng_rank0.pt", "rng_rank1.pt"]
            assert rep["rng_equal"], (case, r)
            # Bit for bit, across strategies too: with 2 ranks the all-reduce and the reduce-scatter both compute
            # (a + b) / 2 per gradient element, and AdamW is elementwise.
            assert rep["loss3_diff"] == 0.0, (case, r)
            if r == 0:
                assert rep["weights_equal"] and rep["hf_equal"] and rep["resumed_maxdiff"] == 0.0, case


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    _worker(Path(sys.argv[2]))
