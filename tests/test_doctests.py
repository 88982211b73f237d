"""Every docstring example in the package runs (at world size 1), and every
public function shows one."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import pytest

import shardax

MODULES = sorted(
    {"shardax", *(m.name for m in pkgutil.walk_packages(shardax.__path__, "shardax."))}
)
PUBLIC = [
    "shardax",
    "shardax.mesh",
    "shardax.shard",
    "shardax.collectives",
    "shardax.rules",
    "shardax.launch",
    "shardax.ckpt",
    "shardax.data",
    "shardax.optim",
    "shardax.pipeline",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=True
    )
    assert result.failed == 0, f"{result.failed} doctest failures in {name}"


@pytest.mark.parametrize("name", PUBLIC)
def test_public_functions_have_examples(name):
    module = importlib.import_module(name)
    missing = []
    for attr in module.__all__:
        obj = getattr(module, attr)
        if inspect.ismodule(obj):
            continue
        doc = inspect.getdoc(obj) or ""
        if not doc:
            missing.append(f"{attr}: no docstring")
        elif inspect.isfunction(obj) and ">>>" not in doc:
            missing.append(f"{attr}: no >>> example")
    assert not missing, missing
