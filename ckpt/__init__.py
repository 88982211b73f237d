"""Sharded checkpoints: safetensors files of boxes plus one JSON index.

``save`` (collective; atomic) and ``save_async`` write each distinct shard
once; ``load`` reads into any mesh and layout, each rank reading only what
overlaps its pieces; ``CheckpointManager`` numbers, prunes and resumes;
``read_index`` gives the parsed index. Nothing is ever unpickled. The
``shardax ckpt`` command line inspects, verifies, reshards, consolidates and
imports checkpoints.
"""

from ._format import Box as Box
from ._format import Index as Index
from ._format import TensorEntry as TensorEntry
from ._format import ValueEntry as ValueEntry
from ._format import read_index as read_index
from ._load import load as load
from ._manager import CheckpointManager as CheckpointManager
from ._save import AsyncSave as AsyncSave
from ._save import save as save
from ._save import save_async as save_async

__all__ = [
    "AsyncSave",
    "Box",
    "CheckpointManager",
    "Index",
    "TensorEntry",
    "ValueEntry",
    "load",
    "read_index",
    "save",
    "save_async",
]
