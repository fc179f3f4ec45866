"""fastgrpo.metrics: the JSONL log (flushed rows, number conversion, non-finite values, resume), optional writers,
the progress bar, the plot, peak memory and the phase timer."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from fastgrpo import metrics as M


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_log_rows_are_flushed_and_converted(tmp_path):
    logger = M.MetricsLogger(tmp_path)
    row = logger.log(1, {"reward/mean": torch.tensor(0.25), "tokens": 120, "lr": np.float32(0.5),
                         "ok": True, "kl": float("nan"), "loss": torch.tensor(float("inf")), "neg": -math.inf})
    # Readable before close: nothing is lost if the process dies now.
    assert lines(tmp_path / "metrics.jsonl") == [row]
    assert row["step"] == 1 and isinstance(row["time"], float)
    assert {k: row[k] for k in ("reward/mean", "tokens", "lr", "ok", "kl", "loss", "neg")} == {
        "reward/mean": 0.25, "tokens": 120, "lr": 0.5, "ok": 1, "kl": "nan", "loss": "inf", "neg": "-inf"}
    logger.log(2, {"eval/accuracy": 0.5})
    logger.close()
    logger.close()
    rows = M.read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert math.isnan(rows[0]["kl"]) and rows[0]["loss"] == math.inf and rows[0]["neg"] == -math.inf
    assert rows[1]["eval/accuracy"] == 0.5 and "reward/mean" not in rows[1]


def test_log_bad_input(tmp_path):
    with M.MetricsLogger(tmp_path) as logger:
        with pytest.raises(ValueError, match=r"metrics\['stage'\]"):
            logger.log(1, {"stage": "8k"})
        with pytest.raises(ValueError, match=r"metrics\['v'\]"):
            logger.log(1, {"v": torch.ones(3)})
        with pytest.raises(ValueError, match="step"):
            logger.log(1.5, {"a": 1.0})
    with pytest.raises(ValueError, match="closed"):
        logger.log(3, {"a": 1.0})


def test_disabled_logger_writes_nothing(tmp_path):
    logger = M.MetricsLogger(tmp_path / "run", enabled=False, tensorboard=True, wandb=True)
    assert logger.log(1, {"a": 1.0}) == {}
    logger.close()
    assert not (tmp_path / "run").exists()


def test_resume_drops_rows_after_the_checkpoint(tmp_path):
    with M.MetricsLogger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"reward/mean": step / 10, "kl": float("nan")})
    with M.MetricsLogger(tmp_path, resume_step=3) as logger:
        logger.log(4, {"reward/mean": 0.44})
    rows = M.read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.44)]
    assert all(math.isnan(r["kl"]) for r in rows[:3])


def test_missing_writers_warn(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(M.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a))
    with pytest.warns(UserWarning, match="tensorboard package is not installed"):
        M.MetricsLogger(tmp_path, tensorboard=True).close()
    with pytest.warns(UserWarning, match="wandb package is not installed"):
        M.MetricsLogger(tmp_path, wandb=True, wandb_project="p").close()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_writer(tmp_path):
    with M.MetricsLogger(tmp_path, tensorboard=True) as logger:
        logger.log(1, {"reward/mean": 0.5})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_read_jsonl_truncated_and_bad_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')
    with pytest.warns(UserWarning, match="truncated"):
        assert [r["step"] for r in M.read_jsonl(path)] == [1, 2]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="m.jsonl:2"):
        M.read_jsonl(path)
    with pytest.raises(ValueError, match="does not exist"):
        M.read_jsonl(tmp_path / "none.jsonl")


def test_progress_bar(capsys):
    bar = M.ProgressBar(total=10, initial=2)
    bar.update(3, reward=0.5)
    bar.update(5, reward=0.75)
    assert bar._bar.n == 5
    bar.close()
    err = capsys.readouterr().err
    assert "5/10" in err and "reward=0.75" in err and "s/step=" in err
    quiet = M.ProgressBar(total=10, enabled=False)
    quiet.update(4, reward=1.0)
    quiet.close()
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="total"):
        M.ProgressBar(total=-1)


def test_plot_metrics(tmp_path):
    import matplotlib.image

    path = tmp_path / "metrics.jsonl"
    with M.MetricsLogger(tmp_path) as logger:
        for step in range(1, 7):
            logger.log(step, {"reward/mean": step / 6, "accuracy": step / 12, "loss": float("nan")})
            if step % 3 == 0:
                logger.log(step, {"eval/accuracy": step / 10})
    # Three panels with data (response_length/mean is absent, so skipped): 3 × 5 inches at 100 dpi.
    png = M.plot_metrics(path, tmp_path / "plots" / "m.png")
    assert png == tmp_path / "plots" / "m.png"
    assert matplotlib.image.imread(png).shape[:2] == (360, 1500)
    png = M.plot_metrics(path, tmp_path / "loss.png", keys=("loss",), eval_keys=())  # only NaN: no data
    assert matplotlib.image.imread(png).shape[:2] == (360, 500)


def test_peak_memory_cpu():
    """64 MiB of fresh pages, written, raise the resident high-water mark by about that much. They come from an
    anonymous mapping: a tensor's allocation may reuse pages the allocator already holds resident (what earlier tests
    freed), which would not move the mark."""
    import mmap

    M.reset_peak_memory("cpu")
    before = M.peak_memory_gib("cpu")
    size = 64 * 2**20
    with mmap.mmap(-1, size) as block:
        for offset in range(0, size, mmap.PAGESIZE):  # each page written: resident
            block[offset] = 1
        after = M.peak_memory_gib("cpu")
    assert before > 0 and after - before >= 0.9 * size / 2**30


def test_timer_accumulates_per_phase(monkeypatch):
    clock = iter([0.0, 1.5, 2.0, 2.25, 10.0, 13.0])
    monkeypatch.setattr(M.time, "perf_counter", lambda: next(clock))
    timers = M.Timer("cpu")
    with timers("generation"):
        pass
    with timers("update"):
        pass
    with pytest.raises(RuntimeError), timers("generation"):  # a failing phase still counts its time
        raise RuntimeError("boom")
    assert timers.totals() == {"generation": 4.5, "update": 0.25}
    assert timers.pop(prefix="time/") == {"time/generation": 4.5, "time/update": 0.25}
    assert timers.pop() == {}


@pytest.mark.gpu
def test_peak_memory_and_timer_cuda():
    torch.cuda.synchronize()
    M.reset_peak_memory("cuda")
    before = M.peak_memory_gib("cuda")
    block = torch.ones(256 * 2**20 // 4, device="cuda")  # 256 MiB
    assert M.peak_memory_gib("cuda") - before >= 0.25 - 1e-6
    timers = M.Timer("cuda")
    with timers("matmul"):
        block.view(-1, 4096).sum()
    del block
    out = timers.pop()
    assert list(out) == ["matmul"] and out["matmul"] > 0


class _Recorder:
    """Stands in for a SummaryWriter / a W&B run: keeps what it is given."""

    def __init__(self):
        self.calls = []

    def add_text(self, tag, text, global_step):
        self.calls.append(("text", tag, text, global_step))

    def log(self, data, step):
        self.calls.append(("log", data, step))

    def flush(self):
        pass


def test_log_table_mirrors_rows_to_tensorboard_and_wandb(tmp_path, monkeypatch):
    """One markdown table per step in TensorBoard (cells escaped so the table keeps its shape) and one wandb.Table;
    nothing in metrics.jsonl."""
    import sys
    import types

    fake = types.ModuleType("wandb")
    fake.Table = lambda columns, data: ("table", columns, data)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    rows = [{"step": 3, "completion": "a|b\n\\boxed{1}", "reward": 1.0, "rewards": {"math": 1.0}},
            {"step": 3, "completion": "x", "reward": 0.0, "rewards": {"math": 0.0}}]
    with M.MetricsLogger(tmp_path) as logger:
        logger._tb, logger._wandb = _Recorder(), _Recorder()
        tb, wb = logger._tb, logger._wandb
        logger.log_table(3, "rollouts", rows)
        logger.log_table(4, "rollouts", [])  # nothing to show: nothing sent
        logger._tb = logger._wandb = None  # the recorders have no close()
    ((kind, tag, text, step),) = tb.calls
    lines = text.split("\n")
    assert (kind, tag, step) == ("text", "rollouts", 3) and len(lines) == 4
    assert lines[0] == "| step | completion | reward | rewards |"
    assert lines[2] == '| 3 | a\\|b<br>\\\\boxed{1} | 1.0 | {"math": 1.0} |'
    assert all(line.replace("\\|", "").count("|") == 5 for line in lines[2:])  # 4 cells a row, escapes kept inside
    ((kind, data, step),) = wb.calls
    assert kind == "log" and step == 3 and data == {"rollouts": (
        "table", ["step", "completion", "reward", "rewards"],
        [[3, "a|b\n\\boxed{1}", 1.0, '{"math": 1.0}'], [3, "x", 0.0, '{"math": 0.0}']])}
    assert not (tmp_path / "metrics.jsonl").read_text()
