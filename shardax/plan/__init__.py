"""The parallelism planner: predicted step time and memory of a training
layout on a cluster, and the search for the best one (``shardax plan``)."""

from ._cluster import PRESETS as PRESETS
from ._cluster import Cluster as Cluster
from ._cluster import Link as Link
from ._cost import Estimate as Estimate
from ._cost import collective_time as collective_time
from ._cost import predict as predict
from ._model import ModelShape as ModelShape
from ._probe import this_machine as this_machine
from ._search import Ranking as Ranking
from ._search import Space as Space
from ._search import search as search

__all__ = [
    "PRESETS", "Cluster", "Estimate", "Link", "ModelShape", "Ranking", "Space",
    "collective_time", "predict", "search", "this_machine",
]  # fmt: skip
