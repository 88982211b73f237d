"""A rank that runs all-reduces until rank ``argv[1]`` kills itself (SIGKILL)
at step 20: its peers — on other nodes too — must stop, not hang."""

import os
import signal
import sys

import torch

import shardax as sx

victim = int(sys.argv[1])
sx.init()
mesh = sx.Mesh({"dp": -1})
for step in range(100_000):
    sx.collectives.psum(torch.ones(4), "dp", mesh=mesh)
    if step == 20 and mesh.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
print("the victim never died")
