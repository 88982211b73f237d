"""Sharded checkpoints: safetensors files of boxes plus one JSON index.

``save`` (collective; atomic) and ``save_async`` write each distinct shard
once; ``load`` reads into any mesh and layout, each rank reading only what
overlaps its pieces; ``CheckpointManager`` numbers, prunes and resumes;
``MemoryCheckpointManager`` keeps snapshots in host memory, each rank's
shards with the rank and a copy with a peer, for restarts after a lost
rank (``shardax launch --elastic``);
``read_index`` gives the parsed index. A checkpoint is never unpickled. The
``shardax ckpt`` command line inspects, verifies, reshards, consolidates and
imports checkpoints; ``import_deepspeed`` turns a DeepSpeed ZeRO checkpoint
(``read_deepspeed``) into a training state to continue from.
"""

from ._deepspeed import deepspeed_state as deepspeed_state
from ._deepspeed import import_deepspeed as import_deepspeed
from ._deepspeed_read import DeepSpeedCheckpoint as DeepSpeedCheckpoint
from ._deepspeed_read import read_deepspeed as read_deepspeed
from ._format import Box as Box
from ._format import Index as Index
from ._format import TensorEntry as TensorEntry
from ._format import ValueEntry as ValueEntry
from ._format import read_index as read_index
from ._load import RNG_POLICIES as RNG_POLICIES
from ._load import load as load
from ._manager import CheckpointManager as CheckpointManager
from ._memory import MemoryCheckpointManager as MemoryCheckpointManager
from ._memory import MemorySnapshot as MemorySnapshot
from ._model import model_metadata as model_metadata
from ._offline import consolidate as consolidate
from ._offline import import_dense as import_dense
from ._offline import reshard as reshard
from ._offline import verify as verify
from ._save import AsyncSave as AsyncSave
from ._save import save as save
from ._save import save_async as save_async

__all__ = [
    "RNG_POLICIES",
    "AsyncSave",
    "Box",
    "CheckpointManager",
    "DeepSpeedCheckpoint",
    "Index",
    "MemoryCheckpointManager",
    "MemorySnapshot",
    "TensorEntry",
    "ValueEntry",
    "consolidate",
    "deepspeed_state",
    "import_deepspeed",
    "import_dense",
    "load",
    "model_metadata",
    "read_deepspeed",
    "read_index",
    "reshard",
    "save",
    "save_async",
    "verify",
]
