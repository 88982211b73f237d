"""Optax-style optimizers over sharded pytrees (to come).

``GradientTransformation(init, update)`` with state as NamedTuples: sgd, adam(w),
lion, lamb, adafactor, muon; ``chain``, ``clip_by_global_norm`` (sharding-aware),
masks, schedules, ``MultiSteps`` accumulation, mixed-precision master weights and
loss scaling, all operating on the local shards of ``Sharded`` leaves.
"""
