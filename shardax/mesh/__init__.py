"""Meshes (named axes over the job's ranks) and joining the job.

``AbstractMesh`` has names and sizes only (planning, ``explain``, offline
resharding); ``Mesh`` is live: this rank's coordinates and the process groups
of every set of axes. ``init()`` reads the environment of ``shardax launch``,
torchrun, Slurm or OpenMPI; ``shutdown()`` leaves.
"""

from ._mesh import AbstractMesh as AbstractMesh
from ._mesh import Mesh as Mesh
from ._mesh import current_mesh as current_mesh
from ._runtime import LaunchEnv as LaunchEnv
from ._runtime import ProcessInfo as ProcessInfo
from ._runtime import detect_env as detect_env
from ._runtime import init as init
from ._runtime import shutdown as shutdown

__all__ = [
    "AbstractMesh",
    "LaunchEnv",
    "Mesh",
    "ProcessInfo",
    "current_mesh",
    "detect_env",
    "init",
    "shutdown",
]
