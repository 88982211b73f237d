"""A rank that writes many long lines to stdout and stderr, to catch lines of
different ranks mixed within a line. argv: the number of lines."""

import os
import sys

rank = os.environ["RANK"]
for i in range(int(sys.argv[1])):
    stream = sys.stdout if i % 2 else sys.stderr
    stream.write(f"line {i} of rank {rank} " + rank * 200 + "\n")
