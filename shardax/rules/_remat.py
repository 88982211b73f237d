"""Activation checkpointing as a rule: modules rematerialised by path."""

from __future__ import annotations

from collections.abc import Sequence

from ..shard._matching import Rules
from ..shard._modules import ModuleRule
from ..shard._remat import Remat

__all__ = ["remat"]


def remat(
    module: str,
    policy: str = "save_nothing",
    *,
    names: str | Sequence[str] = (),
    every: int = 1,
    kind: str = "host",
) -> Rules:
    """Rematerialise the modules whose path fully matches ``module`` (a
    regex; e.g. ``r"blocks\\.\\d+"``, the transformer blocks): their
    activations are not kept for backward but computed again from their
    inputs, parameters gathered again under ZeRO-3 (the module before
    prefetched meanwhile) and dropout masks replayed — the same loss and
    gradients, less memory, one more forward of those modules.

    ``policy``: what is kept after all — ``"save_nothing"`` (only the
    inputs), ``"save_matmuls"`` (the outputs of the matrix products and
    attention kernels: only the cheap elementwise ops run again), or
    ``"save_names"`` with ``names`` (regexes over submodule paths relative
    to the module, e.g. ``names=("attn",)``: their work is kept, the rest
    is recomputed), or ``"offload_names"``: that work kept in memory
    ``kind`` — ``"host"`` (pinned, beside a GPU) or ``"disk:PATH"`` (files
    in a folder) — and brought back for backward. ``every=k``: only the 1st, (k+1)-th … matching module
    (fewer recomputations, more memory).

    Compose with the model's other rules: ``rules.zero(3) +
    rules.remat(r"blocks\\.\\d+")``.

    >>> import shardax as sx
    >>> sx.rules.remat(r"blocks\\.\\d+", "save_matmuls", every=2).modules[0].remat
    Remat('save_matmuls', every=2)
    """
    return Rules(ModuleRule(module, remat=Remat(policy, names=names, every=every, kind=kind)))
