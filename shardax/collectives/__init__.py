"""Differentiable collectives over mesh axes, with JAX's names.

``psum``, ``pmean``, ``pmax``, ``pmin``, ``all_gather``, ``psum_scatter``,
``all_to_all``, ``ragged_all_to_all`` (with ``exchange_sizes``), ``ppermute``,
``broadcast``, ``axis_index``, ``axis_size``, ``barrier``; ``quantized_psum_scatter``
(ZeRO++'s qgZ: an int4 reduce-scatter in two all-to-alls, within then across nodes);
``onebit_pmean`` (1-bit Adam's mean: signs and a scale, with error feedback); ``count_once`` for a loss every rank computes identically.
Their autograd transposes are one table (:mod:`shardax.collectives._ops`).

One return rule for every collective that returns a tensor: it returns the
result (differentiable); ``out=buf`` writes it into ``buf`` and returns
``buf`` (not differentiable; a misfit names the op, the axis and the shape
the result needs); ``async_op=True`` returns a :class:`Handle` whose
``wait()`` returns either. Details in :mod:`shardax.collectives._api`.

Backends sit behind one small interface (:class:`Backend`); ``torch`` (gloo
on CPU, NCCL on GPU) is the reference, ``shm`` the default for CPU ranks on
a node, ``cupy`` (NCCL communicators made by CuPy) for GPU ranks where CuPy
loads. ``SHARDAX_BACKEND`` chooses, for each process group as the mesh makes
it.
"""

from ..mesh._groups import Group as Group
from ._agree import moving as moving
from ._api import all_gather as all_gather
from ._api import all_to_all as all_to_all
from ._api import apply_op as apply_op
from ._api import axis_index as axis_index
from ._api import axis_size as axis_size
from ._api import barrier as barrier
from ._api import broadcast as broadcast
from ._api import count_once as count_once
from ._api import pmax as pmax
from ._api import pmean as pmean
from ._api import pmin as pmin
from ._api import ppermute as ppermute
from ._api import psum as psum
from ._api import psum_scatter as psum_scatter
from ._backend import Backend as Backend
from ._backend import Handle as Handle
from ._backend import backend_names as backend_names
from ._backend import get_backend as get_backend
from ._onebit import onebit_errors as onebit_errors
from ._onebit import onebit_pmean as onebit_pmean
from ._ops import chunk_sizes as chunk_sizes
from ._ops import transpose as transpose
from ._p2p import recv as recv
from ._p2p import send as send
from ._qgz import quantized_psum_scatter as quantized_psum_scatter
from ._ragged import exchange_sizes as exchange_sizes
from ._ragged import ragged_all_to_all as ragged_all_to_all
from ._traffic import Traffic as Traffic
from ._traffic import traffic as traffic

__all__ = [
    "Backend",
    "Group",
    "Handle",
    "Traffic",
    "all_gather",
    "all_to_all",
    "apply_op",
    "axis_index",
    "axis_size",
    "backend_names",
    "barrier",
    "broadcast",
    "chunk_sizes",
    "count_once",
    "exchange_sizes",
    "get_backend",
    "moving",
    "onebit_errors",
    "onebit_pmean",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "quantized_psum_scatter",
    "ragged_all_to_all",
    "recv",
    "send",
    "traffic",
    "transpose",
]
