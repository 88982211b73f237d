"""The pipeline executor against the single-process model: 5 AdamW steps of
the tiny example GPT, split by ``pipeline.split`` and run by each schedule
on real gloo ranks, match ``torch.optim.AdamW`` on the whole model — loss
and every parameter to 1e-5 — on pp=2 and pp=4, dp=2 × pp=2 under ZeRO,
and pp=2 × tp=2; split backwards defer exactly the linears' weight
gradients; bad input is a typed error on every rank."""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from _parity import torch_adamw_steps
from _tiny import VOCAB, example_gpt

import shardax as sx
from shardax import pipeline
from shardax.errors import ScheduleError
from shardax.pipeline import Action, Schedule
from shardax.pipeline._deferred import WeightGrads, deferring

STEPS, BATCH = 5, 8
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-4, 0.1  # eps: see tests/shard/test_tensor_parallel.py


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (BATCH, 8)
    return [
        (torch.randint(0, VOCAB, shape, generator=g), torch.randint(0, VOCAB, shape, generator=g))
        for _ in range(STEPS)
    ]


@functools.cache
def _reference(n_layers: int, clip: float = 0.0) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = example_gpt(n_layers=n_layers)
    return torch_adamw_steps(model, _ce, _batches(), (LR, BETAS, EPS, WD), clip)


def _rules(name: str | None) -> Any:
    """Rules by name (built on the ranks: module rules do not pickle)."""
    if name is None:
        return None
    if name == "megatron":  # the head's logits: a marked piece of the vocabulary
        return sx.rules.megatron("tp", logits="vocab_parallel")
    if name == "ulysses":
        return sx.rules.ulysses("sp")
    if name == "ulysses+zero3":
        return sx.rules.ulysses("sp") + sx.rules.zero(3, "dp")
    if name == "context_parallel":
        return sx.rules.context_parallel("cp")
    if name.startswith("offload+"):  # parameters, gradients and state on disk, in _FOLDER
        where = f"{_FOLDER[0]}/{os.getpid()}"
        return _rules(name.removeprefix("offload+")) + sx.rules.offload(
            OFFLOADED, "disk", path=where
        )
    if name.startswith("remat"):  # "remat", "remat+zero3": the blocks rematerialised
        rest = name.removeprefix("remat").removeprefix("+")
        return sx.rules.remat(r"blocks\.\d+") + (_rules(rest) if rest else sx.rules.Rules())
    return sx.rules.zero(int(name.removeprefix("zero")))


def _ranked(
    make: Any,
    shape: dict[str, int],
    n_layers: int,
    rules: str | None,
    clip: float = 0.0,
    compiled: bool = False,
) -> tuple[list[float], dict]:
    mesh = sx.Mesh(shape)
    schedule = make()
    torch.manual_seed(0)
    model = example_gpt(n_layers=n_layers)
    if compiled:  # each block by torch.compile (inductor)
        for block in model.blocks:
            block.compile()
    stages = pipeline.split(model, schedule.stages)
    others = [a for a in mesh.axis_names if a != "pp"]
    if others:
        full = sx.shard(sx.params_of(model), mesh.submesh(others), _rules(rules))
    else:
        full = sx.params_of(model)
    params = stages.local(full, schedule, mesh.axis_index("pp"))
    loss_fn = _ce
    if rules == "megatron":  # the head's logits: this rank's piece of the vocabulary, marked

        def loss_fn(logits, y):
            return sx.vocab_parallel_cross_entropy(logits, y)

    module_rules = (
        "megatron",
        "ulysses",
        "ulysses+zero3",
        "remat",
        "remat+zero3",
        "context_parallel",
    )
    extra = {"rules": _rules(rules)} if rules in module_rules else {}
    step = pipeline.value_and_grad(model, loss_fn, schedule, stages, mesh=mesh, **extra)
    opt = sx.optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
    state = opt.init(params)
    n, i = (mesh.size("dp"), mesh.axis_index("dp")) if "dp" in shape else (1, 0)
    losses = []
    for x, y in _batches():
        rows = slice(i * BATCH // n, (i + 1) * BATCH // n)
        x, y = x[rows], y[rows]
        if "cp" in shape:  # this rank's zigzag piece of every sequence
            x, y = sx.data.shard_batch((x, y), mesh, sx.P(None, sx.zigzag("cp")))
        loss, grads = step(params, x, y)
        if clip:
            grads, _ = pipeline.clip_by_global_norm(grads, clip, stages, schedule, mesh=mesh)
        params, state = sx.optim.step(opt, grads, state, params)
        losses.append(loss.item())
    return losses, {k: sx.gather(v) if isinstance(v, sx.Sharded) else v for k, v in params.items()}


def _matches(results: list[tuple[list[float], dict]], n_layers: int, clip: float = 0.0) -> None:
    ref_losses, ref_params = _reference(n_layers, clip)
    held: set[str] = set()
    for losses, params in results:
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-5, msg=k)
        held |= set(params)
    assert held == set(ref_params)  # every parameter is on some rank


# (name, generator call for `ranks` ranks and 8 micro-batches, stages per rank)
SCHEDULES = {
    "gpipe": (lambda p, m: pipeline.gpipe(p, m), 1),
    "1f1b": (lambda p, m: pipeline.one_f_one_b(p, m), 1),
    "interleaved_1f1b": (lambda p, m: pipeline.interleaved_1f1b(p, m, virtual=2), 2),
    "looped_bfs": (lambda p, m: pipeline.looped_bfs(p, m, virtual=2), 2),
    "zb_h1": (lambda p, m: pipeline.zero_bubble_h1(p, m), 1),
    "zbv": (lambda p, m: pipeline.zbv(p, m), 2),
    "dualpipe_v": (lambda p, m: pipeline.dualpipe_v(p, m), 2),
}


def _make(name: str, p: int, m: int) -> Schedule:
    return SCHEDULES[name][0](p, m)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_matches_the_single_process_model_on_pp2(name):
    layers = 2 * SCHEDULES[name][1]
    results = run_ranks(_ranked, functools.partial(_make, name, 2, 8), {"pp": 2}, layers, None)
    _matches(results, layers)


@pytest.mark.parametrize(
    "name",
    ["1f1b", "zbv"]
    + [pytest.param(n, marks=pytest.mark.slow) for n in SCHEDULES if n not in ("1f1b", "zbv")],
)
def test_every_schedule_matches_on_pp4(name):
    layers = 4 * SCHEDULES[name][1]
    make = functools.partial(_make, name, 4, 8)
    _matches(run_ranks(_ranked, make, {"pp": 4}, layers, None, world_size=4), layers)


@pytest.mark.parametrize(
    ("name", "zero"),
    [("1f1b", 3), ("zb_h1", 3), pytest.param("1f1b", 1, marks=pytest.mark.slow),
     pytest.param("zbv", 2, marks=pytest.mark.slow)]
    + [pytest.param(n, 3, marks=pytest.mark.slow) for n in SCHEDULES if n not in ("1f1b", "zb_h1")],
)  # fmt: skip
def test_dp2_x_pp2_with_zero(name, zero):
    layers = 2 * SCHEDULES[name][1]
    make = functools.partial(_make, name, 2, 4)
    results = run_ranks(_ranked, make, {"dp": 2, "pp": 2}, layers, f"zero{zero}", world_size=4)
    _matches(results, layers)


@pytest.mark.parametrize(
    "name", ["1f1b"] + [pytest.param(n, marks=pytest.mark.slow) for n in SCHEDULES if n != "1f1b"]
)
def test_pp2_x_tp2_with_megatron(name):
    layers = 2 * SCHEDULES[name][1]
    make = functools.partial(_make, name, 2, 4)
    _matches(run_ranks(_ranked, make, {"pp": 2, "tp": 2}, layers, "megatron", world_size=4), layers)


@pytest.mark.parametrize(
    ("name", "shape"),
    [("1f1b", {"pp": 2, "sp": 2}), pytest.param("zbv", {"pp": 2, "sp": 2}, marks=pytest.mark.slow),
     pytest.param("zb_h1", {"dp": 2, "pp": 2, "sp": 2}, marks=pytest.mark.slow)],
)  # fmt: skip
def test_pp_x_sp_with_ulysses(name, shape):
    layers = 2 * SCHEDULES[name][1]
    make = functools.partial(_make, name, 2, 4)
    world = 8 if "dp" in shape else 4
    rules = "ulysses+zero3" if "dp" in shape else "ulysses"
    _matches(run_ranks(_ranked, make, shape, layers, rules, world_size=world), layers)


@pytest.mark.parametrize("name", ["1f1b", pytest.param("zbv", marks=pytest.mark.slow)])
def test_pp2_x_cp2_with_context_parallel(name):
    """Ring attention inside the stages: every cp rank of a stage runs the
    same micro-batch's piece of the sequence at the same time."""
    layers = 2 * SCHEDULES[name][1]
    make = functools.partial(_make, name, 2, 4)
    shape = {"pp": 2, "cp": 2}
    _matches(run_ranks(_ranked, make, shape, layers, "context_parallel", world_size=4), layers)


@pytest.mark.slow  # compiling takes about 20 s per rank
@pytest.mark.parametrize("name", ["zb_h1", "zbv"])
def test_zero_bubble_schedules_run_compiled_blocks(name):
    """Blocks compiled by ``torch.compile`` (inductor): zero-bubble
    schedules (split backwards, deferred weight gradients) give the eager
    single-process model's losses and parameters."""
    layers = 2 * SCHEDULES[name][1]
    make = functools.partial(_make, name, 2, 8)
    results = run_ranks(_ranked, make, {"pp": 2}, layers, None, 0.0, True)
    _matches(results, layers)


OFFLOADED = ("params", "grads", "opt_state")
_FOLDER = [""]


def _offloaded(folder: str, *args: Any) -> tuple[list[float], dict, list[str]]:
    """``_ranked`` with ``"offload+..."`` rules in ``folder``; what is left in
    this rank's own part of it (another rank may be between creating a file
    and unlinking it while this one looks)."""
    _FOLDER[0] = folder
    losses, params = _ranked(*args)
    left = [f for _, _, files in os.walk(f"{folder}/{os.getpid()}") for f in files]
    return losses, params, left


@pytest.mark.parametrize(("name", "zero"), [("1f1b", 3), ("zb_h1", 1)])
def test_offload_under_a_pipeline(tmp_path, name, zero):
    """Parameters, gradients and optimizer state on disk, dp=2 x pp=2: the
    single-process model's results; nothing left in the folder."""
    layers = 2 * SCHEDULES[name][1]
    make = functools.partial(_make, name, 2, 4)
    shape = {"dp": 2, "pp": 2}
    rules = f"offload+zero{zero}"
    results = run_ranks(_offloaded, str(tmp_path), make, shape, layers, rules, world_size=4)
    _matches([(losses, params) for losses, params, _ in results], layers)
    assert all(left == [] for _, _, left in results)


def _recomputing(*args: Any) -> tuple[list[float], dict, int]:
    """``_ranked``, and how many module calls ran in a recomputation."""
    from shardax.shard._remat import recomputing

    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += recomputing()

    hook = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        losses, params = _ranked(*args)
    finally:
        hook.remove()
    return losses, params, calls[0]


@pytest.mark.parametrize(
    ("name", "shape", "rules"),
    [("1f1b", {"pp": 2}, "remat"), ("zb_h1", {"pp": 2}, "remat"),
     ("zb_h1", {"dp": 2, "pp": 2}, "remat+zero3"),
     pytest.param("zbv", {"pp": 2}, "remat", marks=pytest.mark.slow),
     pytest.param("dualpipe_v", {"pp": 2}, "remat", marks=pytest.mark.slow)],
)  # fmt: skip
def test_remat_under_every_kind_of_backward(name, shape, rules):
    """``rules.remat`` of the blocks: recomputed in each micro-batch's
    backward — whole (B) or split (I, W: the recomputation defers its
    linears as the forward did) — and the single-process model's results."""
    layers = 2 * SCHEDULES[name][1]
    make = functools.partial(_make, name, 2, 4)
    world = 4 if "dp" in shape else 2
    results = run_ranks(_recomputing, make, shape, layers, rules, world_size=world)
    _matches([(losses, params) for losses, params, _ in results], layers)
    assert all(calls > 0 for _, _, calls in results)


def test_clipping_by_the_whole_pipelines_norm():
    """Clipped hard (every step): the norm is the whole model's, outer
    parameters counted once — as torch.nn.utils.clip_grad_norm_ on it."""
    make = functools.partial(_make, "1f1b", 2, 4)
    results = run_ranks(_ranked, make, {"dp": 2, "pp": 2}, 2, "zero2", 0.05, world_size=4)
    _matches(results, 2, 0.05)


def _eval_loss() -> float:
    mesh = sx.Mesh({"pp": 2})
    torch.manual_seed(0)
    model = example_gpt(n_layers=2)
    schedule, stages = pipeline.one_f_one_b(2, 4), pipeline.split(model, 2)
    params = stages.local(sx.params_of(model), schedule, mesh.axis_index("pp"))
    x, y = _batches()[0]
    return pipeline.value(model, _ce, schedule, stages, mesh=mesh)(params, x, y).item()


def test_value_is_the_loss_of_the_forwards():
    assert run_ranks(_eval_loss) == [pytest.approx(_reference(2)[0][0], abs=1e-6)] * 2


def _v_gpipe(m: int = 4) -> Schedule:
    """A hand-written V: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2
    (stage 1 → 2 is handed over on rank 1 itself)."""

    def f(s):
        return [Action("F", s, i) for i in range(m)]

    def b(s):
        return [Action("B", s, i) for i in range(m)]

    return Schedule([f(0) + f(3) + b(3) + b(0), f(1) + f(2) + b(2) + b(1)], 4, m, (0, 1, 1, 0))


def test_a_hand_written_schedule_runs():
    _matches(run_ranks(_ranked, _v_gpipe, {"pp": 2}, 4, None), 4)


def test_split_backward_defers_exactly_the_linear_weight_gradients():
    torch.manual_seed(0)
    lin, norm = torch.nn.Linear(4, 3), torch.nn.LayerNorm(4)
    x = torch.randn(2, 5, 4, requires_grad=True)
    want = torch.autograd.grad(lin(norm(x)).square().sum(), [x, lin.weight, lin.bias, norm.weight])
    store = WeightGrads()
    with deferring(store):
        y = lin(norm(x)).square().sum()
    y.backward()  # I: the input's and the norm's gradients, not the linear's
    assert lin.weight.grad is None and lin.bias.grad is None
    torch.testing.assert_close(x.grad, want[0])
    torch.testing.assert_close(norm.weight.grad, want[3])
    store.run()  # W
    torch.testing.assert_close(lin.weight.grad, want[1])
    torch.testing.assert_close(lin.bias.grad, want[2])
    assert store.pending == []


def _bad(case: str) -> str:
    mesh = sx.Mesh({"pp": 2})
    model = example_gpt(n_layers=2)
    schedule = pipeline.one_f_one_b(2, 4)
    stages = pipeline.split(model, 2)
    params = stages.local(sx.params_of(model), schedule, mesh.axis_index("pp"))
    x = torch.zeros(8, 8, dtype=torch.long)
    try:
        if case == "batch":
            pipeline.value_and_grad(model, _ce, schedule, stages, mesh=mesh)(params, x[:6], x[:6])
        elif case == "params":
            step = pipeline.value_and_grad(model, _ce, schedule, stages, mesh=mesh)
            step(sx.params_of(model), x, x)
        elif case == "stages":
            pipeline.value_and_grad(
                model, _ce, pipeline.gpipe(2, 4), pipeline.split(model, 1), mesh=mesh
            )
        elif case == "ranks":
            pipeline.value_and_grad(
                model, _ce, pipeline.gpipe(1, 4), pipeline.split(model, 1), mesh=mesh
            )
    except ScheduleError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    ("case", "match"),
    [
        (
            "batch",
            r"inputs of shape \(6, 8\): its batch dim 0 must split into the schedule's 4 micro",
        ),
        ("params", r"rank \d of 'pp' holds its stages' parameters .*not its stages': \['blocks"),
        ("stages", r"split into 1 stages but the schedule runs 2"),
        ("ranks", r"the schedule runs on 1 ranks; Mesh\(\{'pp': 2\}\) has 2 along 'pp'"),
    ],
)
def test_bad_input_is_a_schedule_error_on_every_rank(case, match):
    for message in run_ranks(_bad, case):
        assert __import__("re").search(match, message), message


def _middle_without_rules() -> str:
    mesh = sx.Mesh({"pp": 3, "tp": 1})  # tp of 1: the module rules are the same
    model = example_gpt(n_layers=3)
    schedule = pipeline.one_f_one_b(3, 3)
    stages = pipeline.split(model, 3)
    full = sx.shard(sx.params_of(model), mesh.submesh("tp"), sx.rules.megatron("tp"))
    params = stages.local(full, schedule, mesh.axis_index("pp"))
    step = pipeline.value_and_grad(model, _ce, schedule, stages, mesh=mesh)  # no rules=
    x = torch.zeros(3, 8, dtype=torch.long)
    try:
        step(params, x, x)
    except ScheduleError as err:
        return str(err)
    return "no error"


def test_a_middle_stage_under_tensor_parallelism_needs_the_rules_on_every_rank():
    """pp=3 with Megatron rules (over a tp axis of 1: the same module rules):
    the rank of the middle stage runs the vocabulary-parallel
    embedding on a stand-in whose shape only the rules give; without
    ``rules=`` every rank stops with the same error before any send."""
    for message in run_ranks(_middle_without_rules, world_size=3):
        assert "rank(s) [1] of 'pp' run only middle stages" in message, message
        assert "pipeline.value_and_grad(..., rules=rules)" in message


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h) + bias)


class _BiasNet(torch.nn.Module):
    """A learned bias computed outside the blocks and passed to each."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.bias = torch.nn.Parameter(torch.randn(4))
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias, h = self.bias * 2, self.inp(x)
        for block in self.blocks:
            h = block(h, bias)
        return h


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _bias_net(shared: list[str]) -> Any:
    mesh = sx.Mesh({"pp": 2})
    torch.manual_seed(0)
    model = _BiasNet()
    schedule = pipeline.zbv(2, 4)  # rank 1 runs stages 1 and 2: only middle stages
    stages = pipeline.split(model, schedule, shared=shared)
    params = stages.local(sx.params_of(model), schedule, mesh.axis_index("pp"))
    step = pipeline.value_and_grad(model, _mse, schedule, stages, mesh=mesh)
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(8, 4)
    try:
        loss, grads = step(params, x, y)
    except ScheduleError as err:
        return str(err)
    _mse(model(x), y).backward()
    for k, g in grads.items():
        torch.testing.assert_close(g, model.get_parameter(k).grad, msg=k)
    torch.testing.assert_close(loss, _mse(model(x), y).detach())
    return sorted(grads)


def test_a_value_the_blocks_take_from_an_outer_parameter_must_be_shared():
    """A bias computed outside the blocks reaches every block as an
    argument: a rank of middle stages would compute it from a stand-in.
    The first step finds it and stops every rank naming it; named in
    ``shared=``, every stage holds it and the gradients are the model's."""
    for message in run_ranks(_bias_net, []):
        assert "rank(s) [1] of 'pp' run blocks that take" in message, message
        assert "pipeline.split(..., shared=['bias'])" in message
    held = run_ranks(_bias_net, ["bias"])
    assert "bias" in held[0] and "bias" in held[1] and "inp.weight" not in held[1]


def _lost_peer() -> str:
    mesh = sx.Mesh({"pp": 2}, timeout=3.0)
    model = example_gpt(n_layers=2)
    schedule = pipeline.one_f_one_b(2, 2)
    stages = pipeline.split(model, 2)
    params = stages.local(sx.params_of(model), schedule, mesh.axis_index("pp"))
    step = pipeline.value_and_grad(model, _ce, schedule, stages, mesh=mesh)
    x = torch.zeros(2, 8, dtype=torch.long)
    step(params, x, x)  # the first step, with its checks, on both ranks
    if mesh.axis_index("pp") == 1:
        return "left"  # the last stage never runs its second step
    try:
        step(params, x, x)
    except sx.CollectiveError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_a_lost_stage_is_a_timeout_naming_the_peer():
    first, _ = run_ranks(_lost_peer, reset=True)
    assert first.startswith("CollectiveTimeoutError: recv from member 1 (rank 1) over axis 'pp'"), (
        first
    )


def _disagree() -> str:
    mesh = sx.Mesh({"pp": 2})
    model = example_gpt(n_layers=4)
    counts = [(1, 3), (2, 2)][mesh.axis_index("pp")]  # e.g. balanced by time on each rank
    try:
        pipeline.value_and_grad(
            model, _ce, pipeline.gpipe(2, 2), pipeline.split(model, 2, balance=counts), mesh=mesh
        )
    except ScheduleError as err:
        return str(err)
    return "no error"


def test_ranks_that_split_the_model_differently_are_stopped_before_any_step():
    first, second = run_ranks(_disagree)
    assert "ranks [1] along 'pp' run another split or schedule" in first, first
    assert "ranks [0] along 'pp' run another split or schedule" in second, second
