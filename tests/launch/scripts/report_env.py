"""A rank that reports what the launcher gave it, then exits 0.

stdout: ``ENV {json}`` with the launcher's variables and ``argv``; stderr: one
line; then a last stdout line without a newline.
"""

import json
import os
import sys

NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SHARDAX_LAUNCHED",
    "PYTHONUNBUFFERED",
    "GLOO_SOCKET_IFNAME",
    "OMP_NUM_THREADS",
    "THP_MEM_ALLOC_ENABLE",
)

report = {name: os.environ.get(name) for name in NAMES}
report["argv"] = sys.argv[1:]
report["executable"] = sys.executable
print("ENV " + json.dumps(report))
print(f"stderr of rank {os.environ['RANK']}", file=sys.stderr)
sys.stdout.write("no newline at the end")
