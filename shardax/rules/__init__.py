"""Sharding rules, and the namespace where parallelism presets live.

A rule maps key paths (``"blocks.3.attn.qkv.weight"``) to a spec; rule sets
compose with ``+``, first match wins. Presets are functions that return
:class:`Rules`, nothing more: ``zero`` splits params, grads and optimizer
state over the data axes with :class:`ShardOver` entries.

>>> import shardax as sx
>>> rules = sx.rules.Rule(r".*\\.weight", sx.P("dp")) + sx.rules.Rule(".*", sx.P())
>>> rules.match("mlp.bias").spec
P()
"""

from ..shard._matching import Rule as Rule
from ..shard._matching import Rules as Rules
from ..shard._modules import ModuleRule as ModuleRule
from ..shard._modules import Relayout as Relayout
from ..shard._placement import ShardOver as ShardOver
from ._context import context_parallel as context_parallel
from ._experts import experts as experts
from ._megatron import megatron as megatron
from ._names import GPT2_NAMES as GPT2_NAMES
from ._names import GPT_NAMES as GPT_NAMES
from ._names import LLAMA_NAMES as LLAMA_NAMES
from ._names import TransformerNames as TransformerNames
from ._offload import offload as offload
from ._remat import remat as remat
from ._ulysses import ulysses as ulysses
from ._zero import zero as zero

__all__ = [
    "GPT2_NAMES",
    "GPT_NAMES",
    "LLAMA_NAMES",
    "ModuleRule",
    "Relayout",
    "Rule",
    "Rules",
    "ShardOver",
    "TransformerNames",
    "context_parallel",
    "experts",
    "megatron",
    "offload",
    "remat",
    "ulysses",
    "zero",
]
