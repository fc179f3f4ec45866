"""A hostile reward through a whole GRPO run, as a user would launch it: does every innocent completion keep its
score, and how long does a step wait?

Run: ``python bench/bench_hostile_reward.py`` (``--steps``, ``--timeout-s``, ``--workers``, ``--hang-s``, ``--out``).

The reward (written to a temporary module, imported by the reward workers) picks each completion's behaviour from a
hash of its prompt and text: 1 completion in 23 each hangs for ``--hang-s`` seconds, raises, kills its worker
(``os._exit``) or returns NaN; every other completion scores ``len(completion) % 7 / 7``. Each call appends what it
scored to a per-process record file. The run is ``torchrun --nproc_per_node 1 fastgrpo/train.py`` on the ``tiny``
recipe with ``reward.timeout_s``, ``reward.num_workers``, ``train.max_steps`` from the flags and no validation or
checkpoints (defaults: the settings of the issue that asked for per-completion fault isolation: 2 s, 2 workers,
60 s hangs, 6 steps).

Checks, from the run's own files:

- **innocent scores**: every completion of ``rollouts/step_<N>.jsonl`` whose behaviour is benign carries, under
  ``rewards.hostile``, exactly the score the function gives it alone; every faulty one carries 0;
- **the wait**: each step's ``time/reward_wait`` against ``2 · ⌈F / W⌉ · timeout_s + start-up`` with F the step's
  faulty completions (hangs and exits, which cost a timeout or a respawn; raises and NaNs return at once) and
  ``start-up`` the step's ``time/reward_worker_start``;
- the counters ``reward/hostile/{timeouts,failures,nonfinite,isolated}`` and ``reward/workers_respawned``.

It prints one line per step and a summary, and exits non-zero when a check fails. It times nothing itself: the
waits are the trainer's own metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = {0: "hang", 1: "raise", 2: "exit", 3: "nan"}  # the kind() values that are faulty; 4..22 are benign

HOSTILE = """
    import json, math, os, time, zlib

    HANG_S = {hang_s!r}
    RECORDS = {records!r}

    def kind(prompt, completion):
        return zlib.crc32(f"{{prompt}}\\0{{completion}}".encode()) % 23

    def hostile(prompts, completions, **kw):
        out = []
        for p, c in zip(prompts, completions):
            k = kind(p, c)
            if k == 0:
                time.sleep(HANG_S)
            if k == 1:
                raise RuntimeError("a faulty reward")
            if k == 2:
                os._exit(3)
            out.append(math.nan if k == 3 else len(c) % 7 / 7)
        with open(os.path.join(RECORDS, f"{{os.getpid()}}.jsonl"), "a") as f:
            for p, c, s in zip(prompts, completions, out):
                f.write(json.dumps({{"prompt": p, "completion": c, "score": s}}) + "\\n")
        return out
"""


def kind(prompt: str, completion: str) -> int:
    """The module's behaviour choice, recomputed here (same hash)."""
    return zlib.crc32(f"{prompt}\0{completion}".encode()) % 23


def alone(completion: str) -> float:
    """The score the function gives a benign completion alone."""
    return len(completion) % 7 / 7


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout-s", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--hang-s", type=float, default=60.0)
    ap.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hostile_"))
    out = Path(args.out) if args.out else work / "run"
    records = work / "records"
    records.mkdir()
    (work / "hostile_reward.py").write_text(textwrap.dedent(HOSTILE).format(hang_s=args.hang_s,
                                                                           records=str(records)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(REPO / "fastgrpo" / "train.py"), f"train.max_steps={args.steps}", "eval.at_start=false",
           "eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=0", "logging.progress_bar=false",
           f"logging.output_dir={out}", f"reward.num_workers={args.workers}", f"reward.timeout_s={args.timeout_s}",
           "reward.functions=[hostile_reward:hostile]"]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        return 1

    from fastgrpo.models.loading import build_tiny_tokenizer

    tok = build_tiny_tokenizer()

    def as_scored(logged: str) -> str:  # the rollout log keeps special tokens; the reward saw the text without them
        return tok.decode(tok(logged, add_special_tokens=False).input_ids, skip_special_tokens=True)

    scored: dict[tuple[str, str], set[float]] = {}
    for f in records.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            scored.setdefault((r["prompt"], r["completion"]), set()).add(r["score"])
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    metrics = {m["step"]: m for m in metrics if "time/reward_wait" in m}
    failures, worst = 0, 0.0
    for step in sorted(metrics):
        m = metrics[step]
        rows = [json.loads(x) for x in (out / "rollouts" / f"step_{step:08d}.jsonl").read_text().splitlines()]
        kinds = {"hang": 0, "raise": 0, "exit": 0, "nan": 0}
        bad = 0
        for row in rows:
            text = as_scored(row["completion"])
            k = KINDS.get(kind(row["prompt"], text))
            got = row["rewards"]["hostile"]
            if k is None:
                want = alone(text)
                bad += got != want or scored.get((row["prompt"], text), {want}) != {want}
            else:
                kinds[k] += 1
                bad += got != 0.0
        costly = kinds["hang"] + kinds["exit"]
        bound = 2 * math.ceil(costly / args.workers) * args.timeout_s + m["time/reward_worker_start"]
        wait = m["time/reward_wait"]
        worst = max(worst, wait)
        ok = bad == 0 and wait <= bound
        failures += not ok
        print(f"step {step}: {len(rows)} completions, faulty {kinds}, wrong scores {bad}, "
              f"reward_wait {wait:.2f} s <= bound {bound:.2f} s: {'ok' if wait <= bound else 'OVER'}; counters "
              + ", ".join(f"{c} {int(m[f'reward/hostile/{c}'])}" for c in ("timeouts", "failures", "nonfinite",
                                                                          "isolated"))
              + f", respawned {int(m['reward/workers_respawned'])}; step {m['time/step']:.1f} s", flush=True)
    total = sum(m["time/step"] for m in metrics.values())
    print(f"{len(metrics)} steps in {total:.1f} s of steps; slowest reward wait {worst:.2f} s; "
          f"{'all checks passed' if failures == 0 else f'{failures} steps failed a check'}")
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
