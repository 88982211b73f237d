"""Memory: ZeRO-3 with activations rematerialised and the optimizer state on
disk, against DeepSpeed ZeRO-3 with its optimizer state and parameters
offloaded — peak RSS per rank and tokens/s, side by side.

The same GPT (``examples/gpt.py``, the ``wide`` preset by default: 134M
parameters), data, seed and AdamW as ``benchmarks/train.py``, whose runner
this is (fresh ranks per run, modes interleaved across repeats, one JSON
line per run and a summary with ratios), over these modes:

- ``shardax3``: ZeRO-3, everything in memory — the run the others save on;
- ``shardax3-remat``: + ``rules.remat(r"blocks\\.\\d+")`` (save nothing);
- ``shardax3-offload``: + ``rules.offload("opt_state", "disk", path=...)``:
  Adam's moments in files, streamed through each step in waves;
- ``shardax3-remat-offload``: both;
- ``shardax3-remat-offload-params``: and the parameters' shards on disk too
  (``rules.offload(("params", "opt_state"), ...)``), each block's read as
  its gather has read it;
- ``shardax3-offload-all``: parameters, gradients (each written to its
  file as its reduction lands) and state on disk;
- ``deepspeed3``: DeepSpeed ZeRO-3 on its CPU accelerator;
- ``deepspeed3-offload-cpu``: + ``offload_optimizer`` and ``offload_param``
  to ``cpu`` (on a machine without a GPU, the same memory);
- ``deepspeed3-offload-nvme``: the same to ``nvme`` — recorded as skipped,
  with the reason, where DeepSpeed's ``async_io`` op cannot build (it needs
  the system libaio, which pip cannot install).

The files go in ``$SHARDAX_BENCH_OFFLOAD_DIR`` (default: the temporary
folder); put it on a disk, not on tmpfs (whose files are memory). The
summary's ``peak_rss_vs_shardax3`` and ``tokens_per_s_vs_shardax3`` are the
goals' ratios; ``..._vs_deepspeed3`` the anchor's.

    python benchmarks/memory.py --repeats 2 --json memory.json
    python benchmarks/memory.py --smoke        # tiny GPT, shardax modes, seconds
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train

MODES = [
    "deepspeed3",
    "deepspeed3-offload-cpu",
    "deepspeed3-offload-nvme",
    "shardax3",
    "shardax3-remat",
    "shardax3-offload",
    "shardax3-remat-offload",
    "shardax3-remat-offload-params",
    "shardax3-offload-all",
]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--modes" not in argv:
        smoke = "--smoke" in argv
        argv += ["--modes", ",".join(m for m in MODES if not (smoke and m.startswith("deepspeed")))]
    if "--preset" not in argv:
        argv += ["--preset", "wide"]  # --smoke makes it tiny
    return train.main(argv, benchmark="memory")


if __name__ == "__main__":
    sys.exit(main())
