"""Optax-style optimizers over sharded pytrees.

An optimizer is a :class:`GradientTransformation` — ``init(params) -> state``
and ``update(grads, state, params) -> (updates, state)``, pure functions with
state as NamedTuples — and :func:`apply_updates` adds the updates to the
params. Optimizers (``sgd``, ``adam``, ``adamw``, ``adagrad``, ``rmsprop``,
``lion``, ``lamb``, ``adafactor``) are ``chain`` s of small transformations;
wrappers mask them, inject hyperparameters, accumulate micro-steps, skip
non-finite steps and keep fp32 master weights; schedules are functions of the
step. On ``Sharded`` leaves everything runs on local shards, with the state
in each param's "opt_state" layout, and global statistics (norms, RMS,
finiteness) reduced over the mesh. A leaf whose gradient is None (a buffer,
a frozen layer: what :func:`shardax.value_and_grad` gives where no gradient
reached) keeps its value and its state everywhere — ``update``,
``apply_updates``, ``step``, ``fused_step``, ``chain``, ``MultiSteps``,
master weights — and Adam's step counts are per leaf, as in ``torch.optim``.

A step is taken one of two ways. :func:`step` is ``update`` then
``apply_updates``: pure, new trees. :func:`fused_step` gives the one
stepper that **donates** — it writes the params and the state in place —
running the optimizer's native kernel in one pass over gradient, state and
parameter where the optimizer names one (``adamw``, ``adam``, ``lion``,
``adagrad``, ``rmsprop``, also under ``chain`` and ``with_master_weights``)
and the kernels cover the call, else ``update`` and
``apply_updates(donate=True)``.

>>> import torch
>>> from shardax import optim
>>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.warmup_cosine(1e-3, 10, 100)))
>>> params = {"w": torch.zeros(3)}
>>> state = opt.init(params)
>>> updates, state = opt.update({"w": torch.ones(3)}, state, params)
>>> params = optim.apply_updates(params, updates)
>>> stepper = optim.fused_step(opt)                  # or, in place and in one pass:
>>> params, state = stepper.step(params, {"w": torch.ones(3)}, state)
"""

from ._accumulate import MultiSteps as MultiSteps
from ._accumulate import MultiStepsState as MultiStepsState
from ._alias import adafactor as adafactor
from ._alias import adagrad as adagrad
from ._alias import adam as adam
from ._alias import adamw as adamw
from ._alias import lamb as lamb
from ._alias import lion as lion
from ._alias import rmsprop as rmsprop
from ._alias import sgd as sgd
from ._base import EmptyState as EmptyState
from ._base import GradientTransformation as GradientTransformation
from ._base import apply_updates as apply_updates
from ._base import chain as chain
from ._factored import FactoredRmsState as FactoredRmsState
from ._factored import scale_by_factored_rms as scale_by_factored_rms
from ._global import clip_by_block_rms as clip_by_block_rms
from ._global import clip_by_global_norm as clip_by_global_norm
from ._global import scale_by_param_block_rms as scale_by_param_block_rms
from ._global import scale_by_trust_ratio as scale_by_trust_ratio
from ._muon import muon as muon
from ._muon import muon_state_bytes as muon_state_bytes
from ._norms import all_finite as all_finite
from ._norms import global_norm as global_norm
from ._onebit import onebit_adam as onebit_adam
from ._onebit_lamb import onebit_lamb as onebit_lamb
from ._precision import DynamicLossScale as DynamicLossScale
from ._precision import MasterWeightsState as MasterWeightsState
from ._precision import with_master_weights as with_master_weights
from ._schedules import constant as constant
from ._schedules import constant_schedule as constant_schedule
from ._schedules import cosine as cosine
from ._schedules import cosine_decay_schedule as cosine_decay_schedule
from ._schedules import linear as linear
from ._schedules import linear_schedule as linear_schedule
from ._schedules import one_cycle as one_cycle
from ._schedules import one_cycle_schedule as one_cycle_schedule
from ._schedules import piecewise as piecewise
from ._schedules import piecewise_constant_schedule as piecewise_constant_schedule
from ._schedules import warmup_cosine as warmup_cosine
from ._schedules import warmup_cosine_decay_schedule as warmup_cosine_decay_schedule
from ._schedules import warmup_linear_decay as warmup_linear_decay
from ._schedules import warmup_linear_decay_schedule as warmup_linear_decay_schedule
from ._stepper import FusedStep as FusedStep
from ._stepper import fused_step as fused_step
from ._stepper import step as step
from ._transforms import ScaleByAdamState as ScaleByAdamState
from ._transforms import ScaleByAmsgradState as ScaleByAmsgradState
from ._transforms import ScaleByLionState as ScaleByLionState
from ._transforms import ScaleByRmsState as ScaleByRmsState
from ._transforms import ScaleByRssState as ScaleByRssState
from ._transforms import ScaleByScheduleState as ScaleByScheduleState
from ._transforms import ScaleByStddevState as ScaleByStddevState
from ._transforms import TraceState as TraceState
from ._transforms import add_decayed_weights as add_decayed_weights
from ._transforms import identity as identity
from ._transforms import scale as scale
from ._transforms import scale_by_adam as scale_by_adam
from ._transforms import scale_by_learning_rate as scale_by_learning_rate
from ._transforms import scale_by_lion as scale_by_lion
from ._transforms import scale_by_rms as scale_by_rms
from ._transforms import scale_by_rss as scale_by_rss
from ._transforms import scale_by_schedule as scale_by_schedule
from ._transforms import trace as trace
from ._wrappers import ApplyIfFiniteState as ApplyIfFiniteState
from ._wrappers import InjectHyperparamsState as InjectHyperparamsState
from ._wrappers import MaskedState as MaskedState
from ._wrappers import apply_if_finite as apply_if_finite
from ._wrappers import inject_hyperparams as inject_hyperparams
from ._wrappers import masked as masked
from ._zero_one import zero_one_adam as zero_one_adam

__all__ = [
    "ApplyIfFiniteState",
    "DynamicLossScale",
    "EmptyState",
    "FactoredRmsState",
    "FusedStep",
    "GradientTransformation",
    "InjectHyperparamsState",
    "MaskedState",
    "MasterWeightsState",
    "MultiSteps",
    "MultiStepsState",
    "ScaleByAdamState",
    "ScaleByAmsgradState",
    "ScaleByLionState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "ScaleByScheduleState",
    "ScaleByStddevState",
    "TraceState",
    "adafactor",
    "adagrad",
    "adam",
    "adamw",
    "add_decayed_weights",
    "all_finite",
    "apply_if_finite",
    "apply_updates",
    "chain",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "constant",
    "constant_schedule",
    "cosine",
    "cosine_decay_schedule",
    "fused_step",
    "global_norm",
    "identity",
    "inject_hyperparams",
    "lamb",
    "linear",
    "linear_schedule",
    "lion",
    "masked",
    "muon",
    "muon_state_bytes",
    "one_cycle",
    "one_cycle_schedule",
    "onebit_adam",
    "onebit_lamb",
    "piecewise",
    "piecewise_constant_schedule",
    "rmsprop",
    "scale",
    "scale_by_adam",
    "scale_by_factored_rms",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_param_block_rms",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_schedule",
    "scale_by_trust_ratio",
    "sgd",
    "step",
    "trace",
    "warmup_cosine",
    "warmup_cosine_decay_schedule",
    "warmup_linear_decay",
    "warmup_linear_decay_schedule",
    "with_master_weights",
    "zero_one_adam",
]
