"""Rank 1 fails (exit 3) until the launcher has restarted the job
``argv[1]`` times; every rank prints the restart count it sees."""

import os
import sys

restart = int(os.environ["SHARDAX_RESTART_COUNT"])
print(f"restart {restart}")
if os.environ["RANK"] == "1" and restart < int(sys.argv[1]):
    sys.exit(3)
