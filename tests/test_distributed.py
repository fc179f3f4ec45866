"""fastgrpo.distributed: one-process behaviour here, and a 2-process gloo job under torchrun.

The 2-process job runs this very file as a script (``torchrun --nproc_per_node 2 tests/test_distributed.py
worker OUT``); each rank checks the collectives and the DDP / FSDP2 gradients against a one-process reference
computed on the full global batch, and writes a JSON report that the test reads back.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from fastgrpo import distributed as D

TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_torchrun_env(monkeypatch):
    for k in TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)


# ---------------------------------------------------------------- one process


def test_init_single_process_is_a_noop(no_torchrun_env):
    state = D.init_distributed("cpu")
    assert state == D.DistState(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None)
    assert state.is_main and not state.distributed
    assert not torch.distributed.is_initialized()
    assert D.init_distributed("auto").device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    D.barrier()
    D.destroy()


@pytest.mark.parametrize("device", ["tpu", "cuda:x", 3])
def test_init_bad_device(no_torchrun_env, device):
    with pytest.raises(ValueError, match="device"):
        D.init_distributed(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when CUDA is absent")
def test_init_cuda_without_cuda(no_torchrun_env):
    with pytest.raises(ValueError, match="CUDA is not available"):
        D.init_distributed("cuda")


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "two"}, {"WORLD_SIZE": "2", "RANK": "2"}])
def test_init_bad_env(no_torchrun_env, monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="RANK|WORLD_SIZE"):
        D.init_distributed("cpu")


def test_print0_prints_on_rank0(no_torchrun_env, capsys):
    D.print0("hello", 3)
    assert capsys.readouterr().out == "hello 3\n"


def test_single_process_collectives_are_identities():
    t = torch.tensor([1.0, 2.0])
    assert D.all_reduce(t, "mean") is t and t.tolist() == [1.0, 2.0]
    obj = {"a": [1, 2]}
    assert D.broadcast_object(obj) is obj
    out = D.reduce_metrics({"b": torch.tensor(2.5), "a": 1, "c/max": 3.0})
    assert list(out) == ["a", "b", "c/max"]
    assert out == {"a": 1.0, "b": 2.5, "c/max": 3.0}
    assert all(isinstance(v, float) for v in out.values())
    assert D.reduce_metrics({}) == {}


def test_bad_ops_and_values():
    with pytest.raises(ValueError, match="op"):
        D.all_reduce(torch.ones(1), "avg")
    with pytest.raises(ValueError, match="tensor"):
        D.all_reduce([1.0])
    with pytest.raises(ValueError, match="op"):
        D.reduce_metrics({"a": 1.0}, op="median")
    with pytest.raises(ValueError, match=r"ops\['a'\]"):
        D.reduce_metrics({"a": 1.0}, ops={"a": "prod"})
    with pytest.raises(ValueError, match=r"metrics\['a'\]"):
        D.reduce_metrics({"a": "high"})
    with pytest.raises(ValueError, match=r"metrics\['a'\]"):
        D.reduce_metrics({"a": torch.ones(2)})


def test_wrap_single_process_returns_the_model(no_torchrun_env):
    state = D.init_distributed("cpu")
    model = nn.Linear(3, 2)
    for strategy in D.STRATEGIES:
        assert D.wrap_model(model, state, strategy) is model
    assert D.unwrap_model(model) is model
    sd = D.full_state_dict(model, state)
    assert sd.keys() == model.state_dict().keys()
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="strategy"):
        D.wrap_model(model, state, "zero3")
    with pytest.raises(ValueError, match="model"):
        D.wrap_model("model", state, "ddp")


def test_forward_wrapper_and_gradient_sync_single_process(no_torchrun_env):
    state = D.init_distributed("cpu")
    model = Tiny()
    wrapped = D.wrap_model(model, state, "ddp", forward=hidden_and_head)
    assert isinstance(wrapped, D.ForwardWrapper) and D.unwrap_model(wrapped) is model
    ids_BT = torch.randint(0, 11, (2, 5))
    h_BTD, weight, bias = wrapped(ids_BT)
    assert torch.equal(h_BTD @ weight.T + bias, model(ids_BT)) and weight is model.head.weight
    with D.gradient_sync(wrapped, enabled=False):
        _summed_loss(wrapped, ids_BT, 1.0).backward()
    assert model.head.weight.grad is not None
    assert not D.is_fsdp(wrapped) and D.fsdp_root(wrapped) is None
    with pytest.raises(ValueError, match="forward"):
        D.wrap_model(model, state, "ddp", forward="body")


@pytest.mark.gpu
def test_cuda_single_process(no_torchrun_env):
    state = D.init_distributed("cuda")
    assert state.device == torch.device("cuda", 0) and state.backend is None
    out = D.reduce_metrics({"a": torch.tensor(2.0, device="cuda"), "b": 1})
    assert out == {"a": 2.0, "b": 1.0}
    model = nn.Linear(3, 2, device="cuda")
    assert D.wrap_model(model, state, "ddp") is model
    with pytest.raises(ValueError, match="move the model"):
        D.wrap_model(nn.Linear(3, 2), state, "ddp")


def test_decoder_layers_found():
    assert len(D._decoder_layers(Tiny())) == 2
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1)
    layers = D._decoder_layers(Qwen2ForCausalLM(cfg))
    assert [type(m).__name__ for m in layers] == ["Qwen2DecoderLayer"] * 3


# ---------------------------------------------------------------- two processes (torchrun, gloo)


class Tiny(nn.Module):
    """Embedding → 2 residual MLP blocks in ``self.layers`` → head: enough structure for per-layer FSDP2."""

    def __init__(self, vocab: int = 11, dim: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, dim))
                                    for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def body(self, ids_BT):
        h_BTD = self.embed(ids_BT)
        for layer in self.layers:
            h_BTD = h_BTD + layer(h_BTD)
        return h_BTD

    def forward(self, ids_BT):
        return self.head(self.body(ids_BT))  # [B, T, V]


def hidden_and_head(model: Tiny, ids_BT):
    """The trainer's pattern: hidden states from the body, the head's weights for a loss computed outside."""
    return model.body(ids_BT), model.head.weight, model.head.bias


def _loss(model, ids_BT):
    logits_BTV = model(ids_BT[:, :-1])
    return nn.functional.cross_entropy(logits_BTV.flatten(0, 1), ids_BT[:, 1:].flatten())


def _summed_loss(wrapped, ids_BT, scale: float):
    h_BTD, weight_VD, bias_V = wrapped(ids_BT[:, :-1])
    logits_BTV = h_BTD @ weight_VD.T + bias_V
    return nn.functional.cross_entropy(logits_BTV.flatten(0, 1), ids_BT[:, 1:].flatten(), reduction="sum") * scale


def _reference_grads(ids_BT):
    torch.manual_seed(0)
    ref = Tiny()
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    _loss(ref, ids_BT).backward()
    return init, {n: p.grad.clone() for n, p in ref.named_parameters()}


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _accumulate(wrapped, microbatches, global_tokens: int, world: int) -> None:
    """Sum-of-token-losses / global tokens × world per micro-batch: the ranks' gradient average is then the
    gradient of the global token mean, however the rows are split. Sync only on the last backward."""
    for i, mb in enumerate(microbatches):
        with D.gradient_sync(wrapped, enabled=i == len(microbatches) - 1):
            _summed_loss(wrapped, mb, world / global_tokens).backward()


def _max_grad_diff(model, ref_grads) -> float:
    return max((_full(p.grad) - ref_grads[n]).abs().max().item() for n, p in D.unwrap_model(model).named_parameters())


def _worker(out_dir: Path) -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        D.print0("before init")  # torchrun's RANK decides already
        state = D.init_distributed("cpu", timeout_s=120)  # a hang fails fast instead of in 30 minutes
        D.print0("after init")
    r, report = state.rank, {"printed": printed.getvalue()}
    report["state"] = [state.rank, state.local_rank, state.world_size, state.backend, state.is_main]

    t = torch.tensor([r + 1.0, 10.0 * r])
    report["sum"] = D.all_reduce(t.clone(), "sum").tolist()
    report["mean"] = D.all_reduce(t.clone(), "mean").tolist()
    report["max"] = D.all_reduce(t.clone(), "max").tolist()
    # Keys given in a different order on each rank: the sorted order makes them agree.
    local = {"a": float(r), "c/max": 10.0 * r, "b": torch.tensor(r + 1.0), "n/sum": 1, "d/min": 5.0 - r}
    if r == 1:
        local = dict(reversed(local.items()))
    report["metrics"] = D.reduce_metrics(local)
    report["metrics_ops"] = D.reduce_metrics({"a": float(r), "b": float(r)}, ops={"a": "min"}, op="sum")
    try:
        D.reduce_metrics({"a": 1.0, f"rank{r}": 2.0})
        report["mismatch"] = "no error"
    except ValueError as e:
        report["mismatch"] = str(e)
    try:  # rank 1 has a key more: the values' gather would be of unequal sizes (gloo aborts the process)
        D.reduce_metrics({"a": 1.0, **({"b": 2.0} if r == 1 else {})})
        report["count_mismatch"] = "no error"
    except ValueError as e:
        report["count_mismatch"] = str(e)
    report["broadcast"] = D.broadcast_object({"seed": 1234, "rows": [1, 2]} if r == 0 else None)
    report["broadcast_src1"] = D.broadcast_object(f"from {r}", src=1)

    ids_BT = torch.randint(0, 11, (8, 6), generator=torch.Generator().manual_seed(123))  # the global batch
    tokens = ids_BT[:, 1:].numel()
    init, ref_grads = _reference_grads(ids_BT)
    shard_BT = ids_BT[4 * r: 4 * (r + 1)]  # equal halves: the mean of per-rank means is the global mean

    torch.manual_seed(r)  # different weights on each rank: DDP must copy rank 0's (seed 0 = the reference)
    ddp = D.wrap_model(Tiny(), state, "ddp")
    report["ddp_unwrap_type"] = type(D.unwrap_model(ddp)).__name__
    report["ddp_init_equal"] = all(torch.equal(v, init[k]) for k, v in D.unwrap_model(ddp).state_dict().items())
    _loss(ddp, shard_BT).backward()
    report["ddp_grad_maxdiff"] = _max_grad_diff(ddp, ref_grads)
    sd = D.full_state_dict(ddp, state)
    report["ddp_state_dict"] = None if sd is None else sorted(sd)

    # The trainer's pattern: a custom forward, the head used outside it, uneven micro-batch counts per rank.
    torch.manual_seed(0)
    ddp = D.wrap_model(Tiny(), state, "ddp", forward=hidden_and_head)
    _accumulate(ddp, [ids_BT[:4]] if r == 0 else [ids_BT[4:6], ids_BT[6:]], tokens, state.world_size)
    report["ddp_accum_grad_maxdiff"] = _max_grad_diff(ddp, ref_grads)

    torch.manual_seed(r)  # different weights on each rank: FSDP2 too must start from rank 0's (the sharded state)
    fsdp = D.wrap_model(Tiny(), state, "fsdp2")
    report["is_fsdp"] = D.is_fsdp(fsdp)
    _loss(fsdp, shard_BT).backward()
    report["fsdp_grad_maxdiff"] = _max_grad_diff(fsdp, ref_grads)
    sd = D.full_state_dict(fsdp, state)
    report["fsdp_state_dict_maxdiff"] = None if sd is None else max((sd[k] - v).abs().max().item()
                                                                    for k, v in init.items())

    torch.manual_seed(0)
    fsdp = D.wrap_model(Tiny(), state, "fsdp2", forward=hidden_and_head)
    _accumulate(fsdp, [shard_BT[:2], shard_BT[2:]], tokens, state.world_size)
    report["fsdp_accum_grad_maxdiff"] = _max_grad_diff(fsdp, ref_grads)
    sd = D.full_state_dict(fsdp, state)
    report["fsdp_wrapped_keys"] = None if sd is None else sorted(sd)
    (out_dir / f"rank{r}.json").write_text(json.dumps(report))
    freed = weakref.ref(fsdp)
    del ddp, fsdp  # destroy() collects the FSDP2 cycles that hold the group once nothing references them
    D.barrier()  # no rank tears down while another still uses the group
    D.destroy()
    (out_dir / f"rank{r}.freed").write_text(str(freed() is None))


def run_torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 180) -> None:
    """Run ``script`` under ``torchrun --standalone --nproc_per_node nproc`` on CPU; fail with its output."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


def test_two_processes_gloo(tmp_path):
    run_torchrun(__file__, "worker", str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, rep in enumerate(reports):
        assert rep["state"] == [r, r, 2, "gloo", r == 0]
        assert rep["printed"] == ("before init\nafter init\n" if r == 0 else "")
        assert rep["sum"] == [3.0, 10.0] and rep["mean"] == [1.5, 5.0] and rep["max"] == [2.0, 10.0]
        assert rep["metrics"] == {"a": 0.5, "b": 1.5, "c/max": 10.0, "d/min": 4.0, "n/sum": 2.0}
        assert list(rep["metrics"]) == sorted(rep["metrics"])
        assert rep["metrics_ops"] == {"a": 0.0, "b": 1.0}
        assert rep["mismatch"].startswith("metrics must have the same keys on every rank")
        assert rep["count_mismatch"].startswith("metrics must have the same keys on every rank")
        assert rep["broadcast"] == {"seed": 1234, "rows": [1, 2]}
        assert rep["broadcast_src1"] == "from 1"
        assert rep["ddp_unwrap_type"] == "Tiny" and rep["ddp_init_equal"]
        assert rep["is_fsdp"]
        # fp32, same math, only the summation order differs (per-rank partial sums vs one full-batch sum); a
        # missing all-reduce would leave each rank with its half-batch gradient, off by O(1e-2).
        for case in ("ddp", "ddp_accum", "fsdp", "fsdp_accum"):
            assert rep[f"{case}_grad_maxdiff"] < 1e-6, (case, r)
    keys = sorted(Tiny().state_dict())
    assert reports[0]["ddp_state_dict"] == keys and reports[1]["ddp_state_dict"] is None
    assert reports[0]["fsdp_wrapped_keys"] == keys and reports[1]["fsdp_wrapped_keys"] is None
    assert reports[0]["fsdp_state_dict_maxdiff"] == 0.0 and reports[1]["fsdp_state_dict_maxdiff"] is None
    # destroy() freed the FSDP2 model (reference cycles holding the group) before the group went, not at exit
    assert [(tmp_path / f"rank{r}.freed").read_text() for r in range(2)] == ["True", "True"]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    _worker(Path(sys.argv[2]))
