"""Specs, layouts, ``Sharded`` pytrees and the one relayout planner.

``P``/``PartitionSpec`` and ``NamedSharding`` say which mesh axes split which
dims; a ``Layout`` adds the axes over which values are pending sums;
``Sharded`` is a pytree leaf holding this rank's piece. ``transfer`` moves a
value between layouts with the collectives ``plan_transfer`` picks; ``shard``,
``gather`` and ``reshard`` apply it over pytrees; ``Rule``/``Rules`` map key
paths to specs (``ShardOver`` adds ZeRO's splits, giving each parameter a
``Placement``); ``explain`` prints the plan. ``params_of``/``init_params``
bring a module's parameters in, ``apply`` runs the module on them and
``value_and_grad`` differentiates through it; ``remat`` (and the rule
``rules.remat``) recomputes activations in backward instead of keeping them.
"""

from ._api import gather as gather
from ._api import layouts_for as layouts_for
from ._api import reshard as reshard
from ._api import shard as shard
from ._apply import apply as apply
from ._explain import Explanation as Explanation
from ._explain import explain as explain
from ._grad import value_and_grad as value_and_grad
from ._keep import uncounted as uncounted
from ._layout import Layout as Layout
from ._matching import Rule as Rule
from ._matching import Rules as Rules
from ._modules import ModuleRule as ModuleRule
from ._modules import Relayout as Relayout
from ._modules import SplitOutput as SplitOutput
from ._params import init_params as init_params
from ._params import params_of as params_of
from ._placement import Placement as Placement
from ._placement import ShardOver as ShardOver
from ._placement import role_layout as role_layout
from ._plan import Plan as Plan
from ._plan import Step as Step
from ._plan import plan_transfer as plan_transfer
from ._random import manual_seed as manual_seed
from ._remat import Remat as Remat
from ._remat import recomputing as recomputing
from ._remat import remat as remat
from ._ring import ring_attention as ring_attention
from ._ring_modes import GlobalPositions as GlobalPositions
from ._ring_modes import Ring as Ring
from ._ring_modes import RingAttention as RingAttention
from ._ring_modes import SequencePiece as SequencePiece
from ._sharded import Sharded as Sharded
from ._spec import Blocks as Blocks
from ._spec import NamedSharding as NamedSharding
from ._spec import P as P
from ._spec import PartitionSpec as PartitionSpec
from ._spec import Zigzag as Zigzag
from ._spec import blocks as blocks
from ._spec import zigzag as zigzag
from ._tensor_parallel import local_sizes as local_sizes
from ._tensor_parallel import ulysses_attention as ulysses_attention
from ._tensor_parallel import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from ._tensor_parallel import vocab_parallel_embedding as vocab_parallel_embedding
from ._transfer import transfer as transfer

__all__ = [
    "Blocks",
    "Explanation",
    "GlobalPositions",
    "Layout",
    "ModuleRule",
    "NamedSharding",
    "P",
    "PartitionSpec",
    "Placement",
    "Plan",
    "Relayout",
    "Remat",
    "Ring",
    "RingAttention",
    "SequencePiece",
    "Rule",
    "Rules",
    "ShardOver",
    "Sharded",
    "SplitOutput",
    "Step",
    "Zigzag",
    "apply",
    "blocks",
    "explain",
    "gather",
    "init_params",
    "layouts_for",
    "local_sizes",
    "manual_seed",
    "params_of",
    "plan_transfer",
    "recomputing",
    "remat",
    "reshard",
    "ring_attention",
    "role_layout",
    "shard",
    "transfer",
    "ulysses_attention",
    "uncounted",
    "value_and_grad",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
    "zigzag",
]
