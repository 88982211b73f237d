"""The one executor: runs any valid :class:`Schedule` on real ranks and
returns the loss and the gradients, as :func:`shardax.value_and_grad` does.

Each rank runs its list in order. ``F`` runs the model's own forward
through :func:`shardax.apply` with the stage's parameters — blocks of other
stages passed through, the received hidden state put in at the stage's
first block, the forward stopped after its last (:class:`StopForward`) —
and sends the output on; ``B`` runs autograd from the output with the
gradient received from the next stage (on the last stage: the loss,
scaled) and sends the input's gradient back; ``I`` does the same with
the weight gradients of every linear deferred to ``W``
(:mod:`._deferred`). Messages go over the ``pp`` axis with
:func:`shardax.collectives.send`/:func:`~shardax.collectives.recv`, each
with its own tag, so no order of sends and receives can cross; a stage
handing over to a stage on the same rank (the turn of a V) passes the
tensor directly.

Gradients of all micro-batches are summed on each rank and reduced over
the stage's own data-parallel axes once per step (ZeRO's reduce or
reduce-scatter, by the parameters' placements); the outer parameters,
held by the first and the last stage, then add the other's gradient.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .. import collectives as C
from ..errors import ScheduleError
from ..mesh._mesh import Mesh
from ..shard._api import layouts_for
from ..shard._apply import StopForward, apply
from ..shard._grad import _TAPE, Tape, _grad_of
from ..shard._placement import Placement, role_layout
from ..shard._sharded import Sharded
from ..shard._transfer import Reducer
from ._checks import Probe, check_rules
from ._deferred import WeightGrads, deferring
from ._schedule import Schedule
from ._simulate import validate
from ._stages import Stages, stand_in

__all__ = ["value", "value_and_grad"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


class _Stage:
    """Hooks that make one :func:`apply` call run only stage ``stage``."""

    def __init__(self, model: nn.Module, stages: Stages, stage: int) -> None:
        self.container = model.get_submodule(stages.blocks)
        self.range = stages.block_range(stage)
        self.first, self.last = stage == 0, stage == stages.stages - 1

    @contextlib.contextmanager
    def running(self, x_in: torch.Tensor | None, probe: Probe | None = None) -> Iterator[None]:
        handles, skipped = [], []
        blocks = list(self.container)
        for i, block in enumerate(blocks):
            if i not in self.range:
                block.forward = _pass_through  # type: ignore[method-assign]
                skipped.append(block)
            elif probe is not None:
                handles.append(block.register_forward_pre_hook(probe.look, with_kwargs=True))
        if not self.first:
            handles.append(blocks[self.range.start].register_forward_pre_hook(
                _replace_hidden(x_in), with_kwargs=True))  # fmt: skip
        if not self.last:
            handles.append(blocks[self.range.stop - 1].register_forward_hook(_stop))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            for block in skipped:
                del block.forward


def _pass_through(*args: Any, **kwargs: Any) -> Any:
    """A block of another stage: the hidden state goes through unchanged."""
    return args[0] if args else kwargs["hidden_states"]


def _replace_hidden(x_in: torch.Tensor | None) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (x_in, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x_in}

    return hook


def _stop(module: nn.Module, args: Any, output: Any) -> None:
    raise StopForward(output)


class _Wire:
    """Sends and receives of one step over the ``pp`` axis."""

    def __init__(self, mesh: Mesh, axis: str, schedule: Schedule) -> None:
        self.mesh, self.axis, self.schedule = mesh, axis, schedule
        self.sends: list[Any] = []
        self.local: dict[tuple[str, int, int], torch.Tensor] = {}

    def _tag(self, kind: str, stage: int, micro: int) -> int:
        s = self.schedule
        return (((0 if kind == "act" else 1) * s.stages + stage) * s.micro_batches + micro) * 2

    def put(self, kind: str, src: int, dst: int, micro: int, x: torch.Tensor) -> None:
        """``x`` (from stage ``src`` to stage ``dst``) on its way."""
        me, peer = self.schedule.stage_rank[src], self.schedule.stage_rank[dst]
        if me == peer:
            self.local[(kind, dst, micro)] = x
            return
        x = x.detach().contiguous()
        tag = self._tag(kind, dst, micro)
        header = torch.zeros(8, dtype=torch.int64)
        if x.dim() > 6 or x.dtype not in _DTYPES:
            raise ScheduleError(
                f"stage {src} passes a {x.dtype} tensor of {x.dim()} dims to stage {dst}; a "
                f"pipeline passes floating tensors of at most 6 dims ({_DTYPES})"
            )
        header[0], header[1] = _DTYPES.index(x.dtype), x.dim()
        header[2 : 2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
        kw = {"mesh": self.mesh, "async_op": True}
        self.sends.append((C.send(header, self.axis, peer, tag=tag, **kw), header))
        self.sends.append((C.send(x, self.axis, peer, tag=tag + 1, **kw), x))

    def take(self, kind: str, src: int, dst: int, micro: int) -> torch.Tensor:
        """What stage ``src`` sent stage ``dst`` for ``micro``."""
        me, peer = self.schedule.stage_rank[dst], self.schedule.stage_rank[src]
        if me == peer:
            return self.local.pop((kind, dst, micro))
        tag = self._tag(kind, dst, micro)
        header = C.recv(torch.empty(8, dtype=torch.int64), self.axis, peer, tag=tag, mesh=self.mesh)
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        out = torch.empty(tuple(int(d) for d in header[2 : 2 + ndim]), dtype=dtype)
        return C.recv(out, self.axis, peer, tag=tag + 1, mesh=self.mesh)

    def finish(self) -> None:
        for handle, _ in self.sends:
            handle.wait()
        self.sends.clear()


def value_and_grad(
    model: nn.Module,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    schedule: Schedule,
    stages: Stages,
    *,
    mesh: Mesh,
    axis: str = "pp",
    bucket_bytes: int = 25 * 2**20,
    **apply_kwargs: Any,
) -> Callable[[dict[str, Any], Any, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]:
    """A function ``(params, inputs, targets) -> (loss, grads)`` that runs
    one step of ``schedule`` on this rank of ``mesh``'s ``axis``.

    ``params``: this rank's parameters (``stages.local(all_params,
    schedule, rank)``: its stages' blocks, and the outer parameters on the
    ranks of the first and last stage) — tensors, or :class:`Sharded`
    leaves on ``mesh.submesh`` of the other axes (ZeRO, tensor parallelism).
    ``inputs`` (``[batch, ...]``, the same on every rank of the axis) is
    cut into ``schedule.micro_batches`` micro-batches along dim 0, and so
    are ``targets``; ``loss_fn(model output, targets)`` is each
    micro-batch's mean loss on the last stage. ``loss`` is their mean, on
    every rank, and ``grads`` the gradients of it, keyed like ``params``
    (as :func:`shardax.value_and_grad` returns them: reduced over the
    stage's other axes).

    Args:
        model: the whole model (on ``meta`` is fine), split by ``stages``.
        loss_fn: ``(output of the model, targets) -> scalar``.
        schedule: what each rank runs (validated here, before any rank
            sends: a :class:`~shardax.errors.ScheduleError` instead of a hang).
        stages: from :func:`split`, as many stages as ``schedule`` has.
        mesh: the mesh with ``axis`` (of as many ranks as the schedule has).
        axis: the pipeline axis.
        bucket_bytes: gradient buckets, as :func:`shardax.value_and_grad`.
        **apply_kwargs: passed to :func:`shardax.apply` (``units``, ``rules``).

    >>> import torch, shardax as sx
    >>> from shardax import pipeline
    >>> class Net(torch.nn.Module):  # any model that calls a list of blocks in turn
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))
    ...     def forward(self, x):
    ...         for block in self.blocks:
    ...             x = block(x)
    ...         return x
    >>> model, mesh = Net(), sx.Mesh({"pp": 1})  # launched on N ranks: {"pp": N}
    >>> schedule, stages = pipeline.one_f_one_b(1, 2), pipeline.split(model, 1)
    >>> params = stages.local(sx.params_of(model), schedule, mesh.axis_index("pp"))
    >>> mse = lambda out, y: ((out - y) ** 2).mean()
    >>> step = pipeline.value_and_grad(model, mse, schedule, stages, mesh=mesh)
    >>> loss, grads = step(params, torch.ones(4, 2), torch.zeros(4, 2))
    >>> sorted(grads) == sorted(params), loss.shape
    (True, torch.Size([]))
    """
    pipe = _Pipe(model, loss_fn, schedule, stages, mesh, axis, apply_kwargs)

    def step(
        params: dict[str, Any], inputs: Any, targets: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        return pipe.run(params, inputs, targets, Tape(Reducer(bucket_bytes), accumulate=True))

    return step


def value(
    model: nn.Module,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    schedule: Schedule,
    stages: Stages,
    *,
    mesh: Mesh,
    axis: str = "pp",
    **apply_kwargs: Any,
) -> Callable[[dict[str, Any], Any, torch.Tensor], torch.Tensor]:
    """As :func:`value_and_grad`, the loss alone (evaluation): each rank
    runs only its forwards, in its schedule's order, without autograd.

    >>> import torch, shardax as sx
    >>> from shardax import pipeline
    >>> model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Identity()]))
    >>> model.forward = lambda x: model[0][0](x)  # one block: the identity
    >>> loss = pipeline.value(model, lambda out, y: (out - y).abs().mean(), pipeline.gpipe(1, 2),
    ...                       pipeline.split(model, 1), mesh=sx.Mesh({"pp": 1}))
    >>> loss({}, torch.ones(4, 3), torch.zeros(4, 3))
    tensor(1.)
    """
    pipe = _Pipe(model, loss_fn, schedule, stages, mesh, axis, apply_kwargs)

    def loss(params: dict[str, Any], inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return pipe.run(params, inputs, targets, None)[0]

    return loss


class _Pipe:
    """What one rank needs to run its part of ``schedule``: checked once."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        schedule: Schedule,
        stages: Stages,
        mesh: Mesh,
        axis: str,
        apply_kwargs: dict[str, Any],
    ) -> None:
        validate(schedule)
        stages.check(schedule)
        if axis not in mesh.axis_names or mesh.size(axis) != len(schedule.ranks):
            has = (
                f"{mesh.size(axis)} along {axis!r}"
                if axis in mesh.axis_names
                else f"no axis {axis!r}"
            )
            raise ScheduleError(
                f"the schedule runs on {len(schedule.ranks)} ranks; {mesh!r} has {has}"
            )
        self.model, self.loss_fn, self.schedule, self.stages = model, loss_fn, schedule, stages
        self.mesh, self.axis, self.apply_kwargs = mesh, axis, apply_kwargs
        self.stand_ins: dict[Any, dict[str, Any]] = {}  # stage mesh -> what stands in
        self.checked = False  # _check_rules ran (on the first step)
        self.probed = False  # _Probe ran (on the first step with gradients)
        self.rank = rank = mesh.axis_index(axis)
        mine = [s for s, r in enumerate(schedule.stage_rank) if r == rank]
        self.shapes = {k: (tuple(t.shape), t.dtype) for k, t in _model_tensors(model).items()}
        self.expected = {k for k in self.shapes if stages.held(k, mine)}
        self.runners = {s: _Stage(model, stages, s) for s in mine}
        self.split_backward = {(a.stage, a.micro) for a in schedule.ranks[rank] if a.kind == "I"}
        self.buffers = {k for k, _ in model.named_buffers()}
        _agree(stages, schedule, mesh, axis)

    def _stand_ins(self, params: dict[str, Any]) -> dict[str, Any]:
        """What this rank passes for the tensors it does not hold, taking no
        memory: the blocks' (never run here) as plain tensors; the outer
        modules' (run here only to recompute what the blocks take) as their
        pieces in the compute layout the rules give — a vocabulary-parallel
        embedding checks its piece's rows. Made once per stage mesh (the
        params' keys are checked to be the same every step)."""
        mesh = next((x.mesh for x in params.values() if isinstance(x, Sharded)), None)
        cached = self.stand_ins.get(mesh)
        if cached is None:
            cached = self.stand_ins[mesh] = self._make_stand_ins(params, mesh)
        return dict(cached)

    def _make_stand_ins(self, params: dict[str, Any], mesh: Mesh | None) -> dict[str, Any]:
        missing = [k for k in self.shapes if k not in params]
        rules = self.apply_kwargs.get("rules")
        out: dict[str, Any] = {k: stand_in(*self.shapes[k]) for k in missing}
        if rules is not None and mesh is not None and missing:
            tree = {k: torch.empty(s, dtype=d, device="meta") for k, (s, d) in self.shapes.items()}
            paths, _, _, layouts = layouts_for(tree, mesh, rules, role="compute")
            for path, layout in zip(paths, layouts, strict=True):
                if layout is not None and path in out and self.stages.stage_of(path) is None:
                    shape, dtype = self.shapes[path]
                    piece = stand_in(layout.local_shape(shape, mesh.rank), dtype)
                    kept = Placement(layout, layout, layout)  # computed where it lies
                    out[path] = Sharded(piece, layout, shape, placement=kept)
        return out

    def run(
        self, params: dict[str, Any], inputs: Any, targets: torch.Tensor, tape: Tape | None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """One step (``tape`` None: the forwards alone): the loss, the grads."""
        schedule, rank = self.schedule, self.rank
        _check_params(params, self.expected, rank, self.axis)
        if not self.checked:
            middle = not {0, schedule.stages - 1} & set(self.runners)  # outer modules on stand-ins
            check_rules(params, self.apply_kwargs.get("rules"), middle, self.mesh, self.axis)
            self.checked = True
        micro_in = _micro(inputs, schedule.micro_batches, "inputs")
        micro_tg = _micro(targets, schedule.micro_batches, "targets")
        tracked: list[tuple[str, Any, Any]] = []
        traced = params
        if tape is not None:
            traced, tracked = tape.track(params)
        full = self._stand_ins(params)
        probe = None
        if tape is not None and not self.probed:
            probe = Probe.swapping(full, params, self.buffers, self.stages)
        full.update(traced)
        world = _world(params)
        wire = _Wire(self.mesh, self.axis, schedule)
        live: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        deferred: dict[tuple[int, int], WeightGrads] = {}
        losses: list[torch.Tensor] = []
        last = schedule.stages - 1
        token = _TAPE.set(tape)
        try:
            for a in schedule.ranks[rank]:
                s, m = a.stage, a.micro
                if a.kind == "F":
                    x_in = None
                    if s > 0:
                        x_in = (
                            wire.take("act", s - 1, s, m).detach().requires_grad_(tape is not None)
                        )
                    mode: Any = contextlib.nullcontext()
                    if tape is not None and (s, m) in self.split_backward:
                        mode = deferring(deferred.setdefault((s, m), WeightGrads()))
                    with self.runners[s].running(x_in, probe), mode:
                        out = apply(self.model, full, micro_in[m], **self.apply_kwargs)
                    if s == last:
                        out = self.loss_fn(out, micro_tg[m])
                        losses.append(out.detach())
                    else:
                        wire.put("act", s, s + 1, m, out)
                    if tape is not None:
                        live[(s, m)] = (out, x_in)
                elif tape is None:
                    continue  # evaluation: the forwards only
                elif a.kind in ("B", "I"):
                    out, x_in = live.pop((s, m))
                    if s == last:
                        grad = torch.full_like(out, 1.0 / (schedule.micro_batches * world))
                    else:
                        grad = wire.take("grad", s + 1, s, m)
                    if out.requires_grad:
                        torch.autograd.backward(out, grad)
                    if s > 0:
                        assert x_in is not None
                        g = x_in.grad if x_in.grad is not None else torch.zeros_like(x_in)
                        wire.put("grad", s, s - 1, m, g)
                else:  # W
                    deferred.pop((s, m)).run()
            wire.finish()
            if probe is not None:
                self.probed = True
                probe.agree(sorted(self.shapes), self.mesh, self.axis)
        finally:
            _TAPE.reset(token)
            if tape is not None:
                tape.finish()
        grads: dict[str, Any] = {}
        if tape is not None:
            grads = {path: _grad_of(tape, x, t) for path, x, t in tracked}
            _sum_outer(
                grads, params, self.buffers, self.stages, schedule, self.mesh, self.axis, rank
            )
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        return _broadcast_loss(loss, params, schedule, self.mesh, self.axis), grads


def _agree(stages: Stages, schedule: Schedule, mesh: Mesh, axis: str) -> None:
    """Every rank of the pipeline runs the same split and schedule (a split
    balanced by time measured on each rank could differ: blocks would run
    twice or never); else a ScheduleError on every rank, before any step."""
    text = repr((stages, schedule))
    mine = torch.tensor([zlib.crc32(text.encode()), len(text)], dtype=torch.int64)
    every = C.all_gather(mine[None], axis, mesh=mesh)
    if not bool((every == mine).all()):
        differ = [r for r in range(every.shape[0]) if not bool((every[r] == mine).all())]
        raise ScheduleError(
            f"rank {mesh.axis_index(axis)} of {axis!r} runs {stages!r} with a "
            f"{schedule.stages}-stage schedule; ranks {differ} along {axis!r} run another split "
            "or schedule: every rank of a pipeline must make the same (balance by 'time' on "
            "one rank and give the counts to the others)"
        )


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


def _check_params(params: Any, expected: set[str], rank: int, axis: str) -> None:
    if not isinstance(params, dict):
        raise ScheduleError("the pipeline step takes params as a dict keyed by parameter path")
    missing, extra = sorted(expected - set(params)), sorted(set(params) - expected)
    if missing or extra:
        raise ScheduleError(
            f"rank {rank} of {axis!r} holds its stages' parameters (Stages.local(params, "
            "schedule, rank))"
            + (f"; missing: {missing[:5]}" if missing else "")
            + (f"; not its stages': {extra[:5]}" if extra else "")
        )


def _micro(x: Any, m: int, what: str) -> list[Any]:
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] % m:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ScheduleError(
            f"{what} of shape {shape}: its batch dim 0 must split into the schedule's {m} "
            "micro-batches evenly"
        )
    return list(x.chunk(m))


def _world(params: dict[str, Any]) -> int:
    meshes = {x.mesh for x in params.values() if isinstance(x, Sharded)}
    return max((m.world_size for m in meshes), default=1)


def _sum_outer(
    grads: dict[str, Any],
    params: dict[str, Any],
    buffers: set[str],
    stages: Stages,
    schedule: Schedule,
    mesh: Mesh,
    axis: str,
    rank: int,
) -> None:
    """The outer parameters' gradients, summed over the ranks that hold
    them: the shared ones over the whole axis, the others between the
    first and the last stage (each computed a part; a part no gradient
    reached is zero)."""
    first, last = schedule.stage_rank[0], schedule.stage_rank[-1]
    outer = [k for k in sorted(grads) if stages.stage_of(k) is None and k not in buffers]
    outer = [k for k in outer if _trained(params[k])]
    shared = [k for k in outer if k in stages.shared]
    for k in shared:
        grads[k] = _rewrap(
            grads[k], params[k], C.psum(_local(grads[k], params[k]), axis, mesh=mesh)
        )
    if first == last or rank not in (first, last):
        return
    peer = last if rank == first else first
    sends, recvs = [], []
    for i, k in enumerate(k for k in outer if k not in stages.shared):
        local = _local(grads[k], params[k])
        tag = 2**30 + 2 * i
        sends.append(C.send(local, axis, peer, tag=tag, mesh=mesh, async_op=True))
        into = torch.empty_like(local)
        recvs.append((k, local, C.recv(into, axis, peer, tag=tag, mesh=mesh, async_op=True)))
    for h in sends:
        h.wait()
    for k, local, h in recvs:
        grads[k] = _rewrap(grads[k], params[k], local + h.wait())


def _trained(x: Any) -> bool:
    return isinstance(x, (Sharded, torch.Tensor)) and x.dtype.is_floating_point


def _local(g: Any, x: Any) -> torch.Tensor:
    """A gradient's local tensor; zeros where none reached the parameter."""
    if g is not None:
        return (g.local if isinstance(g, Sharded) else g).contiguous()
    if isinstance(x, Sharded):
        grads = role_layout(x, "grads")
        return torch.zeros(grads.local_shape(x.shape, grads.mesh.rank), dtype=x.dtype)
    return torch.zeros_like(x)


def _rewrap(g: Any, x: Any, total: torch.Tensor) -> Any:
    if isinstance(x, Sharded):
        return Sharded(total, role_layout(x, "grads"), x.shape)
    return total


def _broadcast_loss(
    loss: torch.Tensor, params: dict[str, Any], schedule: Schedule, mesh: Mesh, axis: str
) -> torch.Tensor:
    meshes = {x.mesh for x in params.values() if isinstance(x, Sharded)}
    if meshes:
        stage_mesh = next(iter(meshes))
        if stage_mesh.world_size > 1:
            loss = C.pmean(loss, stage_mesh.axis_names, mesh=stage_mesh)
    return C.broadcast(loss, axis, src=schedule.stage_rank[-1], mesh=mesh)
