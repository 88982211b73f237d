"""shardax: JAX-style functional sharding for PyTorch.

Describe a mesh, say with specs or rules how each tensor is split over it,
and let pure functions move pytrees between layouts:

>>> import torch, shardax as sx
>>> sx.init()                                   # world size 1 here: no launcher needed
ProcessInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=device(type='cpu'), backend=None, source='none')
>>> mesh = sx.Mesh({"dp": -1})
>>> x = sx.shard(torch.arange(6.0).reshape(3, 2), mesh, sx.P("dp", None))
>>> sx.gather(sx.transfer(x, sx.P(None, "dp")))
tensor([[0., 1.],
        [2., 3.],
        [4., 5.]])
"""

from . import ckpt as ckpt
from . import collectives as collectives
from . import config as config
from . import data as data
from . import moe as moe
from . import monitor as monitor
from . import optim as optim
from . import pipeline as pipeline
from . import plan as plan
from . import rules as rules
from . import testing as testing
from .errors import CheckpointError as CheckpointError
from .errors import CollectiveError as CollectiveError
from .errors import CollectiveMismatchError as CollectiveMismatchError
from .errors import CollectiveTimeoutError as CollectiveTimeoutError
from .errors import ConfigError as ConfigError
from .errors import LaunchError as LaunchError
from .errors import MeshError as MeshError
from .errors import PlanError as PlanError
from .errors import ScheduleError as ScheduleError
from .errors import ShardingError as ShardingError
from .errors import SplitTensorError as SplitTensorError
from .errors import UnmatchedRulesWarning as UnmatchedRulesWarning
from .errors import UnshardedWeightWarning as UnshardedWeightWarning
from .mesh import AbstractMesh as AbstractMesh
from .mesh import Mesh as Mesh
from .mesh import init as init
from .mesh import shutdown as shutdown
from .shard import Blocks as Blocks
from .shard import Explanation as Explanation
from .shard import GlobalPositions as GlobalPositions
from .shard import Layout as Layout
from .shard import ModuleRule as ModuleRule
from .shard import NamedSharding as NamedSharding
from .shard import P as P
from .shard import PartitionSpec as PartitionSpec
from .shard import Placement as Placement
from .shard import Plan as Plan
from .shard import Relayout as Relayout
from .shard import Remat as Remat
from .shard import Ring as Ring
from .shard import RingAttention as RingAttention
from .shard import Rule as Rule
from .shard import Rules as Rules
from .shard import SequencePiece as SequencePiece
from .shard import Sharded as Sharded
from .shard import SplitOutput as SplitOutput
from .shard import Step as Step
from .shard import Zigzag as Zigzag
from .shard import apply as apply
from .shard import blocks as blocks
from .shard import explain as explain
from .shard import gather as gather
from .shard import init_params as init_params
from .shard import layouts_for as layouts_for
from .shard import local_sizes as local_sizes
from .shard import manual_seed as manual_seed
from .shard import params_of as params_of
from .shard import plan_transfer as plan_transfer
from .shard import recomputing as recomputing
from .shard import remat as remat
from .shard import reshard as reshard
from .shard import ring_attention as ring_attention
from .shard import role_layout as role_layout
from .shard import shard as shard
from .shard import transfer as transfer
from .shard import ulysses_attention as ulysses_attention
from .shard import uncounted as uncounted
from .shard import value_and_grad as value_and_grad
from .shard import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from .shard import vocab_parallel_embedding as vocab_parallel_embedding
from .shard import zigzag as zigzag

__version__ = "0.1.0.dev0"

__all__ = [
    "Explanation",
    "GlobalPositions",
    "Placement",
    "Plan",
    "Step",
    "layouts_for",
    "role_layout",
    "AbstractMesh",
    "Blocks",
    "CheckpointError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Layout",
    "ConfigError",
    "PlanError",
    "LaunchError",
    "Mesh",
    "MeshError",
    "ScheduleError",
    "ModuleRule",
    "NamedSharding",
    "P",
    "PartitionSpec",
    "Relayout",
    "Remat",
    "Ring",
    "RingAttention",
    "SequencePiece",
    "Rule",
    "Rules",
    "ShardingError",
    "SplitTensorError",
    "Sharded",
    "SplitOutput",
    "UnmatchedRulesWarning",
    "UnshardedWeightWarning",
    "Zigzag",
    "apply",
    "blocks",
    "ckpt",
    "collectives",
    "config",
    "data",
    "monitor",
    "moe",
    "explain",
    "gather",
    "init",
    "init_params",
    "local_sizes",
    "manual_seed",
    "optim",
    "pipeline",
    "plan",
    "params_of",
    "plan_transfer",
    "recomputing",
    "remat",
    "reshard",
    "ring_attention",
    "rules",
    "testing",
    "shard",
    "shutdown",
    "transfer",
    "ulysses_attention",
    "uncounted",
    "value_and_grad",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
    "zigzag",
]
