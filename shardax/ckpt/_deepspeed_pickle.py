"""Reading DeepSpeed's pickles without running them.

DeepSpeed saves its checkpoints with ``torch.save``: pickles, which may name
any Python callable to run while loading. Each file is read here with
``torch.load(weights_only=True)`` — torch's restricted unpickler builds only
tensors, plain containers and the classes allowed by name — after its
globals are listed from the pickle's opcodes (no code runs for that
either). The allowed names are exactly the classes DeepSpeed itself writes
(:data:`ALLOWED`); anything else is refused by its dotted name before
loading. DeepSpeed need not be installed: each allowed name is built as a
small stand-in here — a record of the attributes the file sets — never as
DeepSpeed's class.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError

__all__ = [
    "ALLOWED",
    "FragmentAddress",
    "LossScalerRecord",
    "ZeroStage",
    "load_pickle",
    "scaler_fields",
]


class _Record:
    """The attributes a pickle set on an instance of an allowed class, and
    nothing else: no methods of the class it stands in for."""

    def fields(self) -> dict[str, Any]:
        return dict(vars(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class LossScalerRecord(_Record):
    """DeepSpeed's ``LossScaler`` (static) or ``DynamicLossScaler``: ``cur_scale``,
    and for the dynamic one ``cur_iter``, ``last_overflow_iter``,
    ``scale_factor``, ``scale_window``, ``min_scale``, ``delayed_shift``,
    ``cur_hysteresis``, ``consecutive_hysteresis``."""


class FragmentAddress(_Record):
    """DeepSpeed's ``fragment_address``: where a parameter's piece lies in a
    rank's flat partition (``start``, ``numel``). Read, not needed."""


class ZeroStage(int):
    """DeepSpeed's ``ZeroStageEnum`` member, as its stage number."""


def scaler_fields(scaler: Any) -> dict[str, Any]:
    """The numbers of a loss scaler a file holds (BF16_Optimizer writes
    none: a static scale of 1)."""
    if isinstance(scaler, LossScalerRecord):
        return {k: v for k, v in scaler.fields().items() if isinstance(v, (int, float, bool))}
    return {"cur_scale": 1.0, "dynamic": False}


ALLOWED: dict[str, type] = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerRecord,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": LossScalerRecord,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}
"""The classes DeepSpeed's checkpoint files hold (found in files DeepSpeed
0.19 writes for ZeRO-1, 2 and 3 in fp32, bf16 and fp16), by dotted name,
with the stand-in each is built as. Tensors, ``torch.Size``, dtypes,
``OrderedDict`` and plain containers are torch's own ``weights_only``
allowlist."""

_SAFE = [(cls, name) for name, cls in ALLOWED.items()]


def _globals_of(path: Path) -> list[str]:
    """The globals the pickle in ``path`` names beyond torch's own
    allowlist, from its opcodes (nothing is built or run)."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception as e:  # not a torch zip file: a truncated or foreign file
        raise CheckpointError(f"{path} is not a torch.save file DeepSpeed wrote: {e}") from None


def load_pickle(path: str | os.PathLike[str]) -> Any:
    """The object ``torch.save`` wrote to ``path``, read with
    ``weights_only=True`` on the CPU, allowing DeepSpeed's own classes
    (:data:`ALLOWED`, built as stand-ins); a file naming any other global is
    refused with a :class:`CheckpointError` naming it, and nothing in it runs.

    >>> import os, tempfile, torch
    >>> path = os.path.join(tempfile.mkdtemp(), "x.pt")
    >>> torch.save({"w": torch.ones(2), "step": 3}, path)
    >>> load_pickle(path)
    {'w': tensor([1., 1.]), 'step': 3}
    >>> torch.save({"w": torch.ones(2), "f": os.getcwd}, path)
    >>> load_pickle(path)
    Traceback (most recent call last):
    ...
    shardax.errors.CheckpointError: .../x.pt names posix.getcwd, which is not among the classes DeepSpeed writes ...
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no file at {path}")
    refused = sorted(set(_globals_of(path)) - set(ALLOWED))
    if refused:
        raise CheckpointError(
            f"{path} names {', '.join(refused)}, which "
            f"{'is' if len(refused) == 1 else 'are'} not among the classes DeepSpeed writes "
            f"({', '.join(sorted(ALLOWED))}); it was not unpickled and nothing in it ran. A "
            "checkpoint holding other objects (your client_state, say) cannot be imported as it "
            "is: save it without them"
        )
    try:
        with torch.serialization.safe_globals(_SAFE):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, OSError …
        raise CheckpointError(
            f"cannot read {path} with torch.load(weights_only=True) (nothing in it ran): {e}"
        ) from None
