"""What the 1-bit optimizers send on each step, by their schedules (DeepSpeed's
``OnebitAdam`` and ``ZeroOneAdam``, as ``shardax.optim`` implements them): the
communication benchmark (``comm.py``) records it for its timed steps, and its
test checks the traffic log against it, step kind by step kind.

A step sends one of:

- ``"psum"``: every gradient averaged in fp32 (one all-reduce, as ``zero0``);
- ``"onebit"``: one 1-bit average (an all-to-all and an all-gather of packed
  signs and scales), the same bytes whatever is averaged;
- ``"none"``: nothing (0/1 Adam's local steps).

Step ``t`` counts from 1, as ``state.count + 1`` in ``shardax.optim``.
"""

from __future__ import annotations

PSUM, ONEBIT, NONE = "psum", "onebit", "none"


def onebit_adam_sends(n: int, *, freeze_step: int) -> list[str]:
    """What 1-bit Adam sends on steps 1..n: fp32 up to ``freeze_step``, 1 bit after."""
    return [PSUM if t <= freeze_step else ONEBIT for t in range(1, n + 1)]


def zero_one_adam_sends(
    n: int,
    *,
    var_freeze_step: int,
    var_update_scaler: int = 16,
    local_step_scaler: int = 32678,
    local_step_clipper: int = 16,
) -> list[str]:
    """What 0/1 Adam sends on steps 1..n, by DeepSpeed's four counters on its
    own count (``ds = t + 1``: it counts an initializing step first):

    - up to ``var_freeze_step``, fp32 where ``ds % var_interval == 0`` (the
      variance's steps; the interval doubles after ``var_update_scaler`` of
      them), 1 bit elsewhere;
    - after it, a 1-bit sync where ``ds % local_interval == 0``, nothing
      elsewhere; ``local_interval`` doubles every ``local_step_scaler``
      steps, up to ``local_step_clipper``.
    """
    var_interval, var_counter, interval, counter = 1, 0, 1, 0
    out = []
    for t in range(1, n + 1):
        ds = t + 1
        if t <= var_freeze_step:
            if ds % var_interval == 0:
                out.append(PSUM)
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
            else:
                out.append(ONEBIT)
            continue
        out.append(ONEBIT if ds % interval == 0 else NONE)
        counter += 1
        if counter == local_step_scaler:
            counter, interval = 0, min(local_step_clipper, interval * 2)
    return out
