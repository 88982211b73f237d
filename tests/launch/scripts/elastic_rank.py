"""A rank of an elastic job, without torch (fast): prints what it sees —
its rank, the world, ``SHARDAX_ELASTIC``, its slot of host memory and the
slots left — then, while ``SHARDAX_RESTART_COUNT`` < argv[3] (default 1),
the ranks listed in argv[1] fail as argv[2] says: ``sigkill`` (killed),
``error`` (a traceback of its own), ``peer`` (the error a rank gets when a
peer goes away); the other ranks wait, as in a collective, until the
launcher stops them. Once the failing tries are over, every rank exits 0."""

import json
import os
import signal
import sys
import time

restart = int(os.environ["SHARDAX_RESTART_COUNT"])
rank = int(os.environ["RANK"])
memory = os.environ.get("SHARDAX_MEMORY_DIR")
seen = {
    "restart": restart,
    "rank": rank,
    "world": int(os.environ["WORLD_SIZE"]),
    "elastic": os.environ.get("SHARDAX_ELASTIC"),
    "memory": memory,
    "slots": sorted(os.listdir(os.path.dirname(memory))) if memory else None,
    "pid": os.getpid(),
}
print("SEEN " + json.dumps(seen), flush=True)
victims = [int(r) for r in sys.argv[1].split(",") if r]
tries = int(sys.argv[3]) if len(sys.argv) > 3 else 1
if restart < tries:
    if rank in victims:
        if sys.argv[2] == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if sys.argv[2] == "error":
            raise ValueError(f"rank {rank}: boom")
        if sys.argv[2] == "peer":
            print("Traceback (most recent call last):", file=sys.stderr)
            print("RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1", file=sys.stderr)
            sys.exit(1)
    time.sleep(300)  # blocked, as in a collective: the launcher stops it
