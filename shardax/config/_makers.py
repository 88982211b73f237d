"""What a run config's sections build: the learning-rate schedule and the
optimizer (:meth:`RunConfig.make_schedule`, :meth:`RunConfig.make_optimizer`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ._sections import OptimizerConfig, ScheduleConfig

if TYPE_CHECKING:
    from ._run import RunConfig


def build_schedule(s: ScheduleConfig, peak: float, steps: int) -> Callable[[int], float]:
    """:meth:`RunConfig.make_schedule`: the learning rate at each step of
    the schedule ``s`` peaking at ``peak`` (the optimizer's lr), over
    ``s.total_steps`` or the run's ``steps``."""
    from .. import optim

    total = s.total_steps or steps
    if s.type == "constant":
        return optim.constant_schedule(peak)
    if s.type == "one_cycle":
        return optim.one_cycle_schedule(
            peak, total, pct_start=s.pct_start, div_factor=s.div_factor,
            final_div_factor=s.final_div_factor,
        )  # fmt: skip
    if s.type == "one_cycle_linear":
        from ..optim._schedules import one_cycle_linear_schedule

        return one_cycle_linear_schedule(
            s.init_lr, peak, s.up_steps, s.down_steps, decay_rate=s.decay_rate,
            decay_steps=s.decay_steps, up_stairs=s.up_stairs, down_stairs=s.down_stairs,
        )  # fmt: skip
    if s.warmup == "linear" and s.type == "warmup_cosine" and not s.deepspeed:
        return optim.warmup_cosine_decay_schedule(
            peak, s.warmup_steps, total, init_value=s.init_lr, end_value=s.end_lr
        )
    if s.warmup == "linear" and s.type == "warmup_linear" and not s.deepspeed:
        return optim.warmup_linear_decay_schedule(
            peak, s.warmup_steps, total, init_value=s.init_lr, end_value=s.end_lr
        )
    return _warmup_then(s, peak, total)


def build_optimizer(run: RunConfig, accumulation: int, clip: bool) -> Any:
    """:meth:`RunConfig.make_optimizer`."""
    from .. import optim

    if clip and run.parallel.pp is not None and run.optimizer.clip_global_norm:
        raise ConfigError(
            "optimizer.clip_global_norm under parallel.pp: an optimizer sees one rank's "
            "stages; clip with shardax.pipeline.clip_by_global_norm (the whole model's "
            "norm) and make the optimizer with make_optimizer(clip=False)"
        )

    o = run.optimizer
    if run.unreduced_axes:  # 1-bit: it averages (and clips) the gradients itself
        opt = _onebit(o, run.make_schedule(), run.unreduced_axes, clip)
    else:
        opt = _optimizer(o, run.make_schedule())
    if o.clip_global_norm and not run.unreduced_axes:  # unclipped, its place kept
        clipping = optim.clip_by_global_norm(o.clip_global_norm) if clip else optim.identity()
        opt = optim.chain(clipping, opt)
    if run.precision.params != "fp32" and run.precision.master_weights:
        opt = optim.with_master_weights(opt)
    if accumulation > 1:
        opt = optim.MultiSteps(opt, accumulation)
    return opt


def _optimizer(o: OptimizerConfig, lr: Callable[[int], float]) -> Any:
    """The optimizer ``o`` names, on the schedule ``lr``."""
    from .. import optim

    b1, b2 = o.betas
    adam = {"b1": b1, "b2": b2, "eps": o.eps, "weight_decay": o.weight_decay}
    if not o.bias_correction:  # FusedAdam's bias_correction=False
        adam["bias_correction"] = False
    makers: dict[str, Callable[[], Any]] = {
        "adamw": lambda: optim.adamw(lr, **adam),
        "adam": lambda: optim.adam(lr, **adam),
        "lion": lambda: optim.lion(lr, b1=b1, b2=b2, weight_decay=o.weight_decay),
        "sgd": lambda: optim.sgd(lr, momentum=o.momentum, weight_decay=o.weight_decay),
        "adagrad": lambda: optim.adagrad(lr, eps=o.eps, weight_decay=o.weight_decay),
        "rmsprop": lambda: optim.rmsprop(
            lr, eps=o.eps, weight_decay=o.weight_decay, momentum=o.momentum
        ),
        "lamb": lambda: optim.lamb(lr, b1=b1, b2=b2, eps=o.eps, weight_decay=o.weight_decay),
        "muon": lambda: _muon(o, lr),
    }
    return makers[o.type]()


def _muon(o: OptimizerConfig, lr: Callable[[int], float]) -> Any:
    """Muon with ``o``'s settings: ``lr`` for the matrices; the Adam part's
    ``muon.adam_lr``, where given, as ``lr`` scaled to it."""
    from .. import optim

    b1, b2 = o.betas
    settings = {k: v for k, v in o.muon.items() if k != "adam_lr"}
    adam_lr = o.muon.get("adam_lr")
    scaled = None if adam_lr is None else (lambda step: lr(step) * adam_lr / o.lr)
    return optim.muon(lr, o.momentum, weight_decay=o.weight_decay, adam_b1=b1, adam_b2=b2,
                      adam_eps=o.eps, adam_learning_rate=scaled, **settings)  # fmt: skip


def _onebit(
    o: OptimizerConfig, lr: Callable[[int], float], axes: tuple[str, ...], clip: bool
) -> Any:
    """The 1-bit optimizer ``o`` names, averaging over ``axes``; it clips
    the gradients itself (``clip_global_norm``, as DeepSpeed's
    ``gradient_clipping`` with it)."""
    from .. import optim

    b1, b2 = o.betas
    common = {"b1": b1, "b2": b2, "eps": o.eps, "weight_decay": o.weight_decay, "axis": axes,
              "max_grad_norm": o.clip_global_norm if clip else None}  # fmt: skip
    if o.type == "zero_one_adam":
        return optim.zero_one_adam(lr, var_freeze_step=o.freeze_step, **common, **o.zero_one)
    common["freeze_step"] = o.freeze_step
    if o.type == "onebit_adam":
        return optim.onebit_adam(lr, bias_correction=o.bias_correction, **common)
    return optim.onebit_lamb(lr, **common, **o.lamb)


def _warmup_then(s: ScheduleConfig, peak: float, total: int) -> Callable[[int], float]:
    """Warmup (linear or log) to ``peak``, then constant, cosine or linear
    decay to ``end_lr`` at ``total``; with ``deepspeed``, as DeepSpeed's
    WarmupLR, WarmupDecayLR and WarmupCosineLR step it."""
    if s.deepspeed:
        return _deepspeed_warmup(s, peak, total)
    warm, init, end = s.warmup_steps, s.init_lr, s.end_lr
    if s.type != "warmup_constant" and not total > warm:
        raise ConfigError(f"schedule.total_steps ({total}) must exceed warmup_steps ({warm})")

    def schedule(step: int) -> float:
        if step < warm:
            f = math.log(step + 1) / math.log(warm + 1) if s.warmup == "log" else step / warm
            return init + (peak - init) * f
        if s.type == "warmup_constant":
            return peak
        f = min(1.0, (step - warm) / (total - warm))
        if s.type == "warmup_cosine":
            return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * f))
        return peak + (end - peak) * f

    return schedule


def _deepspeed_warmup(s: ScheduleConfig, peak: float, total: int) -> Callable[[int], float]:
    """``warmup_constant``, ``warmup_linear``, ``warmup_cosine`` as DeepSpeed's
    WarmupLR, WarmupDecayLR, WarmupCosineLR compute them, update by update."""
    from ..optim._schedules import deepspeed_warmup, deepspeed_warmup_cosine

    if s.type == "warmup_cosine":  # DeepSpeed's ratios of the optimizer's lr
        return deepspeed_warmup_cosine(
            peak, s.warmup_steps, total, init_ratio=s.init_lr / peak, end_ratio=s.end_lr / peak,
            warmup=s.warmup,
        )  # fmt: skip
    decay = total if s.type == "warmup_linear" else None
    return deepspeed_warmup(s.init_lr, peak, s.warmup_steps, decay, end_value=s.end_lr,
                            warmup=s.warmup)  # fmt: skip
