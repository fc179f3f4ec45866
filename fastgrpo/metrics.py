"""Run metrics: a JSONL log, a progress bar, optional TensorBoard / W&B, a PNG plot, phase timers, peak memory.

``run_dir/metrics.jsonl`` holds one JSON object per line, ``{"step": 12, "time": 1764441600.5, "reward/mean":
0.41, ...}``: training rows and evaluation rows (``eval/...`` keys) share the file and the step axis. Values are
numbers: integers (python ``int``, integer tensors) stay integers, everything else is written as a float; a
non-finite value is written as the *string* ``"nan"``, ``"inf"`` or ``"-inf"`` (strict JSON has no NaN) and
``read_jsonl`` turns those strings back into floats. Every row is flushed when written, so a crash of the
process loses nothing already logged.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

METRICS_FILE = "metrics.jsonl"
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _to_number(key: str, value) -> int | float | str:
    """A JSON-ready number: int stays int, the rest float, non-finite → "nan" / "inf" / "-inf"."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metrics[{key!r}] must be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.item()  # sync: one scalar read-back; reduce metrics on device first to pay it once per step
    elif hasattr(value, "item") and not isinstance(value, (int, float)):  # numpy scalars
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if not isinstance(value, float):
        raise ValueError(f"metrics[{key!r}] must be a number or a scalar tensor, got {type(value).__name__}")
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _markdown_cell(value) -> str:
    """``value`` in a markdown table cell: backslashes and ``|`` escaped, line breaks as ``<br>``."""
    text = str(value).replace("\\", "\\\\").replace("|", "\\|")
    return text.replace("\r\n", "<br>").replace("\n", "<br>").replace("\r", "<br>")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All rows of a metrics JSONL file; ``"nan"`` / ``"inf"`` / ``"-inf"`` strings come back as floats.

    A truncated last line (the process died mid-write) is skipped with a warning; a bad line elsewhere raises
    ``ValueError`` naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path {path} does not exist")
    with open(path) as f:
        lines = f.read().splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                warnings.warn(f"{path}: skipping a truncated last line ({e})", stacklevel=2)
                continue
            raise ValueError(f"{path}:{i + 1} is not valid JSON: {e}") from None
        rows.append({k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in row.items()})
    return rows


class MetricsLogger:
    """Append metric rows to ``run_dir/metrics.jsonl`` and mirror them to TensorBoard / W&B when asked.

    ``enabled=False`` makes every method a no-op (pass ``enabled=state.is_main``: only rank 0 writes).
    ``tensorboard``: a ``SummaryWriter`` in ``run_dir/tensorboard``; ``wandb``: ``wandb.init(project=wandb_project,
    name=run_name, config=config, dir=run_dir)``. Either one asked for but not installed is skipped with a
    warning. ``resume_step``: when resuming from a checkpoint at that step, rows with a larger step (logged after
    the checkpoint by the interrupted run) are dropped from the file first, so the log reads like one
    uninterrupted run.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        enabled: bool = True,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str | None = None,
        run_name: str | None = None,
        config: dict | None = None,
        resume_step: int | None = None,
    ):
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.is_file():
            kept = [r for r in read_jsonl(self.path) if r.get("step", -1) <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            with open(tmp, "w") as f:
                for r in kept:
                    f.write(json.dumps({k: _to_number(k, v) if k != "step" else v for k, v in r.items()}) + "\n")
            os.replace(tmp, self.path)
        self._file = open(self.path, "a")
        if tensorboard:
            if importlib.util.find_spec("tensorboard") is None:
                warnings.warn("logging.tensorboard is on but the tensorboard package is not installed "
                              "(pip install tensorboard): TensorBoard logging is off", stacklevel=2)
            else:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        if wandb:
            if importlib.util.find_spec("wandb") is None:
                warnings.warn("logging.wandb is on but the wandb package is not installed (pip install wandb): "
                              "W&B logging is off", stacklevel=2)
            else:
                import wandb as wandb_mod

                self._wandb = wandb_mod.init(project=wandb_project, name=run_name, config=config, dir=str(run_dir))

    def log(self, step: int, metrics: Mapping[str, object]) -> dict:
        """Write one row ``{"step", "time", **metrics}`` (flushed) and return it as written."""
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"step must be an int, got {step!r}")
        if not self.enabled:
            return {}
        if self._file is None:
            raise ValueError("the logger is closed")
        clean = {k: _to_number(k, v) for k, v in metrics.items() if k not in ("step", "time")}
        row = {"step": step, "time": time.time(), **clean}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        numeric = {k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in clean.items()}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        return row

    def log_table(self, step: int, name: str, rows: list[Mapping[str, object]]) -> None:
        """Mirror ``rows`` (dicts with the same keys: the columns) as one table per step to the writers that are on:
        a ``wandb.Table`` logged under ``name``, and TensorBoard text ``name`` (a markdown table: ``|`` escaped, line
        breaks as ``<br>``). Nothing goes to ``metrics.jsonl`` (the rows have files of their own); a no-op without
        writers or rows. A value that is neither a number nor a string is written as its JSON text."""
        if not self.enabled or not rows or (self._tb is None and self._wandb is None):
            return
        columns = list(rows[0])
        data = [[v if isinstance(v, (int, float, str)) or v is None else json.dumps(v, ensure_ascii=False)
                 for v in (r.get(c) for c in columns)] for r in rows]
        if self._tb is not None:
            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_markdown_cell(v) for v in row) + " |" for row in data]
            self._tb.add_text(name, "\n".join(lines), global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            import wandb as wandb_mod

            self._wandb.log({name: wandb_mod.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        """Close the file and the writers (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ProgressBar:
    """A tqdm bar over optimizer steps; ``update(step, reward=...)`` moves it to ``step`` and shows the postfix
    values and the seconds per step since the previous update. ``enabled=False`` (ranks other than 0) shows
    nothing."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, desc: str = "grpo"):
        from tqdm.auto import tqdm

        if not isinstance(total, int) or total < 0:
            raise ValueError(f"total must be a non-negative int, got {total!r}")
        self._bar = tqdm(total=total, initial=initial, disable=not enabled, desc=desc, unit="step",
                         dynamic_ncols=True)
        self._step = initial
        self._last = time.perf_counter()

    def update(self, step: int, **postfix) -> None:
        now = time.perf_counter()
        advanced = step - self._step
        shown = {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in postfix.items()}
        if advanced > 0:
            shown["s/step"] = f"{(now - self._last) / advanced:.2f}"
            self._last = now
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(advanced)
        self._step = step

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and "step" in r:
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def plot_metrics(
    jsonl_path: str | os.PathLike,
    png_path: str | os.PathLike,
    keys: Iterable[str] = ("reward/mean", "accuracy", "response_length/mean"),
    eval_keys: Iterable[str] = ("eval/accuracy",),
) -> Path:
    """Plot each metric against step, one panel per key that has data, and save a PNG; return its path.

    Training keys are drawn as lines, evaluation keys as lines with markers (they are logged every few steps).
    Keys with no finite value are skipped; with none at all the figure says so. Uses matplotlib's Agg canvas
    directly (no pyplot, no global backend change), so it works headless.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = read_jsonl(jsonl_path)
    panels = [(k, False) for k in keys] + [(k, True) for k in eval_keys]
    panels = [(k, is_eval, *_series(rows, k)) for k, is_eval in panels]
    panels = [p for p in panels if p[2]]
    fig = Figure(figsize=(5 * max(len(panels), 1), 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    if not panels:
        ax = fig.add_subplot(1, 1, 1)
        ax.axis("off")
        ax.text(0.5, 0.5, f"no data for {list(keys) + list(eval_keys)} in {Path(jsonl_path).name}",
                ha="center", va="center", wrap=True)
    for i, (key, is_eval, xs, ys) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        ax.plot(xs, ys, marker="o" if is_eval or len(xs) == 1 else None, color="C1" if is_eval else "C0")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    return png_path


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_memory_gib(device: torch.device | str) -> float:
    """Peak memory in GiB: CUDA ``max_memory_allocated`` on a GPU; on CPU the process's resident high-water mark
    (``VmHWM``; ``ru_maxrss`` where /proc is missing)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = _proc_status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux (bytes on macOS)
    return kib / 2**20


def reset_peak_memory(device: torch.device | str) -> None:
    """Restart the peak counter read by ``peak_memory_gib`` (CUDA stats; on Linux CPU, ``VmHWM``)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5" resets the resident high-water mark
    except OSError:
        pass  # not Linux: the peak stays the process lifetime's


class Timer:
    """Seconds per named phase, accumulated until ``pop()``::

        timers = Timer(device)
        with timers("generation"):
            ...
        timers.pop(prefix="time/")   # {"time/generation": 1.92}

    On CUDA the device is synchronised when a phase starts and ends (``sync=True``), because kernels run
    asynchronously: without it a phase's GPU work would be billed to whichever later phase happens to wait for
    it. Two synchronisations per phase, a handful per step.
    """

    def __init__(self, device: torch.device | str = "cpu", *, sync: bool = True):
        self.device = torch.device(device)
        self.sync = sync and self.device.type == "cuda"
        self._totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        if self.sync:
            torch.cuda.synchronize(self.device)  # sync: earlier queued work must not count towards this phase
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize(self.device)  # sync: this phase's kernels finish before the clock stops
            self._totals[name] += time.perf_counter() - start

    def totals(self) -> dict[str, float]:
        """The seconds accumulated so far, per phase (not reset)."""
        return dict(self._totals)

    def pop(self, prefix: str = "") -> dict[str, float]:
        """Return ``{prefix + phase: seconds}`` accumulated since the last pop, and reset."""
        out = {prefix + k: v for k, v in self._totals.items()}
        self._totals.clear()
        return out
