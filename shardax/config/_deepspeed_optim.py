"""The DeepSpeed importer's optimizers: the ``optimizer`` section as
``optimizer.type`` and its settings, DeepSpeed's 1-bit optimizers
(OnebitAdam, OnebitLamb, ZeroOneAdam) with their own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._deepspeed_values import Put, Skip, _bad, _flag, _number, _section, _whole
from ._fields import OPTIMIZERS

_DS_OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "lamb": "lamb", "lion": "lion", "sgd": "sgd",
                  "adagrad": "adagrad", "rmsprop": "rmsprop", "fusedadam": "adam",
                  "cpuadam": "adam", "deepspeedcpuadam": "adam", "onebitadam": "onebit_adam",
                  "onebitlamb": "onebit_lamb", "zerooneadam": "zero_one_adam",
                  "muon": "muon"}  # fmt: skip
_ONEBIT_NOTES = {
    "cuda_aware": "shardax's 1-bit collectives run over the mesh's backend",
    "comm_backend_name": "shardax's 1-bit collectives run over the mesh's backend",
}
_ZERO_ONE_KEYS = ("var_update_scaler", "local_step_scaler", "local_step_clipper")
_LAMB_KEYS = ("max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min",
              "factor_threshold")  # fmt: skip


_ONEBIT_KEYS = {  # the keys _ds_onebit reads, by optimizer
    "onebit_adam": ("freeze_step", "bias_correction", *_ONEBIT_NOTES, *_LAMB_KEYS),
    "onebit_lamb": ("freeze_step", "bias_correction", *_ONEBIT_NOTES),
    "zero_one_adam": ("bias_correction", *_ONEBIT_NOTES),
}


def _optimizer_name(opt: Any) -> str | None:
    """The shardax optimizer a DeepSpeed ``optimizer`` section makes (None: unknown)."""
    if not isinstance(opt, Mapping):
        return None
    name = _DS_OPTIMIZERS.get(str(opt.get("type", "")).lower().replace("_", ""))
    params = opt.get("params") or {}
    if name == "adam" and (not isinstance(params, Mapping) or params.get("adam_w_mode", True)):
        return "adamw"  # DeepSpeed's Adam decouples weight decay unless told not to
    return name


def _ds_optimizer(opt: Mapping[str, Any], put: Put, skip: Skip) -> None:
    name = _optimizer_name(opt)
    if name is None:
        skip(f"optimizer.type={opt.get('type')!r}", f"shardax has {', '.join(OPTIMIZERS)}")
        return
    put("optimizer", "type", name)
    if name == "muon":
        _ds_muon(_section("optimizer.params", opt.get("params", {})), put, skip)
        return
    if name in ("onebit_adam", "zero_one_adam"):  # DeepSpeed's correct no bias, whatever the flag
        put("optimizer", "bias_correction", False)
    lamb: dict[str, float] = {}  # OnebitLamb's trust ratio settings
    zero_one: dict[str, int] = {}  # ZeroOneAdam's policies
    params = _section("optimizer.params", opt.get("params", {}))
    if name == "zero_one_adam" and params.get("var_freeze_step", "auto") == "auto":
        put("optimizer", "freeze_step", 100000)  # DeepSpeed's default var_freeze_step
    for k, v in params.items():
        where = f"optimizer.params.{k}"
        if v == "auto":
            continue
        if name == "onebit_lamb" and k in _LAMB_KEYS:
            lamb[k] = _number(where, v)
        elif name == "zero_one_adam" and k in _ZERO_ONE_KEYS:
            zero_one[k] = _whole(where, v)
        elif name == "zero_one_adam" and k == "var_freeze_step":
            put("optimizer", "freeze_step", _whole(where, v))
        elif k in _ONEBIT_KEYS.get(name, ()):
            _ds_onebit(name, k, v, where, put, skip)
        elif k in ("lr", "eps", "weight_decay", "momentum"):
            put("optimizer", k, _number(where, v))
        elif k == "betas":
            if not isinstance(v, list):
                raise _bad(where, v, "a list of two numbers")
            put("optimizer", "betas", [_number(f"{where}[{i}]", b) for i, b in enumerate(v)])
        elif k == "adam_w_mode":  # Adam: read above; AdamW: DeepSpeed ignores it
            _flag(where, v)
        elif k == "bias_correction":
            if _flag(where, v):
                continue  # the default
            if name in ("adam", "adamw"):
                put("optimizer", "bias_correction", False)  # FusedAdam's bias_correction=False
            else:
                skip(where, f"shardax's {name} always corrects the moment bias")
        elif k in ("torch_adam", "fused", "amsgrad") and not v:
            continue
        elif k in ("torch_adam", "fused") and _flag(where, v):  # which kernel, not what it computes
            skip(where, "torch.optim's implementation of the same arithmetic", False)
        else:
            skip(where, "no shardax setting for it")
    if lamb:
        put("optimizer", "lamb", lamb)
    if zero_one:
        put("optimizer", "zero_one", zero_one)


def _ds_onebit(name: str, key: str, value: Any, where: str, put: Put, skip: Skip) -> None:
    """A setting of DeepSpeed's OnebitAdam or OnebitLamb."""
    if key == "freeze_step":
        put("optimizer", "freeze_step", _whole(where, value))
    elif key == "bias_correction":
        _flag(where, value)
        ds_name = {"onebit_adam": "OnebitAdam", "onebit_lamb": "OnebitLamb"}.get(
            name, "ZeroOneAdam"
        )
        skip(where, f"DeepSpeed's {ds_name} corrects no moment bias whatever it says, and "
             "neither does this conversion", False)  # fmt: skip
    elif key in _ONEBIT_NOTES:
        skip(where, _ONEBIT_NOTES[key], False)
    else:  # a trust ratio setting given to OnebitAdam, which DeepSpeed does not read
        skip(where, "a setting of OnebitLamb; DeepSpeed's OnebitAdam does not read it", False)


_MUON_DEFAULTS = {"lr": 0.02, "adam_lr": 3e-4, "momentum": 0.95, "betas": [0.9, 0.95],
                  "eps": 1e-10, "weight_decay": 0.0}  # fmt: skip
"""DeepSpeed's MuonWithAuxAdam's defaults: its Muon group's lr and momentum,
its Adam group's lr, betas and eps."""


def _ds_muon(params: Mapping[str, Any], put: Put, skip: Skip) -> None:
    """DeepSpeed's Muon (``MuonWithAuxAdam``): Keller Jordan's scale
    (``muon.scale: spectral``), its Muon and Adam groups' learning rates
    (``lr``, or ``muon_lr`` / ``adam_lr`` for one group), and its defaults
    where a key is left out."""
    got = {k: v for k, v in params.items() if v != "auto"}
    for k in got:
        if k not in ("lr", "muon_lr", "adam_lr", "momentum", "betas", "eps", "weight_decay",
                     "ns_method"):  # fmt: skip
            skip(f"optimizer.params.{k}", "no shardax setting for it")
    number = {
        k: _number(f"optimizer.params.{k}", got[k]) for k in got if k not in ("betas", "ns_method")
    }
    muon_lr = number.get("muon_lr", number.get("lr", _MUON_DEFAULTS["lr"]))
    adam_lr = number.get("adam_lr", number.get("lr", _MUON_DEFAULTS["adam_lr"]))
    betas = got.get("betas", _MUON_DEFAULTS["betas"])
    if not isinstance(betas, list):
        raise _bad("optimizer.params.betas", betas, "a list of two numbers")
    put("optimizer", "lr", muon_lr)
    put("optimizer", "momentum", number.get("momentum", _MUON_DEFAULTS["momentum"]))
    put(
        "optimizer",
        "betas",
        [_number(f"optimizer.params.betas[{i}]", b) for i, b in enumerate(betas)],
    )
    put("optimizer", "eps", number.get("eps", _MUON_DEFAULTS["eps"]))
    put("optimizer", "weight_decay", number.get("weight_decay", _MUON_DEFAULTS["weight_decay"]))
    settings: dict[str, Any] = {"scale": "spectral"}
    if adam_lr != muon_lr:
        settings["adam_lr"] = adam_lr
    put("optimizer", "muon", settings)
    method = got.get("ns_method", "gram")
    if method not in ("gram", "standard"):
        raise _bad("optimizer.params.ns_method", method, '"gram" or "standard"')
    if method == "gram":
        skip("optimizer.params.ns_method", "the Gram form of the same Newton-Schulz iteration: "
             "shardax runs the standard form, equal up to rounding", False)  # fmt: skip
    skip("optimizer.type=Muon", "which params take Muon: DeepSpeed reads each param's use_muon; "
         "shardax's default takes the 2-D weights but embeddings and the head, and stacked "
         "experts (pass use_muon= to sx.optim.muon to choose otherwise)", False)  # fmt: skip
