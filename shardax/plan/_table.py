"""The plan table: one line per layout — its name, memory per rank by role,
the step split into compute, exposed communication and bubble, tokens/s,
TFLOP/s per device and MFU."""

from __future__ import annotations

from collections.abc import Sequence

from ._cost import Estimate

__all__ = ["layout_name", "render"]

_GiB = 2**30


def layout_name(est: Estimate) -> str:
    """A short name of the layout: its degrees, schedule, micro-batches,
    ZeRO stage, remat and offload.

    >>> import shardax as sx
    >>> from shardax.plan import ModelShape
    >>> shape = ModelShape(layers=4, width=64, heads=4, mlp=256, vocab=128, block_matmul=12 * 64**2,
    ...                    head_matmul=128 * 64, params=300_000, block_params=12 * 64**2)
    >>> run = sx.config.RunConfig.from_dict({"mesh": {"pp": 2, "dp": 4}, "batch": {"global": 32, "micro": 8},
    ...     "parallel": {"zero": 1, "pp": "pp", "pp_micro_batches": 4}})
    >>> layout_name(sx.plan.predict(run, None, sx.plan.Cluster.load("h100"), seq=64, shape=shape))
    'dp4 pp2 1f1b m4x2 zero1'
    """
    c, world = est.config, est.world_size
    p, mem = c.parallel, c.memory
    mesh = c.abstract_mesh(world)
    parts = []
    for axis, label in ((p.zero_axis, "dp"), (p.tp, "tp"), (p.sp, "sp"), (p.pp, "pp"),
                        (p.ep, "ep")):  # fmt: skip
        if axis is not None and axis in mesh.axis_names and (mesh.size(axis) > 1 or label == "dp"):
            parts.append(f"{label}{mesh.size(axis)}")
    if p.replicate:  # HSDP: replicas of the dp ranks' shards
        parts.append(f"hsdp x{mesh.size(p.replicate)}")
    if p.node:  # ZeRO over the nodes too, with ZeRO++'s options
        parts.append(f"x{mesh.size(p.node)} nodes")
    if p.sequence_parallel:
        parts.append("seqpar")
    batch = c.batch.resolve(c.dp_size(world))
    if p.pp is not None:
        m = p.pp_micro_batches or 2 * mesh.size(p.pp)
        parts.append(f"{p.pp_schedule} m{m}x{batch.micro // m}")
    else:
        parts.append(
            f"b{batch.micro}" + (f"x{batch.accumulation}" if batch.accumulation > 1 else "")
        )
    parts.append(f"zero{p.zero}")
    zeropp = "".join(n for n, on in (("w", p.quantize_weights), ("h", p.secondary),
                                     ("g", p.quantize_grads)) if on)  # fmt: skip
    if zeropp:
        parts.append(f"zero++{zeropp}")
    if mem.remat:
        parts.append("remat" if mem.remat == "save_nothing" else mem.remat)
    for role, kind in (("opt", mem.offload_opt), ("params", mem.offload_params),
                       ("grads", mem.offload_grads)):  # fmt: skip
        if kind:
            parts.append(f"{role}@{kind.split(':')[0]}")
    return " ".join(parts)


def render(plans: Sequence[Estimate]) -> str:
    """The table of ``plans`` (fastest first)."""
    head = ("#", "layout", "mem/rank GiB", "params/grads/opt/act", "step s",
            "compute/comm/bubble", "tokens/s", "TFLOP/s", "MFU")  # fmt: skip
    rows = []
    for i, est in enumerate(plans):
        m, t = est.memory, est.time
        state = [m.get("params", 0), m.get("grads", 0), m.get("opt_state", 0),
                 m.get("activations", 0) + m.get("logits", 0)]  # fmt: skip
        comm = t.get("tp_comm", 0) + t.get("dp_comm", 0) + t.get("offload", 0)
        compute = t.get("compute", 0) + t.get("optimizer", 0)
        rows.append((
            str(i + 1), layout_name(est), f"{est.peak_memory / _GiB:.1f}",
            "/".join(f"{v / _GiB:.1f}" for v in state), f"{est.step_time:.3g}",
            f"{compute:.3g}/{comm:.3g}/{t.get('bubble', 0):.3g}",
            f"{est.tokens_per_s:,.0f}", f"{est.tflops:.1f}", f"{est.mfu:.1%}",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r).rstrip() for r in rows]
    return "\n".join(lines)
