"""Pipeline parallelism, as data: a :class:`Schedule` lists, for each rank,
the compute actions it runs in order; :func:`gpipe`, :func:`one_f_one_b`,
:func:`interleaved_1f1b`, :func:`looped_bfs`, :func:`zero_bubble_h1`,
:func:`zbv` and :func:`dualpipe_v` make the published ones;
:func:`validate` checks any schedule (a typed error instead of a hang),
:func:`simulate` times it — the bubble and each rank's peak activations —
before any rank starts, and :func:`render` draws the timeline (``shardax
pipeline show``). (The executor comes next: issue 21.)

>>> from shardax import pipeline
>>> t = pipeline.simulate(pipeline.one_f_one_b(4, 8), {"F": 1.0, "B": 2.0})
>>> round(t.bubble, 4), t.peak_activations
(0.2727, (4, 3, 2, 1))
"""

from ._executor import value as value
from ._executor import value_and_grad as value_and_grad
from ._explain import PipelineExplanation as PipelineExplanation
from ._explain import RankPlan as RankPlan
from ._explain import explain as explain
from ._generators import dualpipe_v as dualpipe_v
from ._generators import interleaved_1f1b as interleaved_1f1b
from ._generators import looped_bfs as looped_bfs
from ._generators import zbv as zbv
from ._generators import zero_bubble_h1 as zero_bubble_h1
from ._named import SCHEDULES as SCHEDULES
from ._named import schedule as schedule
from ._norm import clip_by_global_norm as clip_by_global_norm
from ._norm import global_norm as global_norm
from ._schedule import Action as Action
from ._schedule import Schedule as Schedule
from ._schedule import gpipe as gpipe
from ._schedule import one_f_one_b as one_f_one_b
from ._show import render as render
from ._simulate import Event as Event
from ._simulate import Timeline as Timeline
from ._simulate import simulate as simulate
from ._simulate import validate as validate
from ._stages import Stages as Stages
from ._stages import split as split

__all__ = [
    "SCHEDULES",
    "Action",
    "Event",
    "PipelineExplanation",
    "RankPlan",
    "Schedule",
    "Stages",
    "Timeline",
    "clip_by_global_norm",
    "explain",
    "dualpipe_v",
    "global_norm",
    "gpipe",
    "interleaved_1f1b",
    "looped_bfs",
    "one_f_one_b",
    "render",
    "schedule",
    "simulate",
    "split",
    "validate",
    "value",
    "value_and_grad",
    "zbv",
    "zero_bubble_h1",
]
