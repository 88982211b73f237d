"""Every backend implements the whole :class:`Backend` protocol — each
method, with its parameters — rather than being probed with ``getattr``
(``attach``, the setup of a new process group, included)."""

from __future__ import annotations

import inspect

import pytest

from shardax.collectives import Backend
from shardax.collectives._cupy_backend import CupyBackend
from shardax.collectives._shm_backend import ShmBackend
from shardax.collectives._torch_backend import TorchBackend

METHODS = {
    name: inspect.signature(fn)
    for name, fn in vars(Backend).items()
    if inspect.isfunction(fn) and not name.startswith("_")
}


def test_the_protocol_has_the_setup_and_the_calls():
    assert {"attach", "describe", "agreed", "all_reduce", "send_recv", "barrier"} <= set(METHODS)
    assert "name" in Backend.__annotations__


@pytest.mark.parametrize("cls", [TorchBackend, ShmBackend, CupyBackend], ids=lambda c: c.__name__)
def test_every_backend_implements_the_protocol(cls):
    assert isinstance(cls.name, str)
    for name, want in METHODS.items():
        method = getattr(cls, name, None)
        assert method is not None, f"{cls.__name__} lacks {name}{want}"
        got = inspect.signature(method)
        assert list(got.parameters) == list(want.parameters), (cls.__name__, name, got, want)
