"""The cost model: one layout's step time and per-rank peak memory on a
cluster, each part named so that ``--why`` can show it.

Time (one optimizer step, the slowest rank):

- **compute**: each micro-batch's forward and backward — the model's FLOPs
  (:class:`ModelShape`) over the achievable matmul rate, plus the bytes the
  elementwise kernels move over the memory bandwidth — split by tensor and
  sequence parallelism; rematerialisation adds a forward (``save_nothing``)
  or its elementwise part (``save_matmuls``);
- **tensor/sequence/expert communication** (Megatron's all-reduces,
  Ulysses' all-to-alls, the tokens sent to their experts and back, the
  gathered logits): on the critical path, exposed;
- **pipeline bubble**: the schedule simulated (:mod:`._pipe`) with the
  stages' forward and backward times and the activations' transfer;
- **data-parallel communication** (ZeRO's all-reduces, all-gathers and
  reduce-scatters of the layouts): alpha–beta over the link the group
  crosses (NVLink within a node, the network across), ring or tree as NCCL
  picks; up to ``cluster.overlap`` of it hidden behind the compute it can
  run under (not under a pipeline, whose gradients are reduced after the
  flush);
- **optimizer step**: the bytes it reads and writes over the memory
  bandwidth, and what offloading moves over the host link or the disk.

Memory (the most loaded rank): the runtime's reserve, the exact
:func:`~shardax.explain` bytes of the rank's stages by role (params, grads,
optimizer state on the device), the largest gathered unit under ZeRO-3
(two with prefetch), the activations the schedule keeps in flight under the
remat policy, the logits, and what the allocator keeps beyond them step
after step (``Cluster.allocator_slack`` of the activations in tensors under
its threshold).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
from torch import nn

from ..config import RunConfig
from ..errors import PlanError
from ..shard._explain import KEPT
from ._cluster import Cluster, Link
from ._model import VOCAB_TRAFFIC, ModelShape
from ._pipe import pipeline_time
from ._state import _leaf_state_bytes, _optimizer_bytes

__all__ = ["Estimate", "predict"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# optimizer state per element, by type (fp32 moments)
# bytes an optimizer step reads and writes per element, beyond its state (param, grad)
STEP_BYTES = 3


@attrs.frozen
class Estimate:
    """One layout's predicted step: ``time`` (seconds per part), ``memory``
    (bytes per part, the most loaded rank), what each part assumed
    (``notes``, shown by ``--why``)."""

    config: RunConfig
    world_size: int
    seq: int
    tokens_per_step: int
    time: Mapping[str, float]
    memory: Mapping[str, float]
    offloaded: Mapping[str, float]
    model_flops: float  # per step, all ranks, without recomputation
    hardware_flops: float  # with recomputation
    peak_flops: float  # per device, at the params' dtype
    notes: tuple[str, ...] = ()

    @property
    def step_time(self) -> float:
        return float(sum(self.time.values()))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time

    @property
    def peak_memory(self) -> float:
        """Bytes on the most loaded device."""
        return float(sum(self.memory.values()))

    @property
    def tflops(self) -> float:
        """Hardware TFLOP/s per device (recomputation included, as
        Megatron-LM reports it)."""
        return self.hardware_flops / self.step_time / self.world_size / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: the model's FLOPs (no recomputation)
        over the devices' peak."""
        return self.model_flops / self.step_time / self.world_size / self.peak_flops

    def breakdown(self) -> dict[str, Any]:
        """Everything as plain data (JSON)."""
        return {
            "step_time_s": self.step_time,
            "tokens_per_s": self.tokens_per_s,
            "peak_memory_bytes": self.peak_memory,
            "tflops_per_device": self.tflops,
            "mfu": self.mfu,
            "time_s": dict(self.time),
            "memory_bytes": dict(self.memory),
            "offloaded_bytes": dict(self.offloaded),
            "notes": list(self.notes),
        }


@attrs.frozen
class _Sizes:
    """The layout's degrees and batch split."""

    tp: int
    sp: int
    pp: int
    dp: int
    micro_batches: int  # per step and data rank, through the pipeline (or accumulated)
    micro_size: int  # sequences per micro-batch
    global_batch: int
    virtual: int
    ep: int = 1
    replicas: int = 1  # HSDP: the data ranks holding the same shards
    inner: int = 1  # with parallel.node: the ZeRO ranks of a node (hpZ's and qgZ's groups)


def _sizes(config: RunConfig, world: int) -> _Sizes:
    mesh = config.abstract_mesh(world)
    p = config.parallel

    def size(axis: str | None) -> int:
        return mesh.size(axis) if axis is not None and axis in mesh.axis_names else 1

    dp = config.dp_size(world)
    batch = config.batch.resolve(dp)
    pp = size(p.pp)
    if pp > 1:
        m = p.pp_micro_batches or 2 * pp
        if batch.micro % m:
            raise PlanError(
                f"batch.micro {batch.micro} is not divisible by parallel.pp_micro_batches {m}: "
                "each pipeline micro-batch is a whole number of sequences"
            )
        micro, size_ = m, batch.micro // m
    else:
        micro, size_ = batch.accumulation, batch.micro
    virtual = p.pp_virtual if p.pp_schedule in ("interleaved_1f1b", "looped_bfs") else 1
    if p.pp_schedule in ("zbv", "dualpipe_v"):
        virtual = 2
    inner = size(p.zero_axis) if p.node is not None else 1
    return _Sizes(
        size(p.tp), size(p.sp), pp, dp, micro, size_, batch.global_size, virtual, size(p.ep),
        size(p.replicate), inner,
    )  # fmt: skip


def _group_link(mesh: Any, axes: tuple[str | None, ...], cluster: Cluster) -> Link:
    """The link a collective over ``axes`` (of the abstract ``mesh``) crosses:
    the network when its ranks sit on more than one node (ranks are laid out
    in mesh order, the last axis fastest), else the node's."""
    names, sizes = mesh.axis_names, mesh.axis_sizes
    span = 1
    for axis in axes:
        if axis in names:
            i = names.index(axis)
            span = max(span, math.prod(sizes[i:]))
    return cluster.inter if span > cluster.devices_per_node else cluster.intra


def collective_time(op: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds of one collective over ``n`` ranks moving a ``nbytes``
    buffer (the whole, gathered size): ring, or for all-reduce the cheaper
    of ring and tree (NCCL's choice by size).

    >>> from shardax.plan import Link
    >>> link = Link(bandwidth=100e9, latency=10e-6)
    >>> round(collective_time("all_reduce", 1e9, 8, link) * 1e3, 2)  # 2·7/8 GB at 100 GB/s
    17.64
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    share = (n - 1) / n * nbytes / link.bandwidth
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) * link.latency + (n - 1) / n * nbytes / link.gather
    if op == "all_reduce":
        ring = 2 * (n - 1) * link.latency + 2 * share
        tree = 2 * math.ceil(math.log2(n)) * link.latency + 2 * nbytes / link.bandwidth
        return min(ring, tree)
    if op == "all_to_all":
        return (n - 1) * link.latency + share
    raise ValueError(f"unknown collective {op!r}")


def predict(
    config: RunConfig,
    model: nn.Module | None,
    cluster: Cluster,
    *,
    seq: int,
    world_size: int | None = None,
    attention: str = "flash",
    shape: ModelShape | None = None,
    state: Any = None,
    exact: bool = True,
) -> Estimate:
    """Predict one optimizer step of ``model`` (on ``meta``) laid out by
    ``config`` on ``world_size`` devices of ``cluster`` (default: all of
    them), sequences of ``seq`` tokens: its time and the peak memory of the
    most loaded rank, each part named.

    ``attention``: ``"flash"`` (fused: the scores are never stored, as
    ``scaled_dot_product_attention`` on GPUs) or ``"materialized"`` (the
    scores written out and softmaxed in memory, as Megatron-LM in 2021).
    ``state``: the per-rank training state as ``state_bytes`` returns it,
    to reuse between layouts that share it (the planner's search does);
    ``exact=False``: the pipeline's bubble from a closed form, not simulated.

    >>> import torch, shardax as sx
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> with torch.device("meta"):
    ...     gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4))
    >>> a100 = sx.plan.Cluster.load("a100-80gb").with_nodes(1)
    >>> run = sx.config.RunConfig.from_dict({"parallel": {"zero": 3},
    ...     "precision": {"params": "bf16"}, "batch": {"global": 64, "micro": 8}})
    >>> est = sx.plan.predict(run, gpt2, a100, seq=1024)
    >>> est.tokens_per_step, sorted(est.time)[:3]
    (65536, ['bubble', 'compute', 'dp_comm'])
    """
    world = world_size or cluster.world_size
    if shape is None:
        if model is None:
            raise PlanError("predict needs the model (on meta) or its ModelShape (shape=...)")
        shape = ModelShape.of(model)
    if attention not in ("flash", "materialized"):
        raise PlanError(f"attention is 'flash' or 'materialized'; got {attention!r}")
    s = _sizes(config, world)
    _check_divides(shape, s)
    if state is None:
        state = state_bytes(config, model, world, shape)
    return _estimate(config, cluster, world, seq, shape, s, attention == "flash", state, exact)


def _check_divides(shape: ModelShape, s: _Sizes) -> None:
    if shape.heads % (s.tp * s.sp) or shape.kv_heads % s.tp:
        raise PlanError(
            f"{shape.heads} heads ({shape.kv_heads} key/value heads) do not split over tp {s.tp}"
            f" x sp {s.sp}: each rank computes whole heads; pick degrees that divide them"
        )
    if s.pp > 1 and shape.layers % s.pp:
        raise PlanError(
            f"{shape.layers} blocks do not split evenly over {s.pp} pipeline stages; pick a pp "
            "that divides them"
        )


def state_bytes(
    config: RunConfig, model: nn.Module | None, world: int, shape: ModelShape
) -> dict[str, float]:
    """The training state of the most loaded rank by role (``params``,
    ``grads``, ``opt_state``, an offloaded role named with its kind):
    :func:`shardax.explain` of the rank's pipeline stages on the mesh
    without the pipeline axis, under ``config``'s rules. Without a model,
    the ZeRO arithmetic over ``shape``'s parameter count."""
    from ..shard import explain

    s = _sizes(config, world)
    pbytes = DTYPE_BYTES[config.precision.params]
    if model is None:
        return _state_arithmetic(config, shape, s, pbytes)
    mesh = config.abstract_mesh(world)
    kept = {a: mesh.size(a) for a in mesh.axis_names if a != config.parallel.pp}
    from ..mesh import AbstractMesh

    flat = AbstractMesh(kept or {"dp": 1})
    params = {k: v.to(dtype=_torch_dtype(config)) for k, v in model.named_parameters()}
    best: dict[str, float] = {}
    for held in _stage_params(params, shape, s.pp):
        table = explain(held, flat, config.make_rules(names="auto"),
                        opt_state_bytes=_leaf_state_bytes(config))  # fmt: skip
        roles = {role: float(max(b)) for role, b in table.roles}
        if sum(roles.values()) > sum(best.values()):
            best = roles
    return best


def _torch_dtype(config: RunConfig) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        config.precision.params
    ]


def _stage_params(params: dict[str, Any], shape: ModelShape, pp: int) -> list[dict[str, Any]]:
    """The parameters of the first and of the last pipeline rank (the
    embedding, the head): the most loaded ones."""
    if pp == 1:
        return [params]
    from ..pipeline import Stages

    stages = Stages(shape.blocks, (shape.layers // pp,) * pp)
    return [{k: v for k, v in params.items() if stages.held(k, [r])} for r in (0, pp - 1)]


def _state_arithmetic(
    config: RunConfig, shape: ModelShape, s: _Sizes, pbytes: int
) -> dict[str, float]:
    outer = shape.params - shape.layers * shape.block_params
    n = (shape.layers // s.pp * shape.block_params + outer) / s.tp
    zero, dp = config.parallel.zero, s.dp // s.replicas  # HSDP: split within a replica
    whole = _kept_whole(config, shape, shape.layers // s.pp, s)  # persist_below: on every rank
    state = {
        "params": (n - whole) * pbytes / (dp if zero == 3 else 1) + whole * pbytes,
        "grads": n * pbytes / (dp if zero >= 2 else 1),
        "opt_state": n * _optimizer_bytes(config) / (dp if zero >= 1 else 1),
    }
    if config.parallel.secondary:  # hpZ: the copy split within the node
        state["secondary"] = n * pbytes / s.inner
    if zero == 3 and config.parallel.keep_gathered:  # every block's, forward to backward
        state[KEPT] = n * pbytes
    return state


def _remat_share(config: RunConfig, layers: int) -> float:
    m = config.memory
    if m.remat is None:
        return 0.0
    return math.ceil(layers / m.remat_every) / layers


def _estimate(
    config: RunConfig,
    cluster: Cluster,
    world: int,
    seq: int,
    shape: ModelShape,
    s: _Sizes,
    flash: bool,
    state: Mapping[str, float],
    exact: bool,
) -> Estimate:
    p, mem = config.parallel, config.memory
    dtype = config.precision.params
    nbytes = DTYPE_BYTES[dtype]
    rate, bw = cluster.flops(dtype), cluster.memory_bandwidth
    split = p.sequence_parallel
    tokens = s.micro_size * seq / s.sp  # one micro-batch's tokens on a rank
    notes: list[str] = []

    # -- one block, forward and backward, on one rank ---------------------------------
    flops = tokens * shape.layer_flops(seq) / s.tp
    moved = tokens * shape.layer_traffic(seq, flash=flash, tp=s.tp, split_width=split) * nbytes
    fwd_compute = flops / rate + moved / bw
    mesh = config.abstract_mesh(world)
    tp_link = _group_link(mesh, (p.tp,), cluster)
    hidden = s.micro_size * seq * shape.width * nbytes  # one micro-batch's hidden states
    tp_fwd = 2 * collective_time("all_reduce", hidden, s.tp, tp_link)
    sp_link = _group_link(mesh, (p.sp,), cluster)
    qkvo = (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim
    sp_fwd = collective_time("all_to_all", tokens * qkvo * nbytes, s.sp, sp_link)
    ep_link = _group_link(mesh, (p.ep,), cluster)
    routed = tokens * shape.top_k * shape.width * nbytes  # each token to its experts and back
    ep_fwd = 2 * collective_time("all_to_all", routed, s.ep, ep_link) if shape.experts else 0.0
    comm_fwd = tp_fwd + sp_fwd + ep_fwd
    remat = _remat_share(config, shape.layers)
    redo = {"save_nothing": fwd_compute + comm_fwd, "save_matmuls": moved / bw}
    extra = remat * redo.get(mem.remat or "", 0.0)
    layer_f = fwd_compute + comm_fwd
    layer_b = 2 * fwd_compute + comm_fwd + extra

    # -- a rank's stage: its blocks, and the head (the last stage) --------------------
    per_rank = shape.layers // s.pp
    head_flops = 2 * shape.head_matmul * tokens / s.tp
    head_moved = VOCAB_TRAFFIC * shape.vocab * tokens * 4  # the loss on whole fp32 logits
    gathered_logits = tokens * shape.vocab * 4 if s.tp > 1 else 0.0
    head_f = head_flops / rate + head_moved / bw
    head_f += collective_time("all_gather", gathered_logits, s.tp, tp_link)
    forward = per_rank * layer_f + head_f
    backward = per_rank * layer_b + 2 * head_f
    notes.append(
        f"a micro-batch of {s.micro_size} x {seq} tokens: per block {flops / 1e9:.3g} GFLOP and "
        f"{moved / 2**20:.3g} MiB of elementwise traffic per rank, forward; backward twice that"
        + (f", plus the forward again on {remat:.0%} of the blocks ({mem.remat})" if remat else "")
    )

    # -- the step: micro-batches through the pipeline, or one after another -----------
    time: dict[str, float] = {}
    held = 1  # micro-batches whose activations a rank holds at once
    again = remat if mem.remat == "save_nothing" else 0.0  # the recomputed forward's comm
    tp_exposed = per_rank * (2 + again) * (tp_fwd + sp_fwd) * s.micro_batches
    ep_exposed = per_rank * (2 + again) * ep_fwd * s.micro_batches
    if s.pp > 1:
        pp_link = _group_link(mesh, (p.pp,), cluster)
        p2p = pp_link.time(hidden / (s.tp if split else 1))
        span, bubble, held = pipeline_time(
            p.pp_schedule, s.pp, s.micro_batches, p.pp_virtual, forward, backward, p2p, exact=exact
        )
        time["compute"] = s.micro_batches * (forward + backward) - tp_exposed - ep_exposed
        time["bubble"] = bubble
        chunk_layers = per_rank * s.pp / _stages(p.pp_schedule, s.pp, p.pp_virtual)
        notes.append(
            f"pipeline {p.pp_schedule} on {s.pp} ranks, {s.micro_batches} micro-batches: bubble "
            f"{bubble / span:.1%} of the step; activations {p2p * 1e3:.3g} ms per transfer; "
            f"{held} stage-micro-batches in flight on the busiest rank"
        )
    else:
        time["compute"] = s.micro_batches * (forward + backward) - tp_exposed - ep_exposed
        time["bubble"] = 0.0
        chunk_layers = per_rank
    time["tp_comm"] = tp_exposed
    time["ep_comm"] = ep_exposed
    compute_window = time["compute"]

    # -- data parallelism: the ZeRO stage's collectives -------------------------------
    outer = shape.params - shape.layers * shape.block_params
    block = shape.block_params - shape.expert_params * (1 - 1 / s.ep)  # its share of the experts
    grads_n = (per_rank * block + outer) / s.tp  # elements this rank reduces
    dp_axes = config.data_axes
    dp_link = _group_link(mesh, dp_axes, cluster)
    whole_n = _kept_whole(config, shape, per_rank, s)
    time["dp_comm"], overlappable = _dp_time(
        config, s, grads_n, nbytes, mesh, cluster, remat, whole_n
    )
    hidden_part = 0.0 if s.pp > 1 else min(overlappable, cluster.overlap * compute_window)
    time["dp_comm"] -= hidden_part
    if s.dp > 1:
        kind = "the network" if dp_link is cluster.inter else "the node's link"
        notes.append(
            f"ZeRO-{p.zero} over {s.dp} ranks across {kind}: {grads_n * nbytes / 2**20:.4g} MiB "
            f"of gradients per rank; {hidden_part:.3g} s hidden behind compute "
            f"(overlap {cluster.overlap:g}{', none under a pipeline' if s.pp > 1 else ''})"
        )

    # -- the optimizer step and what offloading moves ---------------------------------
    elems = grads_n / (s.dp // s.replicas if p.zero >= 1 else 1)
    opt = _optimizer_bytes(config)
    time["optimizer"] = elems * (2 * opt + 2 * nbytes + nbytes) / bw
    time["offload"] = _offload_time(config, cluster, world, s, elems, grads_n, opt, nbytes)

    # -- memory of the most loaded rank -----------------------------------------------
    memory: dict[str, float] = {"reserved": float(cluster.reserved_memory)}
    offloaded: dict[str, float] = {}
    for role, b in state.items():
        (offloaded if " (" in role else memory)[role] = b
    if p.zero == 3 and not p.keep_gathered:  # with it: the state's 'kept gathered'
        unit = shape.block_params / s.tp
        memory["gathered"] = unit * nbytes * (2 if p.prefetch else 1) + unit * nbytes
    full = tokens * shape.layer_saved(seq, flash=flash, tp=s.tp, split_width=split) * nbytes
    inputs = tokens * shape.width / (s.tp if split else 1) * nbytes
    if mem.remat == "save_matmuls":  # the matmuls' outputs: q, k, v, both projections, fc
        qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim / s.tp
        inputs = tokens * (qkv + 2 * shape.width + shape.mlp / s.tp) * nbytes
    kept = (1 - remat) * full + remat * min(inputs, full)
    memory["activations"] = held * chunk_layers * kept + 2 * full  # + the block in backward
    memory["allocator"] = cluster.allocator_slack * _small_churn(
        shape, seq, tokens, nbytes, flash, s, split, remat, held * chunk_layers,
        cluster.allocator_threshold,
    )  # fmt: skip
    memory["logits"] = tokens * shape.vocab * 4 * 3  # fp32, log-softmax, their gradient

    model_flops = s.global_batch * seq * shape.flops_per_token(seq)
    redone = remat if mem.remat == "save_nothing" else 0.0  # save_matmuls redoes no matmul
    hardware = (
        s.global_batch
        * seq
        * (shape.flops_per_token(seq) + redone * shape.layers * shape.layer_flops(seq))
    )
    return Estimate(
        config, world, seq, s.global_batch * seq, time, memory, offloaded,
        model_flops, hardware, rate / cluster.achievable, tuple(notes),
    )  # fmt: skip


def _small_churn(
    shape: ModelShape,
    seq: int,
    tokens: float,
    nbytes: int,
    flash: bool,
    s: _Sizes,
    split: bool,
    remat: float,
    layers_held: float,
    threshold: int | None,
) -> float:
    """The activations' bytes in tensors under the allocator's threshold
    (those it keeps in its arenas when freed): what its slack grows with."""
    parts = shape.layer_saved_parts(seq, flash=flash, tp=s.tp, split_width=split)

    def small(per_tensor: float) -> bool:
        return threshold is None or tokens * per_tensor * nbytes < threshold

    full = sum(tokens * count * nbytes for count, per in parts if small(per))
    width = shape.width / (s.tp if split else 1)
    inputs = tokens * width * nbytes if small(width) else 0.0
    return layers_held * ((1 - remat) * full + remat * inputs) + 2 * full


def _stages(name: str, ranks: int, virtual: int) -> int:
    if name in ("interleaved_1f1b", "looped_bfs"):
        return ranks * virtual
    if name in ("zbv", "dualpipe_v"):
        return 2 * ranks
    return ranks


def _kept_whole(config: RunConfig, shape: ModelShape, blocks: int, s: _Sizes) -> float:
    """The elements of a rank's ``blocks`` (and what lies outside them)
    that ZeRO-3's ``persist_below`` keeps whole, per tensor-parallel rank."""
    below = config.parallel.persist_below
    if config.parallel.zero != 3 or not below:
        return 0.0
    block, outer = shape.kept_whole(below)
    return (blocks * block + outer) / s.tp


def _dp_time(
    config: RunConfig,
    s: _Sizes,
    elements: float,
    nbytes: int,
    mesh: Any,
    cluster: Cluster,
    remat: float,
    whole: float = 0.0,
) -> tuple[float, float]:
    """(seconds of the data axes' collectives per step, the part of them
    that can run under the compute): gradients reduced each micro-batch
    (once per step under a pipeline), ZeRO-1/2's params gathered after the
    step, ZeRO-3's before each forward and backward — ``elements`` of
    ``nbytes`` each per rank. HSDP (``parallel.replicate``): ZeRO's
    collectives within a replica, the gradient shards all-reduced across
    the replicas. ZeRO++ (``parallel.node``): forward gathers in int8
    (qwZ), backward's within the node (hpZ), the reduce-scatter as int4
    all-to-alls within the node then across (qgZ); ``keep_gathered``: no
    backward gathers. ``whole`` of the ``elements`` ZeRO-3 keeps whole
    (``persist_below``): not gathered for the forward and backward, their
    update gathered after the step (not under the compute)."""
    p, zero = config.parallel, config.parallel.zero
    size = elements * nbytes
    data = _group_link(mesh, config.data_axes, cluster)
    inside = tuple(a for a in config.data_axes if a != p.replicate)  # ZeRO's axes
    shard_link = _group_link(mesh, inside, cluster)
    shard = s.dp // s.replicas
    node_link = _group_link(mesh, (p.zero_axis,), cluster)  # a node's ZeRO ranks (hpZ, qgZ)
    reduces = 1 if s.pp > 1 else s.micro_batches
    if zero <= 1:
        grads = collective_time("all_reduce", size, s.dp, data)
    elif p.quantize_grads:  # qgZ: int4 all-to-alls, within the node, then across
        int4 = elements * (0.5 + 4 / 256)
        grads = collective_time("all_to_all", int4, s.inner, node_link)
        grads += collective_time("all_to_all", int4 / s.inner, shard // s.inner, data)
    else:
        grads = collective_time("reduce_scatter", size, shard, shard_link)
        if s.replicas > 1:  # HSDP: each shard summed over the replicas
            grads += collective_time("all_reduce", size / shard, s.replicas, data)
    grads *= reduces
    gather = collective_time("all_gather", size, shard, shard_link)
    if zero == 3:
        split = elements - whole  # gathered for each forward and backward
        forward = collective_time("all_gather", split * nbytes, shard, shard_link)
        if p.quantize_weights:  # qwZ: int8 blocks
            forward = collective_time("all_gather", split * (1 + 4 / 256), shard, shard_link)
        backward = forward
        if p.secondary:  # hpZ: from the copy within the node
            backward = collective_time("all_gather", split * nbytes, s.inner, node_link)
        if p.keep_gathered:  # the forward's gather kept for the backward
            backward = 0.0
        gathers = (forward + backward + (remat > 0) * forward) * s.micro_batches
        after = collective_time("all_gather", whole * nbytes, shard, shard_link) if whole else 0.0
        return grads + gathers + after, grads + gathers
    after = gather if zero >= 1 else 0.0
    return grads + after, grads


def _offload_time(
    config: RunConfig,
    cluster: Cluster,
    world: int,
    s: _Sizes,
    elems: float,
    grads_n: float,
    opt: int,
    nbytes: int,
) -> float:
    """Seconds a step spends moving offloaded state: the optimizer state read
    and written once, the params' shards read in each forward and backward,
    the reduced gradients written; over the disk (shared by a node's ranks;
    at the host link's speed where the node's optimizer files fit in a
    quarter of its memory: the page cache keeps them) or the host link."""
    m = config.memory
    per_node = min(world, cluster.devices_per_node)
    disk = cluster.disk_bandwidth / per_node
    if per_node * 2 * elems * opt < cluster.host_memory / 4:  # the page cache holds the files
        disk = cluster.host_bandwidth

    def over(kind: str | None) -> float:
        if kind is None:
            return math.inf
        return disk if kind.startswith("disk:") else cluster.host_bandwidth

    shard = grads_n / (s.dp // s.replicas if config.parallel.zero == 3 else 1)
    return (
        2 * elems * opt / over(m.offload_opt)
        + 2 * s.micro_batches * shard * nbytes / over(m.offload_params)
        + elems * nbytes / over(m.offload_grads)
    )
