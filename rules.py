"""Sharding rules, and the namespace where parallelism presets live.

A rule maps key paths (``"blocks.3.attn.qkv.weight"``) to a spec; rule sets
compose with ``+``, first match wins. Presets — ``zero``, ``megatron``,
``ulysses``, experts, pipeline stages — will be functions here that return
:class:`Rules`, nothing more.

>>> import shardax as sx
>>> rules = sx.rules.Rule(r".*\\.weight", sx.P("dp")) + sx.rules.Rule(".*", sx.P())
>>> rules.match("mlp.bias").spec
P()
"""

from .shard._rules import Rule as Rule
from .shard._rules import Rules as Rules

__all__ = ["Rule", "Rules"]
