"""Pipeline parallelism, as data: a :class:`Schedule` lists, for each rank,
the compute actions it runs in order; :func:`gpipe` and
:func:`one_f_one_b` make the classic ones; :func:`validate` checks any
schedule (a typed error instead of a hang) and :func:`simulate` times it —
the bubble and each rank's peak activations — before any rank starts.
(The executor, stage rules and the other schedules come next: issue 21.)

>>> from shardax import pipeline
>>> t = pipeline.simulate(pipeline.one_f_one_b(4, 8), {"F": 1.0, "B": 2.0})
>>> round(t.bubble, 4), t.peak_activations
(0.2727, (4, 3, 2, 1))
"""

from ._schedule import Action as Action
from ._schedule import Schedule as Schedule
from ._schedule import gpipe as gpipe
from ._schedule import one_f_one_b as one_f_one_b
from ._simulate import Event as Event
from ._simulate import Timeline as Timeline
from ._simulate import simulate as simulate
from ._simulate import validate as validate

__all__ = [
    "Action",
    "Event",
    "Schedule",
    "Timeline",
    "gpipe",
    "one_f_one_b",
    "simulate",
    "validate",
]
