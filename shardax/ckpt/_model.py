"""What a checkpoint records of the model it came from, so that
``consolidate`` can give the model back files it loads as its own: the
names a tied parameter also goes by, the buffers its ``state_dict`` leaves
out, and a Hugging Face model's config."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import CheckpointError

__all__ = ["MODEL_KEY", "model_metadata"]

MODEL_KEY = "model"  # the metadata key


def model_metadata(model: nn.Module) -> dict[str, Any]:
    """Metadata for ``save(..., metadata=...)`` describing ``model``:

    - ``aliases``: each other name of a tied parameter → the name
      :func:`shardax.params_of` keeps (GPT-2's ``lm_head.weight`` →
      ``transformer.wte.weight``); ``consolidate`` writes it under both, as
      ``model.state_dict()`` has it;
    - ``not_saved``: buffers outside ``state_dict()`` (non-persistent:
      rotary frequencies, masks), which ``consolidate`` leaves out;
    - ``class`` and, for a Hugging Face model, ``hf_config`` (its
      ``config.to_dict()``), which ``consolidate(..., hf=True)`` writes as
      ``config.json``.

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> model_metadata(torch.nn.Sequential(lin, lin))["model"]["aliases"]
    {'1.weight': '0.weight', '1.bias': '0.bias'}
    """
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"model_metadata needs an nn.Module; got {type(model).__name__}")
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    kept = set(model.state_dict(keep_vars=True))
    not_saved = [name for name, _ in model.named_buffers() if name not in kept]
    out: dict[str, Any] = {
        "aliases": aliases,
        "not_saved": not_saved,
        "class": type(model).__name__,
    }
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        out["hf_config"] = config.to_dict()
    return {MODEL_KEY: out}
