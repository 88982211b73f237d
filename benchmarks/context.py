"""Context parallelism: shardax's ring attention against torch's ``context_parallel``, on CPU.

One invocation trains the same GPT (``examples/gpt.py``, sized so that
attention dominates: d_model 128, 2 layers, 2 heads of 64, vocabulary 256)
on the same tinyshakespeare bytes, from the same seed, with ``train.py``'s
AdamW, one sequence of ``seq`` tokens per step, for each sequence length of
``--seqs`` and each rank count of ``--cp``:

- ``single``: one process, no context parallelism (``torch.optim.AdamW``):
  the reference for the loss and for the memory one rank should need,
  1/cp of this one's;
- ``torch``: ``torch.distributed.tensor.experimental.context_parallel``
  over a CPU ``DeviceMesh``, the ranks' gradients averaged by
  ``DistributedDataParallel`` over gloo — torchtitan's recipe, with
  torch's defaults (head–tail load balancing, K/V rotated by all-gather) and
  its CPU attention kernel bound into its ring (see below: as shipped it
  cannot run on CPU);
- ``torch-alltoall``: the same with ``set_rotate_method("alltoall")``;
- ``torch-math`` (not run by default): the one way torch's context
  parallelism computes correct attention on CPU *unpatched*, at 2 ranks:
  SDPA's math backend under ``implicit_replication()``, with load
  balancing off — not a ring: DTensor gathers whole K and V and
  materialises ``[T/cp, T]`` scores;
- ``shardax``: ``rules.context_parallel("cp")`` (ring attention,
  ``shardax/shard/_ring.py``) and ``rules.zero(0, "cp")``, the batch split
  head–tail by ``data.shard_batch(..., P(None, zigzag("cp")))``,
  ``value_and_grad``, ``optim.adamw``.

The model's forward takes the positions (``PositionedGPT``): the example
GPT computes ``arange(t)`` of the length it sees, which under torch's
context parallelism is the *local* length — wrong positions at the same
cost. Both sides get the positions as data, split like the tokens (torch:
one more ``context_parallel`` buffer; shardax: one more batch leaf).

What torch 2.13's context parallelism does on CPU (``probe_torch``: one
causal SDPA forward and backward at ``PROBE_SHAPES`` against one process,
and 3 training steps of a tiny positioned GPT against one process's,
for each way of running it; every invocation runs it on each ``--cp`` and
records it under ``torch_cp_on_cpu``; a probe that crashes is tried once
more, its crash kept under ``crashed``: once in CI a rank died of "double
free or corruption (fasttop)", and 25 probes in a row then ran clean):

- **As shipped it cannot run on CPU.** On CPU, ``F.scaled_dot_product_attention``
  dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``. CP
  intercepts SDPA (it monkey-patches ``F.scaled_dot_product_attention`` to
  wrap q, k, v as ``Shard(2)`` DTensors) and handles only the CUDA kernels —
  ``_scaled_dot_product_{flash,efficient,cudnn}_attention`` and their
  backwards — in its DTensor handler table and sharding rules. The CPU op
  has neither, so the first attention raises ``NotImplementedError:
  Operator aten._scaled_dot_product_flash_attention_for_cpu.default does
  not have a sharding strategy registered`` — with either rotate method
  (``_cp_options.rotate_method``: ``ALL_GATHER``, the default, or
  ``ALL_TO_ALL`` through ``set_rotate_method``), which act inside the ring
  and are never reached. ``init_device_mesh("cpu", ...)`` over gloo is
  accepted; ``buffers=`` are split in place on ``buffer_seq_dims`` (with
  ``no_restore_buffers``, not put back), head–tail when the length divides
  by 2·cp.
- **The math backend silently computes something else.** Forcing
  ``sdpa_kernel(SDPBackend.MATH)`` decomposes SDPA into DTensor ops; the
  causal mask it builds (``ones(L, S).tril()``) is a plain tensor, so it
  needs ``implicit_replication()``. Then it runs, and with the default
  head–tail load balancing the replicated mask is cut for each rank's rows
  as if they were contiguous while they are chunks ``i`` and ``2n-1-i``: the
  output and gradients are wrong (max error 1.3 at 2 ranks, 2.0 at 4, on
  unit-variance inputs; the losses off by 1e-3 from the first step), with
  no error or warning.
- **Correct unpatched only at 2 ranks, and not a ring:** the math backend
  under ``implicit_replication()`` with load balancing off
  (``_cp_options.enable_load_balance = False``, private): contiguous
  shards, whole K and V all-gathered, ``[T/cp, T]`` scores, dK and dV
  reduce-scattered (the ``torch-math`` mode; memory quadratic in the
  sequence). At 4 ranks and 4096 tokens DTensor's propagation picks
  another plan (gloo has no all-to-all; torch falls back to all-gather and
  chunk) whose output is ``Partial(sum)``, and CP's output hook calls
  ``to_local()`` on it regardless: each rank gets an unreduced partial
  attention over the whole sequence — ``[1, 2, 4096, 64]`` where its piece
  is ``[1, 2, 1024, 64]`` — and the model fails on the shape.
- **Torch's ring on CPU:** binding the CPU kernel and its backward into CP's
  handler table (``bind_cpu_kernel``, 40 lines: a ``Shard(2)`` sharding
  strategy for each op, and a handler that calls torch's own
  ``_templated_ring_attention`` and ``_templated_ring_attention_backward``
  with them, as torch's ``_sdpa_handler`` does for the CUDA ops) runs torch's
  ring unchanged — its rotater, its head–tail load balancer, its LSE
  merger — and matches one process (output and gradients to 1e-6, the
  losses over training steps to 5e-7) at 2 and 4 ranks with either rotate
  method. Those are the ``torch`` and ``torch-alltoall`` anchors. Torch's
  backward rotates the K/V gradients by all-to-all whatever the method;
  with ``ALL_GATHER`` the forward gathers the whole K and V once per
  attention (``T·d`` per rank, not a ring's ``2·T/cp·d`` in flight).

Every (mode, cp, seq, repeat) runs in fresh rank processes started by
``shardax launch``, in ``train.py``'s environment (``OMP_NUM_THREADS`` =
cores / ranks, at least 1 — 4 ranks on this 2-core host share the cores,
every side alike; glibc's mmap threshold at 4 MiB), cases interleaved across
repeats. This host is shared: each run first waits (up to
``--quiet-wait``, 600 s) until other processes take at most
``--max-others`` (0.15) of the CPU, records the share they took while it
ran (``others_cpu``: ``/proc/stat``'s busy time less this benchmark's own
and its ranks'), and above that share is marked ``busy`` and run again (up
to ``--retries``, 2). The medians count a case's quiet runs (all of them,
flagged ``disturbed``, where none was; ``--summarize FROM.json`` applies
these rules to an earlier run's rows again). A run takes ``--warmup``
untimed steps, then times ``--steps`` steps between barriers (the slowest
rank). **Tokens/s** is the sequence's
tokens over the step time (forward, backward, AdamW). **Memory** is measured
in untimed steps after those (``--memory-steps``), per rank: a step's memory
is its RSS high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``
just before the step) minus the RSS just before it, the C heap's free memory
handed back first (``malloc_trim``: else what the allocator kept from the
last step hides this one's peak). **Activation memory** is a step's memory
at the sequence minus a step's at a short one (``SHORT`` tokens per rank,
the same model): the part that grows with the sequence — what context
parallelism divides — without the part every step needs whatever the
length (gradients, the optimizer's update, communication buffers); the row
reports the largest over the ranks (Linux only; ``null`` elsewhere), each
rank's step and short-step memory, and each rank's peak RSS up to the end of
the timed steps (read before the memory steps reset the high-water mark
``getrusage`` reports too). That is activation memory **as trained**, in
the allocator setting the timed steps ran in (glibc's mmap threshold at 4
MiB: smaller tensors come from the heap, whose holes count). A **live**
pass after the timed runs (``activation_live_mib``; ``LIVE_REPEATS`` runs
per case, interleaved, untimed) measures it again in ranks started with the
threshold at 128 KiB, so that every tensor of that size or more is a
mapping of its own and resident memory follows the tensors alive (lowered
mid-run it would come too late: the heap's free chunks, already there,
would still serve them). The two differ by a rank's heap holes, about 10
MiB on this model whatever the rank count: no split of the sequence divides
them, so "≈ 1/cp" is judged on the live measure and "≤ torch's" on both.
``--live-from FROM.json`` runs the live pass for an earlier run. Every side
builds its model on CPU from the same seed (``setup``).

The summary holds, per (cp, seq), each mode's medians over repeats; shardax
over each torch mode (tokens/s: above 1 is faster; activation: below 1 is
less) and over the better of torch's two rotate methods (``_vs_torch_best``:
the faster, the smaller); each side's activation over ``single``'s (the
ideal is 1/cp). ``criteria`` judges the goals over every (cp, seq): tokens/s
≥ the best torch's, activation ≤ the best torch's (both measures) and ≤
1.25/cp of one process's (live; the as-trained verdict beside it). Every mode of a sequence length starts from the same weights and
batch, so their first losses must agree to 1e-4 (``first_loss_spread``; a
warning otherwise).

**The longest sequence in a fixed memory** (``memory_search``): each rank
runs in a memory cgroup of its own capped at ``--memory-limit-mib`` (cgroup
v1 or v2, created under this process's own; the per-rank limit mirrors a
GPU's fixed memory), and for ``single`` and ``shardax`` at each cp the
search doubles the sequence from ``--search-start`` until a run of two
training steps fails, then bisects over multiples of ``--search-step``. A failure must
be the kernel's OOM kill (the cgroup's ``oom_kill`` count) or a run past
``--search-timeout``; any other error stops that search. After each try
every process left in the cgroups is killed, the cgroups removed, and any
new ``/dev/shm/shardax-*`` file removed and counted. ``longest_vs_single``
is the goal's ratio (≥ cp). Skipped, with the reason, where no writable
memory cgroup exists (not root, no memory controller).

    python benchmarks/context.py                 # the full run: cp 2,4, seqs 4096,8192,16384
    python benchmarks/context.py --cp 2 --seqs 8192 --repeats 2 --no-memory-search
    python benchmarks/context.py --smoke         # tiny model, 2 ranks, seconds; no search
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import re
import resource
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from _data import (
    launch_run,
    load_tokens,
    model_facts,
    peak_rss_mib,
    threads_per_rank,
    timed_steps,
)
from gpt import GPT, GPTConfig, param_count
from train import BETAS, DATA, EPS, LR, TIMEOUT_S, WEIGHT_DECAY, _loss, _torch_adamw

import shardax as sx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "context.json"
ALL_MODES = ["single", "torch", "torch-alltoall", "torch-math", "shardax"]
DEFAULT_MODES = ["single", "torch", "torch-alltoall", "shardax"]
LOSS_TOLERANCE = 1e-4
SHORT = 32
"""Tokens per rank of the short sequence whose step memory is the part that
does not grow with the sequence (32: a multiple of 2 for the head–tail split)."""
ACTIVATION_SLACK = 1.25
"""The ≈ in "activation ≈ 1/cp of one process's": at most 1.25/cp."""
LIVE_THRESHOLD = 128 * 2**10
"""glibc's mmap threshold for the *live* memory steps: every tensor of 128
KiB or more in a mapping of its own, returned to the OS when freed, so that
resident memory follows the tensors alive (not the holes of a heap)."""
MEASURES = {"activation_mib": "as trained", "activation_live_mib": "live"}
"""The two activation measures: in the allocator setting the timed steps ran
in, and with every tensor mapped on its own (``LIVE_THRESHOLD``)."""
LIVE_REPEATS = 3
"""Runs per case of the live memory pass (at most ``--repeats``)."""
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class TorchCP(NamedTuple):
    """How torch's ``context_parallel`` runs: its attention ``kernel`` —
    ``"as-shipped"`` (whatever SDPA dispatches to), ``"bound"`` (the CPU
    flash kernel bound into CP's ring by :func:`bind_cpu_kernel`), ``"math"``
    (SDPA's math backend under ``implicit_replication``) — its K/V
    ``rotate`` method, and head–tail ``load_balance``."""

    kernel: str
    rotate: str = "allgather"
    load_balance: bool = True


TORCH_MODES = {
    "torch": TorchCP("bound"),
    "torch-alltoall": TorchCP("bound", rotate="alltoall"),
    "torch-math": TorchCP("math", load_balance=False),
}
RING_MODES = ("torch", "torch-alltoall")
"""torch's ring, by its two rotate methods: the anchors the goals are judged against."""
PROBES = {  # in this order: binding the kernel is for good
    "as-shipped": TorchCP("as-shipped"),
    "as-shipped-alltoall": TorchCP("as-shipped", rotate="alltoall"),
    "math-backend": TorchCP("math"),
    "math-backend-no-load-balance": TorchCP("math", load_balance=False),
    "cpu-kernel-bound": TorchCP("bound"),
    "cpu-kernel-bound-alltoall": TorchCP("bound", rotate="alltoall"),
}


# ---------------------------------------------------------------- the model


class PositionedGPT(GPT):
    """The example GPT with the positions as an input: ``forward(idx, pos)``
    embeds ``pos`` (``[B, T]``, global positions) instead of ``arange(T)``,
    so a rank holding a piece of the sequence embeds its tokens' own positions."""

    def forward(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if self.cfg.tie_embeddings:
            x = x * self.cfg.d_model**-0.5
        return self.lm_head(x)


def model_config(args: argparse.Namespace, seq: int) -> GPTConfig:
    """The benchmark's GPT with ``seq`` learned positions."""
    return GPTConfig(
        vocab_size=256, seq_len=seq, d_model=args.d_model, n_layers=args.n_layers,
        n_heads=args.n_heads,
    )  # fmt: skip


def positions(x: torch.Tensor) -> torch.Tensor:
    """The global positions of a batch of whole sequences, shaped like it."""
    return torch.arange(x.shape[1]).expand_as(x).contiguous()


def window_batch(tokens: torch.Tensor, step: int, seed: int, seq: int, size: int) -> tuple:
    """Step ``step``'s global batch — ``size`` random windows of ``seq + 1``
    tokens, the same on every rank and for every rank count — as ``(x, y)``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(tokens) - seq - 1, (size,), generator=g)
    windows = tokens[starts[:, None] + torch.arange(seq + 1)]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


# ---------------------------------------------------------------- torch's context parallelism


def bind_cpu_kernel() -> None:
    """Bind SDPA's CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``
    and its backward) into torch's context parallelism as its own
    ``_sdpa_handler`` binds the CUDA kernels: a sharding strategy per op
    (replicated, or everything ``Shard(2)``: the sequence), and a DTensor
    handler that runs torch's ``_templated_ring_attention`` (backward:
    ``_templated_ring_attention_backward``) with the CPU op. Idempotent."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import (
        expand_to_full_mesh_op_strategy,
        register_op_strategy,
    )
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    if fwd in cp.custom_ops:
        return

    def strategy(outputs: int, tensors: int) -> Callable:
        def rule(op_schema: Any) -> Any:
            mesh = op_schema.get_mesh_from_args()
            options = [[Replicate()] * tensors, [Shard(2)] * tensors]
            return expand_to_full_mesh_op_strategy(mesh, op_schema, options, input_index=outputs)

        return rule

    register_op_strategy(fwd, schema_info=RuntimeSchemaInfo(3))(strategy(2, 5))  # out, lse; q k v
    register_op_strategy(bwd)(strategy(3, 9))  # dq dk dv; dout q k v out lse

    def handler(op_call: Any, args: tuple, kwargs: dict) -> object:
        dispatcher = DTensor._op_dispatcher
        info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        dispatcher.sharding_propagator.propagate(info)
        group = info.compute_mesh.get_group()
        local, options = info.local_args, dict(info.local_kwargs)
        if options.get("attn_mask") is not None:
            raise NotImplementedError("attn_mask is not supported")
        scale = options.get("scale")
        if op_call is fwd:
            q, k, v, dropout_p, is_causal = (*local, 0.0, False)[:5]
            out = cp._templated_ring_attention(
                group, 2, fwd, q, k, v, is_causal=is_causal, dropout_p=dropout_p, scale=scale
            )
        else:
            dout, q, k, v, o, lse, dropout_p, is_causal = local[:8]
            out = cp._templated_ring_attention_backward(
                group, 2, bwd, dout, "grad_out", q, k, v, o, lse, is_causal,
                dropout_p=dropout_p, scale=scale,
            )  # fmt: skip
        return dispatcher.wrap(tuple(out), info.output_sharding.output_spec)

    cp.custom_ops[fwd] = handler  # context_parallel installs custom_ops on entry
    cp.custom_ops[bwd] = handler


def set_torch_cp_options(how: TorchCP) -> tuple[bool, Any]:
    """Set torch's CP options as ``how`` says (its CPU kernel bound for
    ``"bound"``); the load-balancing flag and rotate method they replace."""
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    if how.kernel == "bound":
        bind_cpu_kernel()
    before = _cp_options.enable_load_balance, _cp_options.rotate_method
    set_rotate_method(how.rotate)
    _cp_options.enable_load_balance = how.load_balance
    return before


@contextlib.contextmanager
def torch_cp_options(how: TorchCP):
    """torch's CP options set as ``how`` says, restored on exit."""
    from torch.distributed.tensor.experimental._attention import _cp_options

    before = set_torch_cp_options(how)
    try:
        yield
    finally:
        _cp_options.enable_load_balance, _cp_options.rotate_method = before


def torch_cp_region(mesh: Any, how: TorchCP, buffers: list[torch.Tensor], dim: int = 1):
    """torch's ``context_parallel`` over ``buffers`` (split on ``dim``, in
    place, not restored), with the math backend for ``"math"``."""
    from torch.distributed.tensor.experimental import context_parallel, implicit_replication
    from torch.nn.attention import SDPBackend, sdpa_kernel

    stack = contextlib.ExitStack()
    stack.enter_context(
        context_parallel(
            mesh, buffers=buffers, buffer_seq_dims=[dim] * len(buffers),
            no_restore_buffers=set(buffers),
        )
    )  # fmt: skip
    if how.kernel == "math":
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        stack.enter_context(implicit_replication())
    return stack


def setup_torch(cfg: GPTConfig, seed: int, how: TorchCP) -> Step:
    """torch's ``context_parallel`` around each forward and backward, DDP
    averaging the gradients over the ranks, ``torch.optim.AdamW``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(seed)
    model = DistributedDataParallel(PositionedGPT(cfg))
    opt = _torch_adamw(model.parameters())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    set_torch_cp_options(how)  # for the process's life

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y, pos = x.clone(), y.clone(), positions(x)  # context_parallel splits them in place
        with torch_cp_region(mesh, how, [x, y, pos]), torch.enable_grad():
            loss = _loss(model(x, pos), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def setup_single(cfg: GPTConfig, seed: int) -> Step:
    """One process, the whole sequence, ``torch.optim.AdamW``."""
    torch.manual_seed(seed)
    model = PositionedGPT(cfg)
    opt = _torch_adamw(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = _loss(model(x, positions(x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def setup_shardax(cfg: GPTConfig, seed: int, zero: int = 0) -> Step:
    """``rules.context_parallel("cp")`` and ZeRO ``zero`` over the same
    ranks, the batch split head–tail, ``value_and_grad``, ``optim.adamw``."""
    mesh = sx.Mesh({"cp": -1})
    rules = sx.rules.context_parallel("cp") + sx.rules.zero(zero, axis="cp")
    model = PositionedGPT(cfg)  # on CPU, as the other sides' (see setup)
    torch.manual_seed(seed)
    params = sx.init_params(model, mesh, rules)  # its initialisation replayed, seeded
    _to_meta(model)  # the template sx.apply runs; its dense weights go
    opt = sx.optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
    opt_state = opt.init(params)
    spec = sx.P(None, sx.zigzag("cp"))

    def loss_fn(params: Any, batch: dict) -> torch.Tensor:
        return _loss(sx.apply(model, params, batch["x"], batch["pos"], rules=rules), batch["y"])

    grad_fn = sx.value_and_grad(loss_fn)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nonlocal params, opt_state
        batch = sx.data.shard_batch({"x": x, "y": y, "pos": positions(x)}, mesh, spec)
        value, grads = grad_fn(params, batch)
        params, opt_state = sx.optim.fused_step(opt).step(params, grads, opt_state)
        del grads
        return value.detach()

    return step


def _to_meta(model: torch.nn.Module) -> None:
    """Move ``model`` to ``meta`` in place, its tied weights still tied (each
    parameter object kept, its tensor swapped: ``.to`` would make new ones)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to("meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def setup(mode: str, cfg: GPTConfig, seed: int, zero: int = 0) -> Step:
    """Build ``mode``'s model and optimizer on this rank; return its step.
    Every side builds the model on CPU from the same seed: built under
    ``torch.device("meta")``, its random fills would run torch's meta
    kernels, which import ``torch._dynamo`` — some 75 MiB more of every
    process's resident memory, a part of the fixed cost the memory search
    measures."""
    if mode == "single":
        return setup_single(cfg, seed)
    if mode == "shardax":
        return setup_shardax(cfg, seed, zero)
    return setup_torch(cfg, seed, TORCH_MODES[mode])


def shardax_missing() -> str | None:
    """Why this shardax cannot run the ``shardax`` mode yet, or None."""
    missing = [
        name
        for owner, name in [(sx.rules, "context_parallel"), (sx, "zigzag"), (sx, "data")]
        if not hasattr(owner, name)
    ]
    return f"this shardax has no {', '.join(missing)} yet" if missing else None


# ---------------------------------------------------------------- memory of a step


def _status_mib(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+)", text, re.M).group(1)) / 1024


def _trim() -> None:
    """Hand the C heap's free memory back to the OS (glibc's
    ``malloc_trim``; elsewhere nothing), so that RSS is what is live."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def step_memory(step: Step, x: torch.Tensor, y: torch.Tensor) -> float | None:
    """What one call of ``step`` adds to this process's resident memory at
    its peak (MiB): the RSS high-water mark during the call (reset through
    ``/proc/self/clear_refs`` just before) minus the RSS then, with the
    heap's free memory handed back first — else memory the allocator kept
    from the last step would count as the model's and hide this one's
    peak. None where the high-water mark cannot be reset (not Linux)."""
    _trim()
    try:
        before = _status_mib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
    except (OSError, AttributeError):
        return None
    step(x, y)
    return _status_mib("VmHWM") - before


def step_memories(
    step: Step, batch_at: Callable, short: Callable, first: int, count: int
) -> tuple[float, float] | None:
    """This rank's largest step memory over ``count`` steps at the run's
    length, and its step memory at the short one (the last of ``count``);
    None where step memory cannot be measured."""
    memory = [step_memory(step, *batch_at(first + i)) for i in range(count)]
    fixed = [step_memory(step, *short(first + i)) for i in range(count)]
    return None if None in memory + fixed else (max(memory), fixed[-1])


def activation_fields(measured: list[tuple[float, float] | None], suffix: str) -> dict:
    """The row's fields of one measure (``suffix`` "" as trained, "_live"):
    the largest activation over the ranks, and each rank's activation, step
    memory and short-step memory."""
    if None in measured:
        return {f"activation{suffix}_mib": None}
    activation = [m - f for m, f in measured]  # type: ignore[misc]
    return {
        f"activation{suffix}_mib": max(activation),
        f"activation{suffix}_mib_per_rank": activation,
        f"step_memory{suffix}_mib_per_rank": [m for m, _ in measured],  # type: ignore[misc]
        f"fixed_memory{suffix}_mib_per_rank": [f for _, f in measured],  # type: ignore[misc]
    }


# ---------------------------------------------------------------- one run, on every rank


def worker(args: argparse.Namespace) -> int:
    """One rank of one run: build, warm up, time (not in the live pass),
    measure memory; rank 0 writes the result."""
    torch.set_num_threads(args.threads)
    if args.worker == "probe":
        return probe_torch(args)
    if args.worker == "shardax":
        sx.init(timeout=TIMEOUT_S)
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    rss_start = peak_rss_mib()
    cfg = model_config(args, args.seq)
    tokens = load_tokens(Path(args.data), cfg.vocab_size)
    started = time.perf_counter()
    step = setup(args.worker, cfg, args.seed, args.zero)
    build_s = time.perf_counter() - started
    batch_at = partial(window_batch, tokens, seed=args.seed, seq=args.seq, size=args.batch)
    timed = 0 if args.live else args.steps
    if args.live:
        losses, seconds = [step(*batch_at(i)) for i in range(args.warmup)], None
    else:
        losses, seconds = timed_steps(step, batch_at, args.warmup, timed)
    loss = torch.stack(losses).double()
    dist.all_reduce(loss)  # the global loss: the mean of the ranks' (shardax's is already global)
    loss /= world
    peak = peak_rss_mib()  # before the memory steps reset the high-water mark it is read from
    # the memory, in steps of their own (the timed ones run as training does): a
    # step's at this length, and at a short one — what a step needs whatever the
    # length (gradients, the optimizer's update, buffers) — the difference the activations'
    short = partial(window_batch, tokens, seed=args.seed, seq=SHORT * world, size=args.batch)
    mine = step_memories(step, batch_at, short, args.warmup + timed, args.memory_steps)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (rss_start, peak, mine))
    if rank == 0:
        result = {"build_s": build_s, "losses": loss.tolist()}
        if args.live:
            result["mmap_threshold"] = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        else:
            assert seconds is not None
            result["tokens_per_s"] = args.batch * args.seq * args.steps / float(seconds.sum())
            result["step_s"] = statistics.median(seconds.tolist())
            result["step_s_all"] = seconds.tolist()
        result.update(activation_fields([m for _, _, m in everyone], "_live" if args.live else ""))
        result["peak_rss_mib"] = max(peak for _, peak, _ in everyone)
        result["peak_rss_mib_per_rank"] = [peak for _, peak, _ in everyone]
        result["start_rss_mib_per_rank"] = [start for start, _, _ in everyone]
        Path(args.result).write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- the probe of torch's CP


PROBE_SHAPES = [(2, 2, 32, 8), (1, 2, 4096, 64)]
"""The probe's q, k, v shapes (B, H, T, D): tiny, and the benchmark's heads at 4096 tokens."""


@contextlib.contextmanager
def _output_placements(seen: list[str]):
    """Record the placements of the DTensors CP's SDPA wrapper hands back
    (it calls ``to_local()`` on them, whatever they are)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    original = cp._ContextParallel.sdpa_output_fn

    def spy(self: Any, module: Any, inputs: Any, outputs: Any, mesh: Any) -> Any:
        if isinstance(outputs, DTensor):
            seen.append(str(outputs.placements[0]))
        return original(self, module, inputs, outputs, mesh)

    cp._ContextParallel.sdpa_output_fn = spy
    try:
        yield
    finally:
        cp._ContextParallel.sdpa_output_fn = original


def _probe_attention(mesh: Any, how: TorchCP, shape: tuple[int, ...]) -> dict:
    """One causal SDPA forward and backward of q, k, v of ``shape`` under
    torch's CP as ``how`` says, against one process: the largest errors of
    the output and the gradients, the collectives DTensor issued, the
    placement of the output CP unwrapped; or the error raised, or the
    output's wrong local shape."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    torch.manual_seed(0)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))  # B H T D
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    mine = [t.detach().clone() for t in (q, k, v, grad)]
    placements: list[str] = []
    try:
        with (
            torch_cp_options(how),
            CommDebugMode() as comm,
            _output_placements(placements),
            torch_cp_region(mesh, how, mine, dim=2),
            torch.enable_grad(),
        ):
            local = [t.requires_grad_() for t in mine[:3]]
            out = F.scaled_dot_product_attention(*local, is_causal=True)
            found = {"runs": True, "output_placement": placements[0] if placements else None}
            if out.shape != mine[0].shape:  # not this rank's piece
                local_shape = list(mine[0].shape)
                return {**found, "output_local_shape": list(out.shape), "expected": local_shape}
            out.backward(mine[3])
        with torch_cp_options(how):  # the same head-tail order back
            whole = context_parallel_unshard(
                mesh, [out.detach(), *(t.grad for t in local)], [2, 2, 2, 2]
            )
    except Exception as err:  # the finding is the error
        return {"runs": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    errors = [
        float((a - b).abs().max().detach())
        for a, b in zip(whole, [ref, q.grad, k.grad, v.grad], strict=True)
    ]
    return {
        **found,
        "max_error": dict(zip(["out", "dq", "dk", "dv"], errors, strict=True)),
        "collectives": {str(op): n for op, n in comm.get_comm_counts().items() if n},
    }


def _probe_training(cfg: GPTConfig, how: TorchCP, steps: int) -> dict:
    """``steps`` training steps of the tiny positioned GPT under torch's CP
    as ``how`` says, against the same steps in this process alone."""
    tokens = load_tokens(DATA, cfg.vocab_size)
    batches = [window_batch(tokens, i, seed=0, seq=cfg.seq_len, size=2) for i in range(steps)]
    single = setup_single(cfg, seed=0)
    expected = [float(single(x, y)) for x, y in batches]
    try:
        with torch_cp_options(how):
            step = setup_torch(cfg, 0, how)
            losses = []
            for x, y in batches:
                loss = step(x, y).double()
                dist.all_reduce(loss)
                losses.append(float(loss) / dist.get_world_size())
    except Exception as err:
        return {"trains": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    return {
        "trains": True,
        "losses": losses,
        "single_losses": expected,
        "max_loss_error": max(abs(a - b) for a, b in zip(losses, expected, strict=True)),
    }


def probe_torch(args: argparse.Namespace) -> int:
    """Each way of running torch's context parallelism on CPU (``PROBES``):
    does it run, and does it compute what one process does?"""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=32, n_layers=2, n_heads=2)
    found = {}
    for name, how in PROBES.items():
        attention = {"x".join(map(str, shape)): _probe_attention(mesh, how, shape)
                     for shape in PROBE_SHAPES}  # fmt: skip
        found[name] = {**how._asdict(), "attention": attention}
        found[name].update(_probe_training(cfg, how, steps=3))
    if dist.get_rank() == 0:
        report = {
            "torch": torch.__version__,
            "ranks": dist.get_world_size(),
            "cpu_attention_op": "aten._scaled_dot_product_flash_attention_for_cpu",
            "cases": found,
        }
        Path(args.result).write_text(json.dumps(report))
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- the driver


def source_digest() -> str:
    """A SHA-256 of the imported shardax package's Python source: which code was measured."""
    root = Path(sx.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def worker_argv(mode: str, nproc: int, seq: int, args: argparse.Namespace, result: Path) -> list:
    """The command every rank of one run executes."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", mode]
    argv += ["--threads", str(threads_per_rank(nproc)), "--result", str(result)]
    argv += ["--data", args.data, "--seed", str(args.seed), "--seq", str(seq)]
    argv += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
    argv += ["--memory-steps", str(args.memory_steps), "--zero", str(args.zero)]
    return [*argv, "--d-model", str(args.d_model), "--n-layers", str(args.n_layers),
            "--n-heads", str(args.n_heads)]  # fmt: skip


def rank_env(nproc: int) -> dict[str, str]:
    """``train.py``'s environment for ranks of ``nproc``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank(nproc))}
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(4 * 2**20))  # sx.init()'s setting, for all
    return env


class Case(NamedTuple):
    """One measured configuration: a mode, its rank count, a sequence length."""

    mode: str
    cp: int
    seq: int

    @property
    def name(self) -> str:
        return f"{self.mode}-s{self.seq}" if self.mode == "single" else (
            f"{self.mode}-cp{self.cp}-s{self.seq}"
        )  # fmt: skip


def cases_of(modes: Sequence[str], cps: Sequence[int], seqs: Sequence[int]) -> list[Case]:
    """Every case, in the order a repeat runs them: by sequence, ``single``
    once, then each cp's modes."""
    out = []
    for seq in seqs:
        out += [Case("single", 1, seq)] if "single" in modes else []
        out += [Case(m, cp, seq) for cp in cps for m in modes if m != "single"]
    return out


def busy_cpu_s() -> float | None:
    """Seconds the machine's CPUs have been busy, all of them together
    (``/proc/stat``: user, nice, system, irq, softirq and steal — time a
    hypervisor gave to others); None without it."""
    try:
        ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


def own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have exited (the ranks)."""
    mine = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return sum(r.ru_utime + r.ru_stime for r in mine)


def run_once(
    case_name: str,
    repeat: int,
    cases: dict[str, Case],
    args: argparse.Namespace,
    live: bool = False,
) -> dict:
    """Launch one run of a case on fresh ranks; its JSON row, with the share
    of the machine's CPU time that other processes took meanwhile
    (``others_cpu``: near 0 when this benchmark had the cores to itself).
    ``live``: the live memory pass's run (untimed; every tensor of
    ``LIVE_THRESHOLD`` or more mapped on its own from the start)."""
    case = cases[case_name]
    row: dict = {"mode": case.name, "side": case.mode, "cp": case.cp, "seq": case.seq}
    row["repeat"] = repeat
    env = rank_env(case.cp)
    if live:
        row["pass"] = "live"
        env["MALLOC_MMAP_THRESHOLD_"] = str(LIVE_THRESHOLD)
    busy, own = busy_cpu_s(), own_cpu_s()
    with tempfile.TemporaryDirectory(prefix="shardax-context-bench-") as tmp:
        result = Path(tmp) / "result.json"
        argv = worker_argv(case.mode, case.cp, case.seq, args, result) + (
            ["--live"] if live else []
        )
        launch_args = argparse.Namespace(nproc=case.cp, verbose=args.verbose)
        launch_run(argv, env, launch_args, result, row)
    _stop_if_stopped(row.get("error", ""))
    if busy is not None:
        others = (busy_cpu_s() - busy) - (own_cpu_s() - own)
        row["others_cpu"] = max(0.0, others) / (row["wall_s"] * (os.cpu_count() or 1))
    return row


def others_share(seconds: float = 2.0) -> float | None:
    """The share of the machine's CPU time other processes take now, over
    ``seconds`` while this benchmark waits; None without ``/proc/stat``."""
    busy, own = busy_cpu_s(), own_cpu_s()
    if busy is None:
        return None
    time.sleep(seconds)
    others = (busy_cpu_s() - busy) - (own_cpu_s() - own)
    return max(0.0, others) / (seconds * (os.cpu_count() or 1))


def wait_for_quiet(args: argparse.Namespace) -> float:
    """Wait, up to ``--quiet-wait`` seconds, until other processes take no
    more than ``--max-others`` of the CPU; the seconds waited."""
    started = time.perf_counter()
    while time.perf_counter() - started < args.quiet_wait:
        share = others_share()
        if share is None or share <= args.max_others:
            break
        time.sleep(10.0)
    return time.perf_counter() - started


def interleaved_runs(cases: dict[str, Case], args: argparse.Namespace) -> list[dict]:
    """Every case once per repeat, in order (A B C, A B C, …), each row
    printed as a JSON line as it comes. Each run waits for the machine to
    be quiet first (``wait_for_quiet``); one during which other processes
    still took more than ``--max-others`` of the CPU time is marked
    ``busy`` and run again, up to ``--retries`` times."""
    rows: list[dict] = []
    for repeat in range(args.repeats):
        for name in cases:
            for _ in range(args.retries + 1):
                waited = wait_for_quiet(args)
                rows.append({**run_once(name, repeat, cases, args), "waited_s": waited})
                others = rows[-1].get("others_cpu")
                rows[-1]["busy"] = others is not None and others > args.max_others
                print(json.dumps(rows[-1]), flush=True)
                if not rows[-1]["busy"]:
                    break
    return rows


def live_pass(cases: dict[str, Case], args: argparse.Namespace) -> list[dict]:
    """The live memory pass: every case ``LIVE_REPEATS`` more times (at most
    ``--repeats``), interleaved, untimed, each rank's allocator mapping
    every tensor of ``LIVE_THRESHOLD`` or more on its own from the start."""
    rows: list[dict] = []
    for repeat in range(min(args.repeats, LIVE_REPEATS)):
        for name in cases:
            rows.append(run_once(name, repeat, cases, args, live=True))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _stop_if_stopped(error: str) -> None:
    """Stop the whole benchmark when the launcher was stopped by a signal
    (it returns 128 + SIGINT, SIGTERM or SIGHUP instead of raising)."""
    if error.endswith(("code 130", "code 143", "code 129")):
        raise KeyboardInterrupt(error)


PROBE_TRIES = 2
"""torch's context parallelism on CPU sometimes corrupts its heap ("double
free or corruption", a rank killed by SIGABRT, a few probes in a hundred):
a crashed probe is tried again, and the crash kept in its row."""


def run_probe(args: argparse.Namespace, nproc: int) -> dict:
    """``probe_torch`` on ``nproc`` fresh ranks: the findings, or the error
    — with ``crashed``, the errors of the tries before (``PROBE_TRIES``)."""
    crashed = []
    for _ in range(PROBE_TRIES):
        with tempfile.TemporaryDirectory(prefix="shardax-context-probe-") as tmp:
            result = Path(tmp) / "probe.json"
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "probe"]
            argv += ["--threads", "1", "--result", str(result), "--data", args.data]
            row: dict = {}
            launch_run(argv, rank_env(nproc), argparse.Namespace(nproc=nproc, verbose=args.verbose),
                       result, row)  # fmt: skip
        if "error" not in row:
            break
        crashed.append(row["error"])
    if crashed and "error" not in row:
        row["crashed"] = crashed
    return row


def medians(ok: list[dict]) -> dict:
    """One case's counted runs: medians of tokens/s, step time, activation
    and peak RSS, the first run's first loss, the last loss, the count, the
    largest share of the CPU other processes took."""
    activations = {key: [r[key] for r in ok if r.get(key) is not None] for key in MEASURES}
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
        "step_s": statistics.median(r["step_s"] for r in ok),
        **{key: statistics.median(a) if a else None for key, a in activations.items()},
        "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in ok),
        "first_loss": ok[0]["losses"][0],
        "last_loss": statistics.median(r["losses"][-1] for r in ok),
        "repeats": len(ok),
        "others_cpu": max((r["others_cpu"] for r in ok if "others_cpu" in r), default=None),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def summarize(rows: list[dict], cases: Sequence[Case], max_others: float = 0.15) -> dict:
    """Per case, medians over its counted runs — those during which other
    processes took at most ``max_others`` of the CPU time, or all of them
    (``disturbed``) where none was; per (cp, seq), shardax against torch
    and each side's activation against one process's; the criteria."""
    stats: dict[str, dict] = {}
    for case in cases:
        ok = [r for r in rows if r["mode"] == case.name and "error" not in r]
        live = [r for r in ok if r.get("pass") == "live"]
        ok = [r for r in ok if r.get("pass") != "live"]
        quiet = [r for r in ok if r.get("others_cpu") is None or r["others_cpu"] <= max_others]
        if ok:
            stats[case.name] = {"side": case.mode, "cp": case.cp, "seq": case.seq}
            stats[case.name].update(medians(quiet or ok), disturbed=not quiet)
            found = [r["activation_live_mib"] for r in live if r.get("activation_live_mib")]
            stats[case.name]["activation_live_mib"] = statistics.median(found) if found else None
            stats[case.name]["live_repeats"] = len(found)
    comparisons = []
    for cp, seq in sorted({(c.cp, c.seq) for c in cases if c.mode != "single"}):
        get = {c.mode: stats.get(c.name) for c in cases if (c.cp, c.seq) == (cp, seq)}
        single = stats.get(Case("single", 1, seq).name)
        item: dict = {"cp": cp, "seq": seq, "ideal_activation_vs_single": 1 / cp}
        for side, s in get.items():
            if s is not None and single is not None:
                for key in MEASURES:
                    item[f"{side}_{key[:-4]}_vs_single"] = _ratio(s[key], single[key])
        ours = get.get("shardax")
        rings = [get[m] for m in RING_MODES if get.get(m)]
        for mode in TORCH_MODES:
            if ours and get.get(mode):
                item[f"tokens_per_s_vs_{mode}"] = ours["tokens_per_s"] / get[mode]["tokens_per_s"]
                item[f"activation_vs_{mode}"] = _ratio(
                    ours["activation_mib"], get[mode]["activation_mib"]
                )
                item[f"peak_rss_vs_{mode}"] = ours["peak_rss_mib"] / get[mode]["peak_rss_mib"]
        if ours and rings:  # against torch's better rotate method
            item["tokens_per_s_vs_torch_best"] = ours["tokens_per_s"] / max(
                r["tokens_per_s"] for r in rings
            )
            for key in MEASURES:
                theirs = [r[key] for r in rings if r.get(key) is not None]
                item[f"{key[:-4]}_vs_torch_best"] = _ratio(
                    ours[key], min(theirs) if theirs else None
                )
        comparisons.append(item)
    summary: dict = {
        "summary": stats,
        "comparisons": comparisons,
        "criteria": criteria(comparisons),
    }
    firsts: dict[int, dict[str, float]] = {}
    for name, s in stats.items():
        firsts.setdefault(s["seq"], {})[name] = s["first_loss"]
    spreads = {seq: max(f.values()) - min(f.values()) for seq, f in firsts.items()}
    summary["first_loss_spread"] = max(spreads.values()) if spreads else None
    bad = {seq: firsts[seq] for seq, spread in spreads.items() if spread > LOSS_TOLERANCE}
    if bad:
        summary["warning"] = (
            f"first-step losses disagree by more than {LOSS_TOLERANCE:g} although every mode "
            f"of a sequence length starts from the same weights and batch: {bad}"
        )
    failed = sorted({r["mode"] for r in rows if "error" in r})
    if failed:
        summary["failed"] = failed
    return summary


def criteria(comparisons: list[dict]) -> dict:
    """The goals over every (cp, seq) measured: shardax's tokens/s ≥ the
    faster of torch's rotate methods'; its activation ≤ the smaller of
    theirs, in both measures; and ≤ ``ACTIVATION_SLACK``/cp of one
    process's in the live measure — the activations themselves (the as
    trained one's verdict is reported beside it: a rank's heap keeps holes
    of about the same size whatever the rank count, which no split of the
    sequence divides). None where nothing was measured."""

    def every(key: str, ok: Callable[[float, dict], bool]) -> bool | None:
        values = [(c[key], c) for c in comparisons if c.get(key) is not None]
        return all(ok(v, c) for v, c in values) if values else None

    def both(a: bool | None, b: bool | None) -> bool | None:
        return None if a is None and b is None else bool(a) and bool(b)

    return {
        "tokens_per_s_ge_torch": every("tokens_per_s_vs_torch_best", lambda v, c: v >= 1.0),
        "activation_le_torch": both(
            every("activation_vs_torch_best", lambda v, c: v <= 1.0),
            every("activation_live_vs_torch_best", lambda v, c: v <= 1.0),
        ),
        "activation_about_1_over_cp": every(
            "shardax_activation_live_vs_single", lambda v, c: v <= ACTIVATION_SLACK / c["cp"]
        ),
        "activation_about_1_over_cp_as_trained": every(
            "shardax_activation_vs_single", lambda v, c: v <= ACTIVATION_SLACK / c["cp"]
        ),
        "activation_slack": ACTIVATION_SLACK,
    }


# ---------------------------------------------------------------- the memory cgroup search


CGROUP_V1 = "/sys/fs/cgroup/memory"


def cgroup_base() -> tuple[str, str] | tuple[None, str]:
    """Where this process may make memory cgroups — its own memory cgroup
    (v1, or v2 with the memory controller) — and the version; or None and why not."""
    if os.geteuid() != 0:
        return None, "memory cgroups need root"
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and os.path.isdir(CGROUP_V1):
            base = CGROUP_V1 + path
            if os.access(base, os.W_OK):
                return base, "v1"
    for line in lines:
        if line.startswith("0::"):
            base = "/sys/fs/cgroup" + line[3:]
            controllers = Path(base, "cgroup.controllers")
            memory = controllers.is_file() and "memory" in controllers.read_text().split()
            if memory and os.access(base, os.W_OK):
                return base, "v2"
    return None, "no writable memory cgroup (cgroup v1 memory controller or v2 with memory)"


def _cgroup_files(version: str) -> dict[str, str]:
    if version == "v1":
        return {"limit": "memory.limit_in_bytes", "peak": "memory.max_usage_in_bytes"}
    return {"limit": "memory.max", "peak": "memory.peak"}


def _oom_kills(group: Path, version: str) -> int:
    name = "memory.oom_control" if version == "v1" else "memory.events"
    with contextlib.suppress(OSError):
        for line in Path(group, name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return 0


def _empty_and_remove(group: Path) -> int:
    """Kill what is left in ``group`` (processes this run started), wait for
    it to empty, remove it; the number killed."""
    killed = 0
    for _ in range(100):
        pids = [int(p) for p in Path(group, "cgroup.procs").read_text().split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.1)
    group.rmdir()
    return killed


def _shm_files() -> set[str]:
    return (
        {p.name for p in Path("/dev/shm").glob("shardax-*")} if Path("/dev/shm").is_dir() else set()
    )


def try_length(
    mode: str, cp: int, seq: int, args: argparse.Namespace, base: str, version: str
) -> dict:
    """One training step of ``mode`` on ``cp`` ranks at sequence ``seq``,
    each rank in a memory cgroup of its own capped at the limit: whether it
    completed, and if not whether the kernel killed it for memory."""
    from shardax.launch import launch

    files = _cgroup_files(version)
    parent = Path(base, f"shardax-context-{os.getpid()}")
    groups = [parent / f"r{i}" for i in range(cp)]
    shm_before = _shm_files()
    row: dict = {"seq": seq}
    parent.mkdir()
    try:
        if version == "v2":
            Path(parent, "cgroup.subtree_control").write_text("+memory")
        for group in groups:
            group.mkdir()
            Path(group, files["limit"]).write_text(str(args.memory_limit_mib * 2**20))
        with tempfile.TemporaryDirectory(prefix="shardax-context-search-") as tmp:
            result = Path(tmp) / "result.json"
            search = argparse.Namespace(
                **{**vars(args), "steps": 1, "warmup": 0, "memory_steps": 1}
            )
            argv = worker_argv(mode, cp, seq, search, result)
            enter = 'echo $$ > "$1/r$LOCAL_RANK/cgroup.procs" && shift && exec "$@"'
            started = time.perf_counter()
            code = launch(
                ["/bin/sh", "-c", enter, "sh", str(parent), *argv], nproc_per_node=cp,
                env=rank_env(cp), log_ranks=None if args.verbose else (),
                timeout=args.search_timeout, kill_grace=2.0,
            )  # fmt: skip
            row["wall_s"] = time.perf_counter() - started
            row["exit_code"] = code
            _stop_if_stopped(f"code {code}")
            row["ok"] = code == 0 and result.is_file()
        row["oom_kills"] = sum(_oom_kills(g, version) for g in groups)
        row["peak_mib_per_rank"] = [int(Path(g, files["peak"]).read_text()) / 2**20 for g in groups]
        row["timed_out"] = code == 124
    finally:
        leftover = sum(_empty_and_remove(g) for g in groups if g.is_dir())
        parent.rmdir()
        leaked = _shm_files() - shm_before
        for name in leaked:
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{name}")
        row["leftover_processes_killed"] = leftover
        row["shm_files_removed"] = len(leaked)
    return row


def longest(mode: str, cp: int, args: argparse.Namespace, base: str, version: str) -> dict:
    """The longest sequence (a multiple of ``--search-step``) for which one
    training step of ``mode`` on ``cp`` ranks completes under the per-rank
    limit: doubling from ``--search-start``, then bisecting."""
    tries: list[dict] = []
    good, bad = 0, None

    def attempt(seq: int) -> bool | None:
        row = try_length(mode, cp, seq, args, base, version)
        tries.append(row)
        label = f"{mode}-cp{cp}-zero{args.zero}"
        print(json.dumps({"memory_search": label, **row}), file=sys.stderr, flush=True)
        if row["ok"]:
            return True
        return False if row["oom_kills"] or row["timed_out"] else None  # None: another error

    seq = args.search_start
    while seq <= args.search_max:
        verdict = attempt(seq)
        if verdict is None:
            return {"longest": None, "error": "a run failed other than by memory", "tries": tries}
        if not verdict:
            bad = seq
            break
        good, seq = seq, seq * 2
    step = args.search_step
    while bad is not None and bad - good > step:
        mid = (good + bad) // 2 // step * step
        verdict = attempt(mid)
        if verdict is None:
            return {"longest": None, "error": "a run failed other than by memory", "tries": tries}
        good, bad = (mid, bad) if verdict else (good, mid)
    return {"longest": good or None, "first_failure": bad, "tries": tries}


def memory_search(args: argparse.Namespace, shardax_reason: str | None) -> dict:
    """The longest sequence one process and shardax at each cp train in the
    per-rank memory limit, and their ratio; or why not."""
    if not args.memory_search:
        return {"skipped": "--smoke" if args.smoke else "--no-memory-search"}
    base, version = cgroup_base()
    if base is None:
        return {"skipped": version}
    found: dict = {
        "limit_mib_per_rank": args.memory_limit_mib,
        "cgroup": version,
        "per_rank": True,
        "search": {"start": args.search_start, "step": args.search_step,
                   "max": args.search_max, "timeout_s": args.search_timeout,
                   "zero": args.search_zero},
    }  # fmt: skip
    found["single"] = longest("single", 1, args, base, version)
    if shardax_reason:
        found["skipped"] = {"shardax": shardax_reason}
        return found
    one = found["single"]["longest"]
    for zero in args.search_zero:
        for cp in args.cp:
            staged = argparse.Namespace(**{**vars(args), "zero": zero})
            result = {"zero": zero, **longest("shardax", cp, staged, base, version)}
            result["longest_vs_single"] = _ratio(result["longest"], one)
            result["goal"] = cp
            result["holds"] = None if result["longest_vs_single"] is None else (
                result["longest_vs_single"] >= cp
            )  # fmt: skip
            found[f"shardax-cp{cp}" + (f"-zero{zero}" if zero else "")] = result
    return found


def print_table(summary: dict, file=sys.stderr) -> None:
    """The summary, readable."""
    print(f"{'case':<26}{'tokens/s':>10}{'step s':>9}{'act MiB':>9}{'live MiB':>9}"
          f"{'peak MiB':>10}{'first loss':>12}", file=file)  # fmt: skip
    for name, s in summary["summary"].items():
        act, live = ("-" if s.get(k) is None else f"{s[k]:.0f}" for k in MEASURES)
        print(f"{name:<26}{s['tokens_per_s']:>10.0f}{s['step_s']:>9.2f}{act:>9}{live:>9}"
              f"{s['peak_rss_mib']:>10.0f}{s['first_loss']:>12.5f}", file=file)  # fmt: skip
    for c in summary["comparisons"]:
        parts = [f"cp{c['cp']} s{c['seq']}:"]
        for key in ("tokens_per_s_vs_torch", "tokens_per_s_vs_torch-alltoall",
                    "activation_vs_torch_best", "activation_live_vs_torch_best",
                    "shardax_activation_vs_single", "shardax_activation_live_vs_single",
                    "torch_activation_vs_single"):  # fmt: skip
            if c.get(key) is not None:
                parts.append(f"{key} {c[key]:.2f}")
        print("  ".join(parts), file=file)
    print(f"criteria: {summary['criteria']}", file=file)
    if "warning" in summary:
        print(f"WARNING: {summary['warning']}", file=file)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", help=f"comma list (default: {','.join(DEFAULT_MODES)}); "
                        f"all: {','.join(ALL_MODES)}")  # fmt: skip
    parser.add_argument("--cp", type=_ints, default=[2, 4], help="rank counts (default 2,4)")
    parser.add_argument("--seqs", type=_ints, default=[4096, 8192, 16384], help="sequence lengths")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--memory-steps", dest="memory_steps", type=int, default=2,
                        help="untimed steps after them, measuring the activation memory")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="runs per case, interleaved")
    parser.add_argument("--max-others", dest="max_others", type=float, default=0.15,
                        help="run again a run during which other processes took more than this "
                        "share of the CPU time (/proc/stat less this benchmark's)")  # fmt: skip
    parser.add_argument("--retries", type=int, default=2, help="tries more per busy run")
    parser.add_argument("--quiet-wait", dest="quiet_wait", type=float, default=600.0,
                        help="seconds each run may wait for other processes to leave the CPU")  # fmt: skip
    parser.add_argument("--live", action="store_true", help=argparse.SUPPRESS)  # a live-pass rank
    parser.add_argument("--live-from", dest="live_from", metavar="FROM.json",
                        help="run the live memory pass for an earlier run's cases and write it "
                        "with that run's rows, summarized again, into --out")  # fmt: skip
    parser.add_argument("--summarize", metavar="FROM.json",
                        help="summarize the runs of an earlier JSON again (its probe and memory "
                        "search kept) into --out; runs nothing")  # fmt: skip
    parser.add_argument("--zero", type=int, default=0, choices=range(4),
                        help="the ZeRO stage of the shardax mode, over the cp ranks (default 0: "
                        "parameters replicated, as torch's DDP)")  # fmt: skip
    parser.add_argument("--search-zero", dest="search_zero", type=_ints, default=[0, 3],
                        help="the ZeRO stages the memory search tries shardax with")  # fmt: skip
    parser.add_argument("--d-model", dest="d_model", type=int, default=128)
    parser.add_argument("--n-layers", dest="n_layers", type=int, default=2)
    parser.add_argument("--n-heads", dest="n_heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=str(DATA), help="a text file, read as bytes")
    parser.add_argument("--out", help=f"the JSON (default: {RESULTS.relative_to(ROOT)}; "
                        "none with --smoke)")  # fmt: skip
    parser.add_argument("--memory-search", dest="memory_search", action=argparse.BooleanOptionalAction,
                        default=None, help="the longest sequence in a memory cgroup (default: "
                        "on, off with --smoke)")  # fmt: skip
    parser.add_argument("--memory-limit-mib", dest="memory_limit_mib", type=int, default=512,
                        help="each rank's memory cgroup limit for the search")  # fmt: skip
    parser.add_argument("--search-start", dest="search_start", type=int, default=2048)
    parser.add_argument("--search-step", dest="search_step", type=int, default=512,
                        help="the search's granularity (a multiple of 2 × every cp)")  # fmt: skip
    parser.add_argument("--search-max", dest="search_max", type=int, default=262144)
    parser.add_argument("--search-timeout", dest="search_timeout", type=float, default=300.0,
                        help="seconds before a try counts as failed (thrashing)")  # fmt: skip
    parser.add_argument("--no-probe", dest="probe", action="store_false",
                        help="skip the probe of torch's CP on CPU")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="tiny model and lengths, 2 ranks")
    parser.add_argument("--verbose", action="store_true", help="show the ranks' output")
    parser.add_argument("--worker", metavar="MODE", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.cp, args.seqs, args.steps, args.warmup, args.repeats = [2], [256, 512], 2, 1, 1
        # the suite keeps the cores busy: no waiting, no reruns
        args.memory_steps, args.retries, args.quiet_wait = 1, 0, 0.0
        args.d_model, args.n_layers, args.n_heads = 64, 2, 2
    if args.memory_search is None:
        args.memory_search = not args.smoke
    if args.out is None and not args.smoke:
        args.out = str(RESULTS)
    args.modes = args.modes.split(",") if args.modes else list(DEFAULT_MODES)
    unknown = [m for m in args.modes if m not in ALL_MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; modes: {','.join(ALL_MODES)}")
    for name in ["steps", "repeats", "batch", "memory_steps"]:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for cp in args.cp:
        if cp < 2:
            parser.error(f"--cp {cp}: context parallelism needs at least 2 ranks")
        odd = [s for s in args.seqs if s % (2 * cp)]
        if odd or args.search_step % (2 * cp) or args.search_start % (2 * cp):
            parser.error(f"sequence lengths must be multiples of 2 × cp = {2 * cp} "
                         "(head–tail splits each into 2·cp chunks)")  # fmt: skip
    return args


def summarize_again(path: Path, args: argparse.Namespace) -> int:
    """``--summarize``: the summary of an earlier run's rows, by this
    version's rules (``--max-others``), its probe and memory search kept;
    ``--live-from``: the same, its live memory pass run (again) first."""
    earlier = json.loads(path.read_text())
    cases = cases_of(earlier["modes"], earlier["cp"], earlier["seqs"])
    runs = earlier["runs"]
    if args.live_from:  # its live pass (again), on the same cases, model and steps
        for key in ("batch", "warmup", "memory_steps", "zero", "repeats"):
            setattr(args, key, earlier[key])
        args.d_model, args.n_layers, args.n_heads = (
            earlier["model"][k] for k in ("d_model", "n_layers", "n_heads")
        )
        # the timed runs as they were (without the live fields of an earlier way
        # of measuring it: lowering the threshold mid-run, too late for the heap)
        runs = [{k: v for k, v in r.items() if "_live" not in k} for r in runs]
        runs = [r for r in runs if r.get("pass") != "live"]
        runs += live_pass({c.name: c for c in cases}, args)
    summary = summarize(runs, cases, args.max_others)
    kept = {k: earlier[k] for k in ("torch_cp_on_cpu", "memory_search") if k in earlier}
    stale = {"runs", "summary", "comparisons", "criteria", "first_loss_spread", "warning", "failed"}
    header = {k: v for k, v in earlier.items() if k not in stale | kept.keys()}
    header["max_others"] = args.max_others
    result = {**header, "runs": runs, **summary, **kept}
    print_table(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        code = worker(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # torch 2.13's gloo may abort in finalization (benchmarks/train.py)
    if args.summarize or args.live_from:
        return summarize_again(Path(args.summarize or args.live_from), args)
    reason = shardax_missing()
    skipped = {"shardax": reason} if reason and "shardax" in args.modes else {}
    modes = [m for m in args.modes if m not in skipped]
    cases = cases_of(modes, args.cp, args.seqs)
    cfg = model_config(args, max(args.seqs))
    header = {
        "benchmark": "context",
        "model": model_facts(cfg, param_count(cfg)),
        "cp": args.cp,
        "seqs": args.seqs,
        "batch": args.batch,
        "modes": modes,
        "cases": [c.name for c in cases],
        "zero": args.zero,
        "threads_per_rank": {str(n): threads_per_rank(n) for n in sorted({1, *args.cp})},
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "shardax_source_sha256": source_digest(),
        "memory_method": "per rank, in untimed steps after the timed ones, a step's memory: "
        "VmHWM during the step (reset via /proc/self/clear_refs just before) minus VmRSS just "
        "before it, after malloc_trim(0); activation: the largest such at the sequence minus "
        f"the last at {SHORT} tokens per rank (what a step needs whatever the length); the "
        "largest over the ranks",
        "memory_steps": args.memory_steps,
        "max_others": args.max_others,
        "skipped": skipped,
    }
    print(json.dumps(header), flush=True)
    probe = {f"cp{n}": run_probe(args, n) for n in args.cp} if args.probe else {}
    probe = probe or {"skipped": "--no-probe"}
    by_name = {c.name: c for c in cases}
    rows = interleaved_runs(by_name, args)
    rows += live_pass(by_name, args)
    summary = summarize(rows, cases, args.max_others)
    summary["torch_cp_on_cpu"] = probe
    summary["memory_search"] = memory_search(args, reason)
    print(json.dumps(summary), flush=True)
    print_table(summary)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**header, "runs": rows, **summary}, indent=2) + "\n")
    probe_failed = any("error" in p for p in probe.values() if isinstance(p, dict))
    return 1 if summary.get("failed") or probe_failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
