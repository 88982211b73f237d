"""``shardax launch``: start N local ranks with torchrun's environment,
prefix their output with ``[rank k] ``, and fail fast — when one rank dies,
all stop, leaving no process behind, and its traceback is shown.

The layers stay apart so multi-node launching can grow on them:
:class:`LaunchSpec` and :func:`rank_env` *describe* a launch,
:func:`launch` spawns and supervises the processes, and the output
streaming lives in its own module. See ``docs/launch.md``.

>>> import sys
>>> from shardax.launch import launch
>>> launch([sys.executable, "-c", "print('hello')"], nproc_per_node=1)
[rank 0] hello
0
"""

from ._launcher import launch as launch
from ._spec import LaunchSpec as LaunchSpec
from ._spec import free_port as free_port
from ._spec import rank_command as rank_command
from ._spec import rank_env as rank_env

__all__ = ["LaunchSpec", "free_port", "launch", "rank_command", "rank_env"]
