"""Parameters in: ``params_of`` (a module's tensors as a dict pytree) and
``init_params`` (a ``meta``-device module initialised straight into its
shards, never whole on one rank)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ShardingError
from ..mesh._mesh import Mesh
from ._api import _shard_one, as_rules, layouts_for
from ._sharded import Sharded

__all__ = ["init_params", "params_of"]


def params_of(model: nn.Module, *, buffers: bool = True) -> dict[str, torch.Tensor]:
    """The parameters (and buffers) of ``model`` as a dict keyed by path
    (``"blocks.0.attn.qkv.weight"``), detached. A tied parameter appears once,
    under its first path.

    >>> import torch, shardax as sx
    >>> sorted(sx.params_of(torch.nn.Linear(3, 2)))
    ['bias', 'weight']
    """
    if not isinstance(model, nn.Module):
        raise ShardingError(f"params_of needs an nn.Module; got {type(model).__name__}")
    out = {name: p.detach() for name, p in model.named_parameters()}
    if buffers:
        out.update((name, b.detach()) for name, b in model.named_buffers())
    return out


def _own(module: nn.Module) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    return [
        (table, name, t)
        for table in (module._parameters, module._buffers)
        for name, t in table.items()
        if t is not None
    ]


def init_params(
    model: nn.Module,
    mesh: Mesh,
    specs: Any,
    *,
    init_fn: Any = None,
    device: torch.device | str = "cpu",
) -> dict[str, Sharded]:
    """Initialise the parameters of ``model`` (built on the ``meta`` device)
    directly into their shards: the values equal
    ``shard(params_of(model_built_densely), mesh, specs)`` under the same
    ``torch.manual_seed``, but no rank ever holds more than its shards plus
    one module's own parameters.

    Each module's ``reset_parameters()`` runs in module order on a dense
    copy of just that module's own tensors, which repeats the random draws
    of the dense constructor (for models that create submodules in the
    order they register them, as ordinary PyTorch code does); a tied
    parameter keeps the values of its first owner, as a tie made after
    construction does. ``init_fn(module)``, if given, then runs on every
    module in ``model.apply`` order (children first), as a custom
    ``model.apply(init_fn)`` after construction would.

    Args:
        model: a module, usually built under ``torch.device("meta")``; it is
            not modified.
        mesh: the live mesh.
        specs: rules (e.g. ``rules.zero(3)``) or specs, as for :func:`shardax.shard`.
        init_fn: an optional per-module initialiser run after construction.
        device: where the shards live.

    >>> import torch, shardax as sx
    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(4, 2)
    >>> _ = torch.manual_seed(0)
    >>> params = sx.init_params(model, sx.Mesh({"dp": 1}), sx.rules.zero(3))
    >>> _ = torch.manual_seed(0)
    >>> torch.equal(sx.gather(params)["weight"], torch.nn.Linear(4, 2).weight.detach())
    True
    """
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"init_params needs a live Mesh; got {mesh!r}")
    meta = params_of(model)
    paths, _, _, layouts = layouts_for(meta, mesh, specs)
    layout_of = dict(zip(paths, layouts, strict=True))
    rules = as_rules(specs)
    canonical = {id(t): name for name, t in _named_tensors(model)}
    out: dict[str, Sharded] = {}

    def keep(path: str, value: torch.Tensor) -> None:
        layout = layout_of[path]
        x = _shard_one(value, mesh, layout, None)
        placement = rules.placement(path, x.shape, mesh) if rules is not None else None
        out[path] = Sharded(x.local, x.layout, x.shape, placement=placement)

    with torch.no_grad():
        for mpath, module in model.named_modules():
            own = _own(module)
            if not own:
                continue
            dense = {name: _materialize(t, device) for _, name, t in own}
            _run_on(module, dense, lambda m: m.reset_parameters(), "reset_parameters")
            for _, name, t in own:
                path = canonical[id(t)]
                if path in out:
                    continue  # tied: its first owner's values stand
                if t.device.type == "meta" and not _has(module, "reset_parameters"):
                    raise ShardingError(
                        f"init_params: {path!r} is on the meta device and its module "
                        f"{type(module).__name__} ({mpath or '<root>'}) has no reset_parameters() "
                        "to give it values; pass init_fn=... that sets it, or create it on a real "
                        "device"
                    )
                keep(path, dense[name])
        if init_fn is not None:
            for module in _post_order(model):
                own = _own(module)
                names = {name: canonical[id(t)] for _, name, t in own}
                if not own:
                    _run_on(module, {}, init_fn, None)
                    continue
                dense = {
                    name: _gathered(out[path]).to(device).clone() for name, path in names.items()
                }
                _run_on(module, dense, init_fn, None)
                for name, path in names.items():
                    keep(path, dense[name])
    return dict(sorted(out.items()))


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters()) + list(model.named_buffers())


def _has(module: nn.Module, method: str) -> bool:
    return callable(getattr(module, method, None))


def _materialize(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    if t.device.type == "meta":
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    return t.detach().to(device).clone()


def _gathered(x: Sharded) -> torch.Tensor:
    from ._api import gather

    return gather(x)


def _run_on(module: nn.Module, dense: dict[str, torch.Tensor], fn: Any, method: str | None) -> None:
    """Run ``fn(module)`` with the module's own tensors swapped for ``dense``
    (as parameters where they were parameters), then swap them back."""
    if method is not None and not _has(module, method):
        return
    saved = []
    for table, name, t in _own(module):
        saved.append((table, name, t))
        value = dense[name]
        table[name] = (
            nn.Parameter(value, requires_grad=t.requires_grad)
            if isinstance(t, nn.Parameter)
            else value
        )
    try:
        fn(module)
        for table, name, _ in saved:
            dense[name] = table[name].detach()
    finally:
        for table, name, t in saved:
            table[name] = t


def _post_order(model: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            visit(child)
        out.append(m)

    visit(model)
    return out
