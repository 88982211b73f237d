"""Checkpoints: shardax.ckpt against torch.distributed.checkpoint (DCP), side by side.

Each rank builds the bench GPT's (``examples/gpt.py``) parameters and AdamW
state sharded ZeRO-3 over ``dp``, exactly as ``shardax3`` in
``benchmarks/train.py`` does (``sx.rules.zero(3)``, ``sx.init_params`` from a
``meta`` model, ``sx.optim.adamw``), and takes one optimizer step so the
moments are not zero. The same local shards are then wrapped, without a
copy, as DTensors (``DTensor.from_local`` on a 1-D CPU ``DeviceMesh``,
``Shard(0)``: what FSDP2's state dict holds) for DCP. Per repeat, three ops
run for both libraries:

- ``save``: ``sx.ckpt.save(path, {"params": ..., "opt_state": ...})`` against
  ``dcp.save(state, checkpoint_id=path)``;
- ``load``: ``sx.ckpt.load(path, target)`` into the same layout against
  ``dcp.load`` into pre-allocated DTensors (filled with NaN first);
- ``save_async``: ``sx.ckpt.save_async`` against ``dcp.async_save`` (its
  default thread mode); ``return_s`` is the time until the call returns
  (what a training step waits for), ``time_s`` until the checkpoint is
  committed.

Every op is timed between two barriers as the slowest rank's wall time, with
each rank's peak RSS during the op (``/proc/self/clear_refs`` resets the
high-water mark before it) and its rise over the RSS before the op. GB/s is the state's logical bytes (every global
tensor once: params, both moments and the step count) over the time; bytes
on disk are counted separately. Every load is checked bit for bit against
the saved state on every rank (``roundtrip_ok``); each async checkpoint is
loaded back, untimed, and checked too; the sync save's row carries its
load's check.

Offline, on the checkpoints of the first ``--nproc`` job (fresh processes
per op, interleaved and repeated; peak RSS is the rise of the process's
high-water mark over its RSS before the op): ``reshard`` (``shardax ckpt
reshard`` to twice the ranks), ``consolidate`` (``shardax ckpt consolidate``
of the whole state) against DCP's ``dcp_to_torch_save`` of the same state,
and ``consolidate_params`` (``--only params``). The two consolidated files
are checked to hold the same tensors (``offline_ok``).

Loads are warm-cache reads: they read files the same job wrote moments
before, and the page cache cannot be dropped without root. Both libraries
see the same conditions: per repeat the ops run save, save, load, load,
save_async, save_async, and the library that goes first alternates.
Every save goes to a fresh directory (removed, untimed, at the end of the
repeat) under ``--dir`` (default: the system temp dir).

One JSON line per (lib, op, nproc, repeat), then a summary line with medians
and ``ratio`` = DCP time / shardax time (above 1, shardax is faster); a
readable table on stderr.

    python benchmarks/ckpt.py --preset bench --nproc 2,4 --repeats 3 --json ckpt.json
    python benchmarks/ckpt.py --smoke        # tiny model, 2 ranks, 1 repeat: seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from _data import model_facts  # noqa: E402  (beside this file)
from gpt import GPT, PRESETS, GPTConfig, param_count  # noqa: E402

import shardax as sx  # noqa: E402
from shardax.launch import launch  # noqa: E402

LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1
LIBS = ["shardax", "dcp"]
OPS = ["save", "load", "save_async"]
OFFLINE_OPS = [("shardax", "reshard"), ("shardax", "consolidate"), ("dcp", "consolidate")]
OFFLINE_OPS += [("shardax", "consolidate_params")]
TIMEOUT_S = 300.0
CACHE_NOTE = (
    "warm: loads read files written moments before (the page cache cannot be dropped "
    "without root); both libraries see the same conditions, the one going first alternates"
)

Pending = Callable[[], None]
"""What an async op returns: wait until its checkpoint is committed."""


# ---------------------------------------------------------------- the state, on every rank


def build_state(cfg: GPTConfig, seed: int, micro_batch: int) -> dict[str, Any]:
    """shardax3's params and AdamW state after one step on random tokens."""
    mesh = sx.Mesh({"dp": -1})
    with torch.device("meta"):
        model = GPT(cfg)
    torch.manual_seed(seed)
    params = sx.init_params(model, mesh, sx.rules.zero(3, axis="dp"))
    opt = sx.optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
    opt_state = opt.init(params)
    g = torch.Generator().manual_seed(seed * 1_000_003 + mesh.rank)
    tokens = torch.randint(cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=g)

    def loss_fn(params, batch):
        logits = sx.apply(model, params, batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    _, grads = sx.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = sx.optim.apply_updates(params, updates)
    return {"params": params, "opt_state": opt_state}


def leaves(tree: Any) -> list[tuple[str, Any]]:
    """``(key path, leaf)`` pairs with ``Sharded`` values as leaves, in tree order."""
    paths, values, _ = optree.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, sx.Sharded), none_is_leaf=True
    )
    return [(".".join(map(str, p)), v) for p, v in zip(paths, values, strict=True)]


def local(x: Any) -> torch.Tensor:
    """This rank's tensor of a ``Sharded`` value, a DTensor or a plain tensor."""
    if isinstance(x, sx.Sharded):
        return x.local
    return x.to_local() if hasattr(x, "to_local") else x


def _torch_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``Shard(0)`` gives ``rank`` (torch's ``chunk``: ceil-sized pieces)."""
    size = -(-n // world)
    return min(rank * size, n), min((rank + 1) * size, n)


def to_dcp(tree: Any, device_mesh: Any, *, empty: bool) -> dict[str, Any]:
    """The state as DCP's flat state dict: each ``Sharded`` leaf as a DTensor
    around the same local tensor (a fresh one when ``empty``), plain tensors
    as they are (DCP takes them as replicated and writes rank 0's)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for path, x in leaves(tree):
        if not isinstance(x, (sx.Sharded, torch.Tensor)):
            raise ValueError(f"{path!r}: {type(x).__name__} leaves are not benchmarked")
        t = torch.empty_like(local(x)) if empty else local(x)
        if not isinstance(x, sx.Sharded):
            out[path] = t
            continue
        if x.spec == sx.P():
            placement = Replicate()
        elif tuple(x.spec) == ("dp",) and x.layout.local_bounds(x.shape, rank)[0] == _torch_rows(
            x.shape[0], world, rank
        ):
            placement = Shard(0)
        else:
            raise ValueError(
                f"{path!r}: {x.layout!r} with local bounds {x.layout.local_bounds(x.shape, rank)} "
                "has no DTensor equivalent here (only P() and P('dp') split like torch.chunk)"
            )
        stride = torch.empty(x.shape, device="meta").stride()
        out[path] = DTensor.from_local(
            t, device_mesh, [placement], run_check=False, shape=torch.Size(x.shape), stride=stride
        )
    return out


def state_bytes(tree: Any) -> int:
    """Every global tensor once: the logical size of a checkpoint."""
    total = 0
    for _, x in leaves(tree):
        if isinstance(x, (sx.Sharded, torch.Tensor)):
            numel = 1
            for d in x.shape:
                numel *= d
            total += numel * x.dtype.itemsize
    return total


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def digest(tree: Any) -> str:
    """CRC-32 over this rank's local bytes of every leaf, in tree order."""
    crc = 0
    for _, x in leaves(tree):
        if isinstance(x, (sx.Sharded, torch.Tensor)) or hasattr(x, "to_local"):
            crc = zlib.crc32(_bits(local(x)).numpy(), crc)
    return f"{crc:08x}"


def same_bits(saved: Any, loaded: Any) -> bool:
    """Whether ``loaded`` holds bit for bit this rank's pieces of ``saved``
    (same key paths, dtypes and shapes)."""
    a, b = leaves(saved), leaves(loaded)
    if [p for p, _ in a] != [p for p, _ in b]:
        return False
    for (_, x), (_, y) in zip(a, b, strict=True):
        if not isinstance(x, (sx.Sharded, torch.Tensor)):
            if x != y:
                return False
            continue
        s, t = local(x), local(y)
        if s.dtype != t.dtype or s.shape != t.shape or not torch.equal(_bits(s), _bits(t)):
            return False
    return True


def _all_ok(ok: bool) -> bool:
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# ---------------------------------------------------------------- measuring one op


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def measure(op: Callable[[], Pending | None]) -> dict[str, list[float]]:
    """Run ``op`` on every rank between two barriers; per rank: seconds to
    return, seconds to finish (an async op's wait included), RSS before and
    peak RSS during it (MiB)."""
    dist.barrier()
    sx.monitor.reset_peak_memory()
    before = _status_kib("VmRSS") / 1024
    start = time.perf_counter()
    pending = op()
    returned = time.perf_counter() - start
    if pending is not None:
        pending()
    dist.barrier()
    total = time.perf_counter() - start
    mine = torch.tensor([returned, total, before, _status_kib("VmHWM") / 1024], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    by_rank = torch.stack(every).T.tolist()
    return dict(zip(["return_s", "time_s", "rss_before_mib", "peak_rss_mib"], by_rank, strict=True))


def disk_usage(path: Path) -> tuple[int, int]:
    """``(bytes, files)`` under ``path``."""
    sizes = [p.stat().st_size for p in path.rglob("*") if p.is_file()]
    return sum(sizes), len(sizes)


# ---------------------------------------------------------------- the two libraries


class Shardax:
    """shardax.ckpt on the tree as it is."""

    name = "shardax"

    def __init__(self, tree: Any) -> None:
        self.tree = tree

    def save(self, path: Path) -> None:
        sx.ckpt.save(path, self.tree)

    def save_async(self, path: Path) -> Pending:
        return sx.ckpt.save_async(path, self.tree).wait

    def load(self, path: Path) -> Any:
        return sx.ckpt.load(path, self.tree)


class DCP:
    """torch.distributed.checkpoint on the same local shards as DTensors."""

    name = "dcp"

    def __init__(self, tree: Any) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        self.state = to_dcp(tree, mesh, empty=False)
        self.target = to_dcp(tree, mesh, empty=True)  # pre-allocated, as a training job has
        self.prepare_load()  # touched now, so the RSS baseline does not move at the first load

    def save(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state, checkpoint_id=str(path))

    def save_async(self, path: Path) -> Pending:
        import torch.distributed.checkpoint as dcp

        future = dcp.async_save(self.state, checkpoint_id=str(path))
        return lambda: future.result()

    def prepare_load(self) -> None:
        for t in self.target.values():
            local(t).fill_(float("nan") if local(t).is_floating_point() else -1)

    def load(self, path: Path) -> Any:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.target, checkpoint_id=str(path))
        return self.target


def run_op(lib: Shardax | DCP, op: str, path: Path, saved: Any) -> dict[str, Any]:
    """One timed op; its row, checked."""
    row: dict[str, Any] = {}
    if op == "load":
        if isinstance(lib, DCP):
            lib.prepare_load()
        box: list[Any] = []
        row.update(measure(lambda: box.append(lib.load(path))))
        loaded = box[0]
    else:
        row.update(measure(lambda: getattr(lib, op)(path)))
        if dist.get_rank() == 0:
            row["disk_bytes"], row["files"] = disk_usage(path)
        loaded = None
        if op == "save_async":  # check what the background save committed, untimed
            if isinstance(lib, DCP):
                lib.prepare_load()
            loaded = lib.load(path)
    if loaded is not None:
        ok = same_bits(saved, loaded)
        row["roundtrip_ok"] = _all_ok(ok)
        row["loaded_digest"] = _gather_str(digest(loaded))
    return row


def _gather_str(s: str) -> list[str]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, s)
    return out


def worker(args: argparse.Namespace) -> int:
    """Every repeat of every (op, lib) on this job's ranks; rank 0 writes the rows."""
    torch.set_num_threads(args.threads)
    sx.init(timeout=TIMEOUT_S)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config_from(args)
    tree = build_state(cfg, args.seed, args.micro)
    libs = {"shardax": Shardax(tree), "dcp": DCP(tree)}
    total_bytes = state_bytes(tree)
    saved_digest = _gather_str(digest(tree))
    root = Path(args.dir)
    rows: list[dict[str, Any]] = []
    for repeat in range(-args.warmup, args.repeats):
        order = LIBS if repeat % 2 == 0 else LIBS[::-1]
        made = []
        sync_row: dict[str, dict] = {}
        for op in OPS:
            for name in order:
                path = root / f"{name}-{'async' if op == 'save_async' else 'sync'}-{repeat}"
                row = {"lib": name, "op": op, "nproc": world, "repeat": repeat}
                row.update(run_op(libs[name], op, path, tree))
                if op != "load":
                    made.append(path)
                row["state_bytes"] = total_bytes
                if op == "save":
                    sync_row[name] = row
                elif op == "load":  # the sync save's checkpoint is this load's
                    sync_row[name]["roundtrip_ok"] = row["roundtrip_ok"]
                if repeat >= 0:
                    rows.append(row)
        dist.barrier()
        if rank == 0:
            for path in made:
                shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    if args.offline_dir:  # the sources of the offline ops, untimed
        libs["shardax"].save(Path(args.offline_dir) / "shardax")
        libs["dcp"].save(Path(args.offline_dir) / "dcp")
        dist.barrier()
    if rank == 0:
        for row in rows:
            finish_row(row)
        result = {"rows": rows, "saved_digest": saved_digest, "state_bytes": total_bytes}
        result["params_bytes"] = state_bytes(tree["params"])
        Path(args.result).write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


def finish_row(row: dict[str, Any]) -> None:
    """The slowest rank's times, GB/s, the largest peak RSS and RSS increase
    (peak during the op minus RSS before it), beside the per-rank lists."""
    per_rank = {k: row.pop(k) for k in ["return_s", "time_s", "rss_before_mib", "peak_rss_mib"]}
    row["time_s"] = max(per_rank["time_s"])
    if row["op"] == "save_async":
        row["return_s"] = max(per_rank["return_s"])
    row["GBps"] = row["state_bytes"] / row["time_s"] / 1e9
    peaks, befores = per_rank["peak_rss_mib"], per_rank["rss_before_mib"]
    row["peak_rss_mib"] = max(peaks)
    row["peak_rss_mib_per_rank"] = peaks
    row["rss_increase_mib_per_rank"] = [p - b for p, b in zip(peaks, befores, strict=True)]
    row["rss_increase_mib"] = max(row["rss_increase_mib_per_rank"])


# ---------------------------------------------------------------- offline ops


def offline_op(args: argparse.Namespace) -> int:
    """One offline op in this fresh process: print its time and RSS as JSON."""
    torch.set_num_threads(args.threads or 1)
    src, dst = str(args.src), str(args.dst)
    if args.offline_op == "dcp:consolidate":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        def run() -> None:
            dcp_to_torch_save(src, dst)
    else:
        from shardax.cli import main as cli

        cmd = {
            "shardax:reshard": ["reshard", src, dst, "--mesh", f"dp={args.mesh_size}"],
            "shardax:consolidate": ["consolidate", src, dst],
            "shardax:consolidate_params": ["consolidate", src, dst, "--only", "params"],
        }[args.offline_op]
        if args.offline_op == "shardax:reshard":
            specs = Path(src).parent / "reshard-specs.json"
            specs.write_text(json.dumps({".*": ["dp"]}))
            cmd += ["--specs", str(specs)]

        def run() -> None:
            cli(["ckpt", *cmd, "-q"], standalone_mode=False)

    sx.monitor.reset_peak_memory()
    before = _status_kib("VmRSS")
    started = time.perf_counter()
    run()
    elapsed = time.perf_counter() - started
    peak = _status_kib("VmHWM")
    print(json.dumps({"time_s": elapsed, "rss_before_mib": before / 1024, "peak_mib": peak / 1024}))
    return 0


def _tensor_digests(tensors: Any) -> list[tuple]:
    """Sorted ``(shape, dtype, crc)`` of every tensor: what a file holds, by value."""
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            out.append((tuple(t.shape), str(t.dtype), zlib.crc32(_bits(t).numpy())))
    return sorted(out)


def same_consolidated(safetensors_file: Path, torch_file: Path) -> bool:
    """Whether shardax's consolidated file and DCP's hold the same tensors."""
    from safetensors import safe_open

    with safe_open(str(safetensors_file), "pt") as f:
        ours = _tensor_digests(f.get_tensor(k) for k in f.keys())  # noqa: SIM118
    theirs = torch.load(torch_file, weights_only=True, mmap=True)
    return ours == _tensor_digests(optree.tree_leaves(theirs))


def run_offline(
    source: Path, nproc: int, args: argparse.Namespace, state: int, params: int
) -> list[dict[str, Any]]:
    """Every offline op, ``--repeats`` times, interleaved, each in a fresh process."""
    rows = []
    out = source / "out"
    for repeat in range(args.repeats):
        order = OFFLINE_OPS if repeat % 2 == 0 else OFFLINE_OPS[::-1]
        made: dict[str, Path] = {}
        for lib, op in order:
            dst = out / f"{lib}-{op}-{repeat}"
            dst = (
                dst.with_suffix(".pt" if lib == "dcp" else ".safetensors")
                if "consol" in op
                else dst
            )
            argv = [sys.executable, str(Path(__file__).resolve()), "--offline-op", f"{lib}:{op}"]
            argv += ["--src", str(source / lib), "--dst", str(dst), "--mesh-size", str(2 * nproc)]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
            row: dict[str, Any] = {"lib": lib, "op": op, "nproc": nproc, "repeat": repeat}
            row["offline"] = True
            if done.returncode != 0:
                row["error"] = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
                rows.append(row)
                continue
            got = json.loads(done.stdout.strip().splitlines()[-1])
            row["state_bytes"] = params if op == "consolidate_params" else state
            row["time_s"] = got["time_s"]
            row["GBps"] = row["state_bytes"] / got["time_s"] / 1e9
            row["peak_rss_mib"] = got["peak_mib"]
            row["rss_increase_mib"] = got["peak_mib"] - got["rss_before_mib"]
            row["out_bytes"] = disk_usage(dst)[0] if dst.is_dir() else dst.stat().st_size
            made[f"{lib}:{op}"] = dst
            rows.append(row)
        if repeat == args.repeats - 1 and {"shardax:consolidate", "dcp:consolidate"} <= set(made):
            ok = same_consolidated(made["shardax:consolidate"], made["dcp:consolidate"])
            for row in rows:
                row["offline_ok"] = ok
        shutil.rmtree(out, ignore_errors=True)
    return rows


def summarize_offline(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per op: each library's medians; DCP's time over shardax's for consolidate."""
    out = []
    for op in dict.fromkeys(op for _, op in OFFLINE_OPS):
        entry: dict[str, Any] = {"op": op, "offline": True}
        for lib in LIBS:
            ok = [r for r in rows if (r["lib"], r["op"]) == (lib, op) and "error" not in r]
            if not ok:
                continue
            entry["nproc"] = ok[0]["nproc"]
            for key in ("time_s", "GBps", "peak_rss_mib", "rss_increase_mib", "out_bytes"):
                entry[f"{lib}_{key.removesuffix('_s') if key == 'time_s' else key}"] = (
                    statistics.median(r[key] for r in ok)
                )
            entry[f"{lib}_s"] = entry.pop(f"{lib}_time")
            entry[f"{lib}_repeats"] = len(ok)
        if "shardax_s" in entry and "dcp_s" in entry:
            entry["ratio"] = entry["dcp_s"] / entry["shardax_s"]
        out.append(entry)
    return out


def print_offline(summary: list[dict[str, Any]], file=sys.stderr) -> None:
    print(
        f"{'offline op':<20}{'shardax s':>10}{'dcp s':>9}{'ratio':>7}{'sx GB/s':>9}"
        f"{'sx +MiB':>9}{'dcp +MiB':>10}",
        file=file,
    )
    for e in summary:

        def num(key: str, fmt: str, e: dict = e) -> str:
            return format(e[key], fmt) if key in e else "-"

        print(
            f"{e['op']:<20}{num('shardax_s', '.3f'):>10}{num('dcp_s', '.3f'):>9}"
            f"{num('ratio', '.2f'):>7}{num('shardax_GBps', '.2f'):>9}"
            f"{num('shardax_rss_increase_mib', '.0f'):>9}{num('dcp_rss_increase_mib', '.0f'):>10}",
            file=file,
        )
    print("+MiB: the op's peak RSS over the process's RSS before it (a fresh process)", file=file)


# ---------------------------------------------------------------- the driver


def config_from(args: argparse.Namespace) -> GPTConfig:
    return PRESETS[args.preset]


def run_nproc(
    nproc: int, args: argparse.Namespace, tmp: Path, offline: Path | None = None
) -> dict[str, Any]:
    """Launch one job of ``nproc`` ranks running every repeat; its rows.
    With ``offline``, the job leaves one checkpoint of each library there."""
    result = tmp / f"result-{nproc}.json"
    work = tmp / f"nproc-{nproc}"
    work.mkdir()
    threads = args.threads or max(1, _cores() // nproc)
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--result", str(result)]
    argv += ["--dir", str(work), "--threads", str(threads), "--preset", args.preset]
    argv += ["--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    argv += ["--seed", str(args.seed), "--micro-batch", str(args.micro)]
    if offline is not None:
        argv += ["--offline-dir", str(offline)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    code = launch(argv, nproc_per_node=nproc, env=env, log_ranks=None if args.verbose else ())
    wall = time.perf_counter() - started
    shutil.rmtree(work, ignore_errors=True)
    if code != 0 or not result.exists():
        return {"error": f"ranks exited with code {code}", "wall_s": wall}
    return {**json.loads(result.read_text()), "wall_s": wall}


def summarize(rows: list[dict[str, Any]], nprocs: Sequence[int]) -> list[dict[str, Any]]:
    """Per (nproc, op): each library's medians over repeats and DCP's time over shardax's."""
    out = []
    for nproc in nprocs:
        for op in OPS:
            entry: dict[str, Any] = {"nproc": nproc, "op": op}
            for lib in LIBS:
                ok = [r for r in rows if (r["lib"], r["op"], r["nproc"]) == (lib, op, nproc)]
                ok = [r for r in ok if "error" not in r]
                if not ok:
                    continue
                entry[f"{lib}_s"] = statistics.median(r["time_s"] for r in ok)
                entry[f"{lib}_GBps"] = statistics.median(r["GBps"] for r in ok)
                entry[f"{lib}_peak_rss_mib"] = statistics.median(r["peak_rss_mib"] for r in ok)
                entry[f"{lib}_rss_increase_mib"] = statistics.median(
                    r["rss_increase_mib"] for r in ok
                )
                if op == "save_async":
                    entry[f"{lib}_return_s"] = statistics.median(r["return_s"] for r in ok)
                if op != "load":
                    entry[f"{lib}_disk_bytes"] = statistics.median(r["disk_bytes"] for r in ok)
                entry[f"{lib}_repeats"] = len(ok)
            if "shardax_s" in entry and "dcp_s" in entry:
                entry["ratio"] = entry["dcp_s"] / entry["shardax_s"]
                if op == "save_async":
                    entry["return_ratio"] = entry["dcp_return_s"] / entry["shardax_return_s"]
            out.append(entry)
    return out


def print_table(summary: list[dict[str, Any]], file=sys.stderr) -> None:
    head = f"{'nproc':>5} {'op':<11}{'shardax s':>10}{'dcp s':>9}{'ratio':>7}"
    head += f"{'sx GB/s':>9}{'dcp GB/s':>10}{'sx MiB':>8}{'dcp MiB':>9}{'sx +MiB':>9}"
    head += f"{'dcp +MiB':>10}{'sx disk MB':>11}"
    head += f"{'dcp disk MB':>12}{'sx ret s':>10}{'dcp ret s':>10}"
    print(head, file=file)

    def num(entry: dict, key: str, fmt: str, scale: float = 1.0) -> str:
        return format(entry[key] / scale, fmt) if key in entry else "-"

    for e in summary:
        line = f"{e['nproc']:>5} {e['op']:<11}{num(e, 'shardax_s', '.3f'):>10}"
        line += f"{num(e, 'dcp_s', '.3f'):>9}{num(e, 'ratio', '.2f'):>7}"
        line += f"{num(e, 'shardax_GBps', '.2f'):>9}{num(e, 'dcp_GBps', '.2f'):>10}"
        line += f"{num(e, 'shardax_peak_rss_mib', '.0f'):>8}{num(e, 'dcp_peak_rss_mib', '.0f'):>9}"
        line += f"{num(e, 'shardax_rss_increase_mib', '.0f'):>9}"
        line += f"{num(e, 'dcp_rss_increase_mib', '.0f'):>10}"
        line += f"{num(e, 'shardax_disk_bytes', '.1f', 1e6):>11}"
        line += f"{num(e, 'dcp_disk_bytes', '.1f', 1e6):>12}"
        line += f"{num(e, 'shardax_return_s', '.3f'):>10}{num(e, 'dcp_return_s', '.3f'):>10}"
        print(line, file=file)
    print(
        "ratio = dcp time / shardax time (above 1: shardax faster); MiB: peak RSS of the "
        "largest rank during the op, +MiB: its rise over the RSS before the op",
        file=file,
    )
    print(f"cache: {CACHE_NOTE}", file=file)


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", default="2,4", help="comma list of rank counts (one job each)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every (op, lib)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before them")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    parser.add_argument("--micro-batch", dest="micro", type=int, default=2, help="for the step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", help="where checkpoints go (default: the system temp dir)")
    parser.add_argument("--json", help="also write the header, every row and the summary here")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 ranks, 1 repeat")
    parser.add_argument("--verbose", action="store_true", help="show the ranks' output")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--offline-dir", help=argparse.SUPPRESS)
    parser.add_argument("--offline-op", help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--dst", help=argparse.SUPPRESS)
    parser.add_argument("--mesh-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.nproc, args.repeats = "tiny", "2", 1
    try:
        args.nprocs = [int(n) for n in str(args.nproc).split(",")]
    except ValueError:
        parser.error(f"--nproc takes a comma list of integers, got {args.nproc!r}")
    if any(n < 2 for n in args.nprocs):
        parser.error("--nproc values must be at least 2 (a sharded checkpoint needs ranks)")
    if args.repeats < 1 or args.micro < 1 or args.warmup < 0:
        parser.error("--repeats and --micro-batch must be at least 1, --warmup at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.offline_op:
        return offline_op(args)
    if args.worker:
        code = worker(args)
        # as in train.py: torch 2.13's gloo sometimes aborts in interpreter finalization
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    cfg = config_from(args)
    with tempfile.TemporaryDirectory(prefix="shardax-ckpt-bench-", dir=args.dir) as tmp:
        tmp_path = Path(tmp)
        header = {
            "benchmark": "ckpt",
            "preset": args.preset,
            "model": model_facts(cfg, param_count(cfg)),
            "state": "params + AdamW (count, mu, nu), ZeRO-3 over dp, fp32, after one step",
            "nproc": args.nprocs,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "libs": LIBS,
            "ops": OPS,
            "dir": str(tmp_path),
            "same_filesystem_as_repo": os.stat(tmp_path).st_dev == os.stat(ROOT).st_dev,
            "cache": CACHE_NOTE,
            "torch": torch.__version__,
        }
        print(json.dumps(header), flush=True)
        rows: list[dict[str, Any]] = []
        offline_rows: list[dict[str, Any]] = []
        failed = []
        offline = tmp_path / "offline"
        for i, nproc in enumerate(args.nprocs):
            result = run_nproc(nproc, args, tmp_path, offline if i == 0 else None)
            if "error" in result:
                failed.append(nproc)
                print(f"nproc {nproc}: {result['error']}", file=sys.stderr, flush=True)
                continue
            for row in result["rows"]:
                row["saved_digest"] = result["saved_digest"]
                rows.append(row)
                print(json.dumps(row), flush=True)
            if i == 0:
                sizes = (result["state_bytes"], result["params_bytes"])
                offline_rows = run_offline(offline, nproc, args, *sizes)
                for row in offline_rows:
                    print(json.dumps(row), flush=True)
    summary = {
        "summary": summarize(rows, [n for n in args.nprocs if n not in failed]),
        "offline": summarize_offline(offline_rows),
        "roundtrip_ok": bool(rows) and all(r.get("roundtrip_ok") for r in rows),
        "offline_ok": bool(offline_rows)
        and all(r.get("offline_ok") and "error" not in r for r in offline_rows),
    }
    if failed:
        summary["failed"] = failed
    print(json.dumps(summary), flush=True)
    print_table(summary["summary"])
    print_offline(summary["offline"])
    if not summary["roundtrip_ok"]:
        print("WARNING: some load did not return what was saved", file=sys.stderr)
    if not summary["offline_ok"]:
        print("WARNING: an offline op failed or the consolidated files differ", file=sys.stderr)
    if args.json:
        runs = rows + offline_rows
        Path(args.json).write_text(json.dumps({**header, "runs": runs, **summary}, indent=2))
    ok = summary["roundtrip_ok"] and summary["offline_ok"]
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
