"""A rank that does what argv tells it, for the fail-fast and signal tests.

argv: PID_DIR ACTION_OF_RANK_0 ACTION_OF_RANK_1 ...

Every rank first writes ``PID_DIR/rank<k>.pids`` (its pid, then the pids of
any child it started), atomically, so the test knows what must be gone later.
Ranks that fail wait until every rank has written its file, so that no rank is
stopped before the test could learn its pid.
"""

import os
import signal
import subprocess
import sys
import time

pid_dir, actions = sys.argv[1], sys.argv[2:]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
action = actions[rank]


def write_pids(*pids):
    path = os.path.join(pid_dir, f"rank{rank}.pids")
    with open(path + ".tmp", "w") as f:
        f.write(" ".join(map(str, pids)))
    os.replace(path + ".tmp", path)


def wait_for_everyone(timeout=30.0):
    deadline = time.monotonic() + timeout
    names = {f"rank{k}.pids" for k in range(world)}
    while not names <= set(os.listdir(pid_dir)) and time.monotonic() < deadline:
        time.sleep(0.02)


children = []
if action in ("sleep-grandchild", "ok-grandchild"):
    children.append(subprocess.Popen(["sleep", "600"]).pid)
if action == "sleep-ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if action == "term-exit5":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(5))
write_pids(os.getpid(), *children)

if action.startswith("sleep") or action == "term-exit5":
    print(f"rank {rank} sleeping", flush=True)
    time.sleep(600)
elif action == "raise":
    wait_for_everyone()
    raise ValueError("boom")
elif action == "exit3":
    wait_for_everyone()
    sys.exit(3)
elif action == "sigkill":
    wait_for_everyone()
    os.kill(os.getpid(), signal.SIGKILL)
elif action == "quiet-exit2":  # no traceback: says why on stdout, a progress bar on stderr
    wait_for_everyone()
    print("fatal: cannot open shard 3", flush=True)
    sys.stderr.write("\rstep 1/10\rstep 2/10\n\n")
    sys.stderr.flush()
    print("giving up", flush=True)
    sys.exit(2)
elif action not in ("ok", "ok-grandchild"):
    raise SystemExit(f"behave.py: unknown action {action!r}")
