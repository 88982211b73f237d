"""Elastic restarts: how long a run is down after a rank is lost, and how
many steps it loses, resuming from disk checkpoints or from in-memory ones.

``examples/train_gpt.py --elastic`` runs under ``shardax launch --elastic
1:N --max-restarts 1`` on N ranks; in step ``--kill-step`` the last rank
SIGKILLs itself mid-step (``--kill-at``, after its gradients). The job goes
on on N-1 ranks from its newest checkpoint:

- ``disk``: sharded checkpoints every ``--save-every`` steps (in the
  background, as the example saves by default);
- ``memory``: the same, plus an in-memory checkpoint every step
  (``--memory-ckpt-every 1``): each rank's shards in host memory and with a
  peer rank, the lost rank's rebuilt from its peer's copy.

Every line the launcher relays is stamped when it arrives. Per run:

- ``kill_to_restart_s``: from the lost rank's last line (just before its
  SIGKILL) to the launcher's "restarting" line — noticing the loss and
  stopping the survivors;
- ``kill_to_first_step_s``: to the first step finished after the restart —
  that plus starting the ranks, resuming and one step;
- ``resume_s``: from the restart to the "resumed from" line (start-up and
  the restore itself);
- ``steps_lost``: steps finished before the kill that had to be done again
  (the last finished step less the step resumed from);
- ``recovery_s``: until the run is back where it was — the time to the
  first step plus the lost steps again, at ``step_s`` (the median step time
  before the kill, from rank 0's step lines).

One JSON line per run, then a summary line (medians over ``--repeats``,
interleaved disk/memory) and a table on stderr.

    python benchmarks/elastic.py --preset tiny --nproc 4 --repeats 3 --json elastic.json
    python benchmarks/elastic.py --smoke        # 2 ranks, a few steps: seconds
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("disk", "memory")


def run_once(kind: str, args: argparse.Namespace, work: Path) -> dict:
    """One elastic run; its measurements."""
    out = work / f"{kind}-{time.monotonic_ns()}"
    saving = ["--save-every", str(args.save_every)]
    if kind == "memory":
        saving += ["--memory-ckpt-every", "1"]
    n = args.nproc
    cmd = [sys.executable, "-m", "shardax", "launch", "--nproc-per-node", str(n),
           "--elastic", f"1:{n}", "--max-restarts", "1", "examples/train_gpt.py",
           "--preset", args.preset, "--steps", str(args.steps), "--batch-size",
           str(args.batch_size), "--log-every", "1", "--eval-batches", "0", "--sample-tokens",
           "0", "--out", str(out), "--elastic", "--kill-at", f"{args.kill_step}:{n - 1}",
           *saving]  # fmt: skip
    lines: list[tuple[float, str, str]] = []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip

    def read(stream: object, which: str) -> None:
        for line in stream:  # type: ignore[attr-defined]
            lines.append((time.monotonic(), which, line.rstrip("\n")))

    readers = [threading.Thread(target=read, args=(s, w)) for s, w in
               ((proc.stdout, "out"), (proc.stderr, "err"))]  # fmt: skip
    for t in readers:
        t.start()
    code = proc.wait(timeout=args.timeout)
    for t in readers:
        t.join()
    if code != 0:
        tail = "\n".join(text for _, _, text in lines[-40:])
        raise SystemExit(f"elastic benchmark: the {kind} run failed ({code}):\n{tail}")
    lines.sort(key=lambda x: x[0])
    return measure(kind, lines, args.kill_step)


def measure(kind: str, lines: list[tuple[float, str, str]], kill_step: int) -> dict:
    """The row of one run from its stamped lines."""

    def first(pattern: str, after: float = 0.0) -> tuple[float, re.Match]:
        for when, _, text in lines:
            m = re.search(pattern, text)
            if m and when >= after:
                return when, m
        raise SystemExit(f"elastic benchmark ({kind}): no line matches {pattern!r}")

    killed, _ = first(r"--kill-at: rank \d+ is killed in step")
    before = [when for when, _, text in lines
              if when < killed and re.search(r"\[rank 0\] step +\d+ +loss", text)]  # fmt: skip
    gaps = [b - a for a, b in itertools.pairwise(before[1:])]  # the first step warms up
    step_s = statistics.median(gaps) if gaps else 0.0
    restarted, _ = first(r"restarting on \d+ rank", killed)
    pattern = r"resumed from (host memory|\S+) at step (\d+)|(no checkpoint) in \S+: starting"
    resumed, m = first(pattern, restarted)
    stepped, _ = first(r"\[rank 0\] step +\d+ +loss", resumed)
    resumed_step = int(m.group(2) or 0)  # none committed yet: from the start
    return {
        "checkpoint": kind,
        "kill_to_restart_s": restarted - killed,
        "kill_to_first_step_s": stepped - killed,
        "resume_s": resumed - restarted,
        "resumed_from": "memory" if m.group(1) == "host memory" else "disk",
        "resumed_step": resumed_step,
        "steps_lost": (kill_step - 1) - resumed_step,
        "step_s": step_s,
        # back where it was when the rank died: the restart, then the lost steps again
        "recovery_s": stepped - killed + ((kill_step - 1) - resumed_step) * step_s,
    }


def summary(rows: list[dict]) -> dict:
    out = {}
    for kind in KINDS:
        mine = [r for r in rows if r["checkpoint"] == kind]
        out[kind] = {key: statistics.median(r[key] for r in mine)
                     for key in ("kill_to_restart_s", "kill_to_first_step_s", "resume_s",
                                 "steps_lost", "step_s", "recovery_s")}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="examples/gpt.py preset")
    parser.add_argument("--nproc", type=int, default=4, help="ranks at first (one is lost)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=12, help="global; splits over N and N-1")
    parser.add_argument("--save-every", type=int, default=5, help="disk checkpoints")
    parser.add_argument("--kill-step", type=int, default=9, help="the step the rank dies in")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", type=Path, help="write the rows and the summary here")
    parser.add_argument("--smoke", action="store_true", help="2 ranks, 6 steps, one repeat")
    args = parser.parse_args(argv)
    if args.smoke:
        args.nproc, args.steps, args.batch_size, args.save_every, args.kill_step = 2, 6, 4, 3, 5
        args.repeats = 1
    if not 1 < args.kill_step <= args.steps or args.nproc < 2:
        parser.error("--kill-step must be in 2..--steps and --nproc at least 2")
    rows = []
    with tempfile.TemporaryDirectory(prefix="shardax-elastic-bench-") as work:
        for repeat in range(args.repeats):
            for kind in KINDS if repeat % 2 == 0 else KINDS[::-1]:
                row = {**run_once(kind, args, Path(work)), "repeat": repeat}
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {
        "benchmark": "elastic",
        "preset": args.preset,
        "nproc": args.nproc,
        "steps": args.steps,
        "kill_step": args.kill_step,
        "save_every": args.save_every,
        "rows": rows,
        "summary": summary(rows),
    }
    print(json.dumps({"summary": result["summary"]}), flush=True)
    print(f"{'checkpoint':<10} {'kill->restart s':>16} {'kill->first step s':>19} "
          f"{'resume s':>9} {'steps lost':>10} {'recovery s':>10}", file=sys.stderr)  # fmt: skip
    for kind, s in result["summary"].items():
        print(f"{kind:<10} {s['kill_to_restart_s']:>16.2f} {s['kill_to_first_step_s']:>19.2f} "
              f"{s['resume_s']:>9.2f} {s['steps_lost']:>10g} {s['recovery_s']:>10.2f}",
              file=sys.stderr)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
