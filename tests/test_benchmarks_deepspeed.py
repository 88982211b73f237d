"""The benchmarks' DeepSpeed anchors (``benchmarks/_deepspeed.py``) degrade to
a reason where DeepSpeed is absent (CI), match torch where it is present, and
the collectives benchmark's all-reduce check catches a wrong sum."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
from _dist import run_ranks

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _load(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_cpu_adamw_is_torch_adamw_or_a_reason():
    hp = dict(lr=1e-3, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1)
    start, grad = torch.randn(1000), torch.randn(1000)
    params = [start.clone()]
    step, reason = _load("_deepspeed").cpu_adamw(params, [grad], **hp)
    if not HAS_DEEPSPEED:
        assert step is None and "deepspeed is not installed" in reason
        return
    assert step is not None, reason
    ref = torch.nn.Parameter(start.clone())
    ref.grad = grad.clone()
    opt = torch.optim.AdamW(
        [ref], lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=0.1
    )
    for _ in range(3):
        step()
        opt.step()
    torch.testing.assert_close(params[0], ref.detach())


def test_shm_all_reduce_needs_a_process_group():
    fn, reason = _load("_deepspeed").shm_all_reduce()
    assert fn is None and "no process group" in reason


def _ranks_check_all_reduce() -> tuple[str | None, str, str]:
    import torch.distributed as dist

    collectives = _load("collectives")
    collectives.check_all_reduce(dist.all_reduce, 1000)  # the reference passes
    try:
        collectives.check_all_reduce(lambda t: t, 1000)  # no reduction: caught
        wrong = "not caught"
    except RuntimeError as e:
        wrong = str(e)
    _, reason = _load("_deepspeed").shm_all_reduce()  # pool ranks have no LOCAL_WORLD_SIZE
    return reason, wrong, "ok"


def test_all_reduce_check_and_shm_preconditions_on_two_ranks():
    for reason, wrong, ok in run_ranks(_ranks_check_all_reduce, world_size=2):
        assert ok == "ok"
        assert "disagrees with torch's" in wrong
        assert "needs all 2 ranks on one node" in reason
