"""DeepSpeed's CPU kernels as benchmark anchors, loaded only where importable.

Two loaders, each returning ``(callable, None)`` or ``(None, reason)`` so a
benchmark records a skipped column instead of failing; ``deepspeed`` is
imported only inside them (it is not installed in CI):

- :func:`shm_all_reduce`: DeepSpeed's shared-memory all-reduce, the op its
  CPU accelerator builds from ``ShareMemCommBuilder`` (``deepspeed_shm_comm``:
  ``csrc/cpu/comm/shm.cpp``). DeepSpeed 0.19.8 exposes it as
  ``deepspeed.comm.inference_all_reduce(t)`` once ``deepspeed.comm.init_distributed()``
  has run; with a process group already made, ``init_distributed`` only wraps
  it (``TorchBackend``, no new group), builds the op and calls its
  ``initialize(world_size, rank)``, and ``inference_all_reduce`` then calls
  ``torch.ops.deepspeed.inference_all_reduce_(t)`` (in place, sum). It falls
  back to ``torch.distributed.all_reduce`` *silently* when the op is missing
  or the CPU lacks AVX2, so the callable returned here calls the torch op
  directly, after checking what DeepSpeed would check: a gloo run labelled
  DeepSpeed is worse than a skipped column.
- :func:`cpu_adamw`: one step of ``deepspeed.ops.adam.DeepSpeedCPUAdam``
  (``adamw_mode=True``; its ``cpu_adam`` op, ``CPUAdamBuilder``), the
  optimizer ZeRO-Offload runs on the host.

Both ops are JIT-built by DeepSpeed on first use (g++ and ninja, against the
torch headers; about 70 s for ``cpu_adam`` and 30 s for ``deepspeed_shm_comm``
on the 2-core host) into ``~/.cache/torch_extensions``, then loaded from
there. With DeepSpeed 0.19.8, torch 2.13.0+cpu, g++ and ninja on ``PATH``,
both built with no extra setup (``py-cpuinfo``, which ``cpu_adam`` needs, is
a DeepSpeed dependency); ``DS_ACCELERATOR=cpu`` is set (if unset) before the
import so DeepSpeed does not probe for other accelerators.

What DeepSpeed's shm all-reduce needs, checked here (it hangs or corrupts
memory otherwise, rather than raising):

- every rank on one node, and ``LOCAL_SIZE`` equal to the world size: its
  ``initialize`` creates the shared segments only then (DeepSpeed's own
  launcher exports ``LOCAL_SIZE``; ``shardax launch`` exports
  ``LOCAL_WORLD_SIZE``, which is copied over). Without it the first call
  dereferences null pointers;
- ``MASTER_ADDR``/``MASTER_PORT``: they name the segments
  (``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``,
  66 MiB each); two jobs with the same names would share them;
- every rank's op built before any rank initialises it: ``initialize``
  spins until each peer's segment exists, forever. The loader agrees on
  success over the process group first;
- float32 (or bf16/fp16 with AVX-512BW): for other dtypes the op returns the
  tensor unreduced; and contiguous input (it reduces a contiguous copy and
  drops it otherwise); the callable raises instead. Its byte count is a C
  ``int``, so the callable reduces in pieces of at most 1 GiB.

The op's OpenMP loops resolve to torch's ``libgomp`` (the ``.so`` does not
link its own), so ``torch.set_num_threads`` sets its threads too: the
benchmarks compare it at the same thread count as gloo and shardax.

DeepSpeed never unlinks its segments; the loader unlinks this rank's once
every rank has mapped them (a barrier after ``initialize``), so nothing is
left in ``/dev/shm`` when the job ends.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Sequence
from types import ModuleType

import torch
import torch.distributed as dist

__all__ = ["cpu_adamw", "shm_all_reduce"]

_SHM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PIECE_BYTES = 2**30  # the op counts bytes in a C int


def _import_deepspeed() -> tuple[ModuleType | None, str | None]:
    """``import deepspeed`` on its CPU accelerator, quietly; or the reason it failed."""
    if importlib.util.find_spec("deepspeed") is None:
        return None, "deepspeed is not installed (pip install 'shardax[bench]')"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import logging

        import deepspeed
    except Exception as e:  # a broken install is a reason, not a crash
        return None, f"import deepspeed failed: {type(e).__name__}: {e}"
    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed, None


def _agree(reason: str | None) -> str | None:
    """The first failing rank's reason on every rank (a collective); ``None`` if all succeeded."""
    flags = torch.tensor([0 if reason is None else 1 + dist.get_rank()], dtype=torch.int64)
    gathered = [torch.zeros_like(flags) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flags)
    failed = [int(f) - 1 for f in gathered if int(f)]
    if not failed:
        return None
    return reason or f"failed on rank {min(failed)}"


def _shm_preconditions() -> str | None:
    if not dist.is_available() or not dist.is_initialized():
        return "no process group: call after sx.init() / init_process_group"
    world = dist.get_world_size()
    if world < 2:
        return "one rank: nothing to reduce"
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None or int(local) != world:
        return f"DeepSpeed's shm all-reduce needs all {world} ranks on one node (LOCAL_WORLD_SIZE={local})"
    if os.environ.get("LOCAL_SIZE", str(world)) != str(world):
        return f"LOCAL_SIZE={os.environ['LOCAL_SIZE']} is not the world size {world}"
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return "MASTER_ADDR/MASTER_PORT unset: DeepSpeed names its shm segments after them"
    return None


def _build_shm_op() -> tuple[ModuleType | None, str | None]:
    deepspeed, reason = _import_deepspeed()
    if reason:
        return None, reason
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return (
            None,
            f"DeepSpeed's ShareMemCommBuilder is not available on {get_accelerator().device_name()}",
        )
    try:
        op = builder.load(verbose=False)
    except Exception as e:
        return None, f"building DeepSpeed's {builder.NAME} op failed: {type(e).__name__}: {e}"
    if op.vector_kernel_level() < 1:
        return None, "this CPU has no AVX2: DeepSpeed's shm all-reduce would fall back to gloo"
    return op, None


def shm_all_reduce() -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, str | None]:
    """DeepSpeed's shared-memory all-reduce (sum, in place) over the default group.

    A collective: every rank calls it, after the default process group
    exists (``sx.init()``), and gets the same outcome. It initialises
    ``deepspeed.comm`` on top of that group (no new group, nothing changes
    for other users of it).

    Returns:
        ``(all_reduce, None)``, where ``all_reduce(t)`` sums the contiguous
        float32/bf16/fp16 CPU tensor ``t`` over all ranks in place and
        returns it; or ``(None, reason)``.
    """
    reason = _shm_preconditions()
    if reason:  # the same on every rank, or no group to agree over
        return None, reason
    _, reason = _build_shm_op()
    reason = _agree(reason)  # never initialise while a peer has no op: it would spin forever
    if reason:
        return None, reason
    world, rank = dist.get_world_size(), dist.get_rank()
    os.environ["LOCAL_SIZE"] = str(world)  # what DeepSpeed's launcher exports
    import deepspeed.comm as ds_comm

    try:
        ds_comm.init_distributed(dist_backend=dist.get_backend(), verbose=False)
        cdb = ds_comm.comm.cdb
        if getattr(cdb, "shm_comm_op", None) is None:
            reason = "deepspeed.comm.init_distributed did not load the shm op"
    except Exception as e:
        reason = f"deepspeed.comm.init_distributed failed: {type(e).__name__}: {e}"
    reason = _agree(reason)
    if reason:
        return None, reason
    dist.barrier()  # every rank has mapped every segment: the names can go
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], rank
    )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{name}")
    kernel = torch.ops.deepspeed.inference_all_reduce_

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        if t.dtype not in _SHM_DTYPES or t.device.type != "cpu" or not t.is_contiguous():
            raise TypeError(
                f"DeepSpeed's shm all-reduce takes contiguous {', '.join(map(str, _SHM_DTYPES))} "
                f"CPU tensors, got {t.dtype} on {t.device}, contiguous={t.is_contiguous()}"
            )
        flat = t.view(-1)
        for piece in flat.split(max(1, _PIECE_BYTES // t.element_size())):
            kernel(piece)
        return t

    return all_reduce, None


def cpu_adamw(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    *,
    lr: float,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
) -> tuple[Callable[[], None] | None, str | None]:
    """One ``DeepSpeedCPUAdam(adamw_mode=True)`` step per call, on ``params`` in place.

    Args:
        params: fp32 CPU tensors, updated in place by each step.
        grads: their gradients (same shapes), read by each step.
        lr, b1, b2, eps, weight_decay: as ``torch.optim.AdamW``'s (decoupled
            weight decay, bias correction on).

    Returns:
        ``(step, None)``, ``step()`` doing one AdamW step (its moments live in
        the optimizer, created by the first step); or ``(None, reason)``.
    """
    if len(params) != len(grads):
        raise ValueError(f"{len(params)} params but {len(grads)} grads")
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        if p.dtype != torch.float32 or p.device.type != "cpu" or p.shape != g.shape:
            raise ValueError(
                f"params[{i}]: want fp32 CPU tensors with grads of the same shape, got "
                f"{p.dtype} {tuple(p.shape)} on {p.device}, grad {tuple(g.shape)}"
            )
    _, reason = _import_deepspeed()
    if reason:
        return None, reason
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:
        return None, f"import deepspeed.ops.adam failed: {type(e).__name__}: {e}"
    leaves = [torch.nn.Parameter(p, requires_grad=False) for p in params]  # same storage
    for leaf, g in zip(leaves, grads, strict=True):
        leaf.grad = g
    try:
        opt = DeepSpeedCPUAdam(
            leaves, lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay, adamw_mode=True
        )
    except Exception as e:  # the cpu_adam op did not build or load
        cause = e.__cause__ or e
        return None, f"DeepSpeedCPUAdam failed: {type(cause).__name__}: {cause}"

    def step() -> None:
        opt.step()

    return step, None
