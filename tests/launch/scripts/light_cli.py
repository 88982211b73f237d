"""Run ``shardax launch`` without running the ``shardax`` package's
``__init__`` (which imports torch, seconds per start): the launcher needs no
torch, so the tests start it this way, except a few that go through
``shardax.cli``. With ``--check-no-torch`` it only reports whether importing
the launcher pulled in torch.
"""

import importlib.util
import sys
import types

spec = importlib.util.find_spec("shardax")  # finds the package without importing it
package = types.ModuleType("shardax")
package.__path__ = list(spec.submodule_search_locations)
sys.modules["shardax"] = package

from shardax.launch._cli import launch_command  # noqa: E402

if sys.argv[1:] == ["--check-no-torch"]:
    print("torch" in sys.modules)
else:
    launch_command(prog_name="shardax launch")
