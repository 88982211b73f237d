"""Checkpoints of a pipelined model hold the model's own key paths and
global shapes: saved from dp=2 × pp=2 under ZeRO-3 (each rank its stages'
shards, the embeddings on the first and the last stage), they load on
pp=4, on pp=1 and into the plain model, equal to what was saved."""

from __future__ import annotations

import torch
from _dist import run_ranks
from _tiny import example_gpt

import shardax as sx
from shardax import pipeline


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return example_gpt(n_layers=4)


def _save(path: str) -> None:
    mesh = sx.Mesh({"dp": 2, "pp": 2})
    model = _model()
    schedule = pipeline.one_f_one_b(2, 4)
    stages = pipeline.split(model, 2)
    full = sx.shard(sx.params_of(model), mesh.submesh("dp"), sx.rules.zero(3))
    params = stages.local(full, schedule, mesh.axis_index("pp"))
    sx.ckpt.save(path, {"params": params, "step": 7})


def _load_on_pp4(path: str) -> dict[str, torch.Tensor]:
    mesh = sx.Mesh({"pp": 4})
    model = _model()
    schedule = pipeline.gpipe(4, 4)
    stages = pipeline.split(model, 4)
    target = stages.local(
        {k: torch.zeros_like(v) for k, v in sx.params_of(model).items()},
        schedule,
        mesh.axis_index("pp"),
    )
    loaded = sx.ckpt.load(path, {"params": target, "step": 0}, strict="target")
    assert loaded["step"] == 7
    return loaded["params"]


def _load_on_dp4(path: str) -> dict[str, torch.Tensor]:
    mesh = sx.Mesh({"dp": 4})
    model = _model()
    target = sx.shard(sx.params_of(model), mesh, sx.rules.zero(1))  # shapes and layouts
    loaded = sx.ckpt.load(path, {"params": target, "step": 0})
    return {k: sx.gather(v) for k, v in loaded["params"].items()}


def test_a_pipeline_checkpoint_loads_on_any_pipeline(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save, path, world_size=4)
    want = sx.params_of(_model())
    index = sx.ckpt.read_index(path)
    assert {p.removeprefix("params.") for p in index.leaves if p != "step"} == set(want)
    assert all(index.leaves[f"params.{k}"].shape == tuple(v.shape) for k, v in want.items())
    held: set[str] = set()
    for part in run_ranks(_load_on_pp4, path, world_size=4):
        for k, v in part.items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
        held |= set(part)
    assert held == set(want)
    for whole in run_ranks(_load_on_dp4, path, world_size=4):
        for k, v in whole.items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
    plain = example_gpt(n_layers=4)  # and into the plain model, with its own names
    target = {"params": {k: torch.empty_like(v) for k, v in want.items()}, "step": 0}
    state = sx.ckpt.load(path, target)["params"]
    plain.load_state_dict({**state, "lm_head.weight": state["wte.weight"]})  # the tied head
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(v, want.get(k, want["wte.weight"]), rtol=0, atol=0, msg=k)


def test_a_key_path_saved_with_two_shapes_is_refused(tmp_path):
    errors = run_ranks(_clash, str(tmp_path / "c"))
    assert all(
        "'w' is saved by rank 0 as float32 (2,) and by rank 1 as float32 (3,)" in e for e in errors
    )


def _clash(path: str) -> str:
    sx.Mesh({"pp": 2})
    rank = torch.distributed.get_rank()
    try:
        sx.ckpt.save(path, {"w": torch.zeros(2 + rank)})
    except sx.CheckpointError as err:
        return str(err)
    return "no error"
