"""Hello, sharding: one tensor through several layouts on a mesh of ranks.

Run it on two CPU processes (any number works, one too)::

    shardax launch --nproc-per-node 2 examples/hello_sharding.py

Every rank builds the same dense tensors from the same seed, shards them,
moves them through layouts with ``transfer`` — printing the collectives each
move takes — and checks every result, and the gradients, against the dense
tensor. Rank 0 also prints ``explain`` for a small parameter tree, and plans
a 7B-parameter model on a 64-rank mesh it does not have.
"""

from __future__ import annotations

import torch

import shardax as sx
from shardax import Layout, P, Rule


def say(mesh: sx.Mesh, *lines: object) -> None:
    if mesh.rank == 0:
        print(*lines, sep="\n", flush=True)


def main() -> None:
    info = sx.init()
    mesh = sx.Mesh({"dp": -1})
    say(
        mesh,
        f"{mesh} on {info.world_size} rank(s), backend {info.backend or 'none (world size 1)'}",
    )

    torch.manual_seed(0)
    dense = torch.randn(10, 6)  # 10 rows: uneven over 3, 4, ... ranks, and that is fine

    # 1. shard: every rank keeps its own rows
    x = sx.shard(dense, mesh, P("dp", None))
    print(
        f"rank {mesh.rank} holds rows {x.bounds()[0]} of {x.shape}: local shape {x.local_shape}",
        flush=True,
    )

    # 2. move it through layouts; each move is one plan of collectives
    partial = Layout(mesh, P(), partial="dp")
    for target in [P(None, "dp"), P(), partial, P("dp", None)]:
        layout = target if isinstance(target, Layout) else Layout(mesh, target)
        say(mesh, str(sx.plan_transfer(x.layout, layout, x.shape)))
        x = sx.transfer(x, layout)
        torch.testing.assert_close(sx.gather(x), dense)  # gather sums partial values
    say(mesh, "every layout holds the dense tensor")

    # 3. gradients flow back through the transposed transfers, never scaled
    w = sx.shard(dense, mesh, P("dp", None))
    w.local.requires_grad_()
    full = sx.transfer(w, P())  # all_gather; its backward is psum_scatter
    loss = (full.local**2).sum()  # the same number on every rank...
    sx.collectives.count_once(loss, "dp", mesh=mesh).backward()  # ...so count it once
    expected = sx.shard(2 * dense, mesh, P("dp", None)).local
    torch.testing.assert_close(w.local.grad, expected)
    say(mesh, "gradients match the dense reference")

    # 4. rules map parameter paths to specs; explain prints the plan
    params = {
        "embed": torch.randn(64, 16),
        "blocks": [
            {"attn": torch.randn(48, 16), "mlp": torch.randn(64, 16), "norm": torch.ones(16)}
        ],
    }
    rules = Rule(r"embed|blocks\.\d+\.(attn|mlp)", P("dp", None))
    say(mesh, str(sx.explain(params, mesh, rules)))
    sharded = sx.shard(params, mesh, rules)
    torch.testing.assert_close(sx.gather(sharded), params)

    # 5. plan a model you cannot hold: meta tensors on an abstract mesh
    big = {
        f"layers.{i}.{name}": torch.empty(shape, device="meta")
        for i in range(32)
        for name, shape in [
            ("qkv", (12288, 4096)),
            ("out", (4096, 4096)),
            ("up", (11008, 4096)),
            ("down", (4096, 11008)),
        ]
    }
    plan = sx.explain(
        big,
        sx.AbstractMesh({"dp": 8, "tp": 8}),
        Rule(r".*\.(qkv|up)", P("tp", "dp")) + Rule(r".*\.(out|down)", P("dp", "tp")),
    )
    say(mesh, str(plan).splitlines()[0], str(plan).splitlines()[-1])

    print(f"rank {mesh.rank}: ok", flush=True)
    sx.shutdown()


if __name__ == "__main__":
    main()
