"""Render pytest-benchmark JSON (``pytest bench/ --benchmark-only --benchmark-json=...``) as PNGs.

    python bench/plot.py                                   # every bench/results/*.json, PNGs beside them
    python bench/plot.py RUN.json [RUN2.json ...] --out DIR
    python bench/plot.py --merge ALL.json A.json B.json    # one run per file (gpu_check.sh) -> one JSON, no plot

One PNG per JSON file and op (``extra_info["op"]``), named ``<json stem>-<op>.png``: one row per group (shape and
mode), time on the left (median and interquartile range of every method, fastgrpo first, the ratio to fastgrpo's
median written on each bar) and peak extra memory on the right. Where a group has a roofline (bytes moved against
the measured copy bandwidth, or FLOPs against the measured matmul rate), its time floor is a dashed line: no method
can beat it. The title names the device, the date and the commit.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
FASTGRPO_COLOR, OTHER_COLOR = "#d62728", "#7f7f7f"


def roofline_ms(info: dict) -> tuple[float, str] | None:
    """The least time the group's work can take on this device, in ms, and what bounds it."""
    if "bytes_moved" in info:
        return info["bytes_moved"] / info["copy_GB/s"] / 1e6, f"copy bandwidth {info['copy_GB/s']:.0f} GB/s"
    if "flops" in info:
        return info["flops"] / info["matmul_TFLOP/s"] / 1e9, f"matmul {info['matmul_TFLOP/s']:.3g} TFLOP/s"
    return None


def _ms(ms: float) -> str:
    return f"{ms / 1e3:.3g} s" if ms >= 1e3 else f"{ms:.3g} ms"


def _order(method: str) -> tuple[int, str]:
    return (0 if method == "fastgrpo" else 1 if method.startswith("fastgrpo") else 2, method)


def plot_op(op: str, groups: dict[str, list[dict]], title: str, path: Path) -> None:
    """One figure: a row per group, time (ms) and peak extra memory (MiB) per method."""
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 0.5 + 0.42 * sum(len(b) + 2 for b in groups.values())),
                             squeeze=False, gridspec_kw={"width_ratios": [3, 2],
                                                         "height_ratios": [len(b) + 1 for b in groups.values()]})
    for (group, benches), (ax_t, ax_m) in zip(sorted(groups.items()), axes):
        benches = sorted(benches, key=lambda b: _order(b["extra_info"]["method"]))
        names = [b["extra_info"]["method"] for b in benches]
        med = [b["stats"]["median"] * 1e3 for b in benches]
        q1 = [b["stats"]["q1"] * 1e3 for b in benches]
        q3 = [b["stats"]["q3"] * 1e3 for b in benches]
        colors = [FASTGRPO_COLOR if n.startswith("fastgrpo") else OTHER_COLOR for n in names]
        ys = range(len(benches))
        ax_t.barh(ys, med, color=colors, xerr=[[m - a for m, a in zip(med, q1)], [b - m for m, b in zip(med, q3)]],
                  capsize=2)
        ours = med[names.index("fastgrpo")] if "fastgrpo" in names else None
        for y, m, hi in zip(ys, med, q3):
            ax_t.text(hi, y, f" {_ms(m)}" + (f" ({m / ours:.2f}× fastgrpo)" if ours else ""), va="center", fontsize=8)
        roof = roofline_ms(benches[0]["extra_info"])
        heading = group
        if roof is not None:
            ax_t.axvline(roof[0], color="black", linestyle="--", linewidth=1)
            heading += f"  (dashed: roofline {_ms(roof[0])} at the measured {roof[1]})"
        ax_t.set_yticks(list(ys), names)
        ax_t.invert_yaxis()
        ax_t.set_xlim(0, max(med + q3) * 1.6)
        ax_t.set_title(heading, fontsize=9, loc="left")
        ax_t.set_xlabel("time per call, ms (median, bar: interquartile range)", fontsize=8)
        mem = [b["extra_info"]["peak_extra_MiB"] for b in benches]
        ax_m.barh(ys, mem, color=colors)
        for y, m in zip(ys, mem):
            ax_m.text(m, y, f" {m:.4g}", va="center", fontsize=8)
        ax_m.set_yticks(list(ys), [""] * len(ys))
        ax_m.invert_yaxis()
        ax_m.set_xlim(0, max(max(mem), 1e-3) * 1.3)
        ax_m.set_xlabel("peak extra memory, MiB", fontsize=8)
        for ax in (ax_t, ax_m):
            ax.tick_params(labelsize=8)
    fig.suptitle(f"{op}: {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_file(json_path: Path, out_dir: Path) -> list[Path]:
    """Every op of one pytest-benchmark JSON file; returns the PNGs written."""
    data = json.loads(json_path.read_text())
    machine, commit = data.get("machine_info", {}), data.get("commit_info", {})
    title = (f"{machine.get('device', machine.get('node', '?'))}, {commit.get('date', data.get('datetime', '?'))}, "
             f"git {commit.get('sha', str(commit.get('id', '?'))[:7])}")
    by_op: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for bench in data["benchmarks"]:
        info = bench.get("extra_info", {})
        if "op" in info and bench.get("stats"):
            by_op[info["op"]][bench["group"]].append(bench)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for op, groups in sorted(by_op.items()):
        path = out_dir / f"{json_path.stem}-{op}.png"
        plot_op(op, groups, title, path)
        written.append(path)
    return written


def merge_runs(paths: list[Path]) -> dict:
    """One pytest-benchmark JSON holding every benchmark of ``paths`` (machine and commit info of the first)."""
    runs = [json.loads(p.read_text()) for p in paths]
    return {**runs[0], "benchmarks": [b for run in runs for b in run["benchmarks"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="*", type=Path, help="pytest-benchmark JSON files (default: bench/results/*.json)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: beside each JSON file)")
    ap.add_argument("--merge", type=Path, default=None, metavar="OUT.json",
                    help="write the given JSON files' benchmarks into one JSON file, and plot nothing")
    args = ap.parse_args()
    if args.merge:
        if not args.json:
            raise SystemExit("--merge needs the JSON files to merge")
        args.merge.write_text(json.dumps(merge_runs(args.json), indent=2))
        print(f"{len(args.json)} runs merged into {args.merge}")
        return
    files = args.json or sorted(RESULTS_DIR.glob("*.json"))
    if not files:
        raise SystemExit(f"no JSON given and none in {RESULTS_DIR}")
    for path in files:
        for png in plot_file(path, args.out or path.parent):
            print(png)


if __name__ == "__main__":
    main()
