"""``this_machine``: this CPU host measured in seconds, as a :class:`Cluster`
— its ranks' matmul rate, memory bandwidth, a transformer block's achieved
share of that rate, the collectives on shared memory and on gloo, the
runtime's memory and the disk."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import PlanError
from ._cluster import Cluster, Link, _MiB

__all__ = ["this_machine"]

_PROBE_TIMEOUT = 180.0  # seconds for the ranks (a first run may build the shm core)
_MARK = "shardax-probe-result:"


def this_machine(ranks: int = 2, *, quick: bool = False) -> Cluster:
    """This CPU host measured now, in seconds (``quick``: fewer samples,
    noisier): ``ranks`` processes on one node (``ranks=1``: an idle second
    joins for the links), ``cpu_count // ranks`` torch threads each, all
    measuring at once; a PlanError says why they could not run.

    - ``peak_flops``: the slowest rank's best n×n ``torch.mm`` (n = 1024,
      512 if ``quick``) in fp32, and bf16 where it reaches half of that
      (else left out: train in fp32 here). ``achievable``: what a GPT
      block's forward and backward (width 512, 4 x 256 tokens; 256 wide if
      ``quick``) reaches of that rate, its elementwise traffic set apart.
    - ``memory_bandwidth``: a 64 MiB tensor copy, reads and writes counted
      (as GPU memory bandwidth is quoted); ``host_bandwidth``: it counted once.
    - ``intra``: psums of 64 KiB and 16 MiB on the backend a run here gets
      (``SHARDAX_BACKEND``, else ``shm``, else gloo; signature checks as in
      a run), the slowest rank's best times fitted to ``2(n-1) * latency +
      2(n-1)/n * bytes / bandwidth``; ``inter``: the same on gloo over
      loopback, a stand-in for a network.
    - ``reserved_memory``: VmRSS of a fresh rank with torch and shardax
      imported. ``disk_bandwidth``: writing and fsyncing 64 MiB (16 if
      ``quick``) in ``TMPDIR``. ``host_memory``: MemTotal (or the cgroup's
      limit, if lower), ``device_memory`` its share per rank. ``overlap``:
      0, the cores that compute also move the bytes. ``gather_bandwidth``
      of each link: an all-gather of 16 MiB per rank into a new tensor.
      ``allocator_slack``: a 512-wide block's step repeated 6 times, how much
      the peak RSS grew past the first step's over what that step took;
      ``allocator_threshold``: the mmap threshold ``shardax.init`` sets.

    >>> this_machine  # measured, so no output to show  # doctest: +ELLIPSIS
    <function this_machine at ...>
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise PlanError(f"ranks is a whole number >= 1, e.g. 2; got {ranks!r}", "ranks")
    host, procs = _host_memory(), max(ranks, 2)
    root = str(Path(__file__).resolve().parents[2])  # importable as here, installed or not
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    code = "import torch, shardax; from shardax.plan._probe import _rank_main; _rank_main()"
    with tempfile.TemporaryDirectory(prefix="shardax-probe-") as tmp:
        children = []
        for rank in range(procs):
            argv = [sys.executable, "-c", code, *map(str, (rank, procs, ranks, int(quick))), tmp]
            with open(os.path.join(tmp, f"rank{rank}.log"), "w") as log:
                children.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))
        try:
            block, path = os.urandom(4 * _MiB), os.path.join(tmp, "disk-probe")
            start = time.perf_counter()
            with open(path, "wb", buffering=0) as f:  # while the ranks start
                for _ in range(4 if quick else 16):
                    f.write(block)
                os.fsync(f.fileno())
            disk = os.path.getsize(path) / (time.perf_counter() - start)
            got = _collect(children, tmp)
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
    flops = {k: got[k] for k in ("fp32", "bf16") if got[k] >= got["fp32"] / 2}
    achievable = _block_achievable(
        256 if quick else 512, got["block"], got["fp32"], 2 * got["copy"]
    )
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get(
        "SHARDAX_MMAP_THRESHOLD", str(4 * _MiB)
    )
    return Cluster(
        allocator_slack=got["slack"], allocator_threshold=int(threshold) or None,
        name="this-machine", devices_per_node=ranks, device_memory=host // ranks,
        reserved_memory=got["rss"], peak_flops=flops, achievable=achievable,
        memory_bandwidth=2 * got["copy"], intra=Link(**got["intra"]), inter=Link(**got["inter"]),
        host_bandwidth=got["copy"], disk_bandwidth=disk, host_memory=host, overlap=0.0,
    )  # fmt: skip


_BLOCK_TOKENS = (4, 256)  # sequences x tokens of the probe's transformer block


def _block_step(width: int) -> Any:
    """A GPT block's forward and backward (pre-norm attention with causal
    SDPA and a GELU MLP, fp32) on 4 sequences of 256 tokens, as a callable."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    heads, (b, s) = width // 64, _BLOCK_TOKENS
    ln1, ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
    qkv, proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
    fc, out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
    x0 = torch.randn(b, s, width, requires_grad=True)

    def step() -> None:
        q, k, v = qkv(ln1(x0)).view(b, s, heads, 3, width // heads).unbind(3)
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        x = x0 + proj(y.transpose(1, 2).flatten(2))
        x = x + out(F.gelu(fc(ln2(x))))
        x.sum().backward()

    return step


def _allocator_slack(step: Any, repeats: int) -> float:
    """How much the allocator's footprint grows past one step's peak when the
    step repeats: (peak after ``repeats`` more steps - the first step's) over
    (the first step's - the memory before it), the shardax mmap threshold
    in effect (its ``Mesh`` set it)."""
    from ..monitor import peak_memory, reset_peak_memory

    def rss() -> float:
        with open("/proc/self/status") as f:
            return next(int(row.split()[1]) / 1024 for row in f if row.startswith("VmRSS:"))

    if not reset_peak_memory():
        return 0.0
    base = rss()
    step()
    first = peak_memory()["peak_rss_mib"]
    for _ in range(repeats):
        step()
    after = peak_memory()["peak_rss_mib"]
    return max(0.0, (after - first) / max(first - base, 1.0))


def _block_achievable(width: int, seconds: float, peak: float, bandwidth: float) -> float:
    """The fraction of ``peak`` a transformer block's matmuls reach here: the
    probe block's measured forward and backward, less the elementwise
    traffic the cost model counts at ``bandwidth``, over its FLOPs at
    ``peak`` (within 0.05..1)."""
    from ._model import ModelShape

    b, s = _BLOCK_TOKENS
    shape = ModelShape(layers=1, width=width, heads=width // 64, mlp=4 * width, vocab=1,
                       block_matmul=12 * width**2, head_matmul=0, params=1,
                       block_params=1)  # fmt: skip
    matmul = 3 * b * s * shape.layer_flops(s) / peak
    elementwise = 3 * b * s * shape.layer_traffic(s, flash=True) * 4 / bandwidth
    return min(1.0, max(0.05, matmul / max(seconds - elementwise, 1e-9)))


def _host_memory() -> int:
    """MemTotal, or the cgroup's memory limit where that is lower."""
    try:
        with open("/proc/meminfo") as f:
            total = next(int(row.split()[1]) * 1024 for row in f if row.startswith("MemTotal:"))
    except (OSError, StopIteration):
        raise PlanError("cannot read MemTotal in /proc/meminfo: this_machine needs Linux") from None
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = Path(limit).read_text().strip() if os.path.exists(limit) else ""
        total = min(total, int(text)) if text.isdigit() else total
    return total


def _collect(children: list[Any], tmp: str) -> dict[str, Any]:
    """Rank 0's results once all ranks are done, or a PlanError with a failed rank's output."""
    deadline = time.monotonic() + _PROBE_TIMEOUT
    while time.monotonic() < deadline and any(c.poll() is None for c in children):
        if any(c.poll() for c in children):  # one failed: the others would wait for it
            break
        time.sleep(0.01)
    logs = [Path(tmp, f"rank{rank}.log").read_text() for rank in range(len(children))]
    for rank, child in sorted(enumerate(children), key=lambda rc: rc[1].poll() in (0, None)):
        if child.poll() != 0:
            code = child.poll()
            why = f"did not finish in {_PROBE_TIMEOUT:g} s" if code is None else f"exited {code}"
            tail = "\n".join(logs[rank].rstrip().splitlines()[-15:])
            raise PlanError(f"measuring this machine: probe rank {rank} {why}; it wrote:\n{tail}")
    return json.loads(logs[0].split(_MARK)[-1].splitlines()[0])


def _rank_main() -> None:
    """One probe rank of :func:`this_machine` (argv: rank, processes, computing
    ranks, quick, folder); rank 0 prints what they measured, as JSON."""
    with open("/proc/self/status") as f:
        rss = next((int(row.split()[1]) * 1024 for row in f if row.startswith("VmRSS:")), 0)
    rank, procs, ranks, quick = (int(a) for a in sys.argv[1:5])
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ..collectives import all_gather, barrier, psum
    from ..collectives._backend import comm_of
    from ..mesh import Mesh, shutdown

    def reduce(values: list[float], op: Any) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    def best(fn: Any, reps: int) -> float:
        fn()  # warm up
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // ranks))
    store, timeout = dist.FileStore(os.path.join(sys.argv[5], "store"), procs), timedelta(60)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=procs, timeout=timeout)
    meshes = {"intra": Mesh({"x": procs}, timeout=60.0)}
    os.environ["SHARDAX_BACKEND"] = "torch"  # a second group (another timeout), on gloo
    meshes["inter"] = Mesh({"x": procs}, timeout=61.0)
    if comm_of(meshes["inter"].group("x")).backend.name != "torch":
        raise RuntimeError("the second mesh did not get a gloo group of its own")
    rates = [math.inf] * 4  # fp32, bf16, copy, a block: only the computing ranks measure
    slack = [0.0]
    barrier(mesh=meshes["intra"])
    if rank < ranks:
        slack[0] = _allocator_slack(_block_step(512), 6)
        rates[3] = best(_block_step(256 if quick else 512), 2 if quick else 3)
        n, reps = (512, 2) if quick else (1024, 3)
        for i, dtype in enumerate((torch.float32, torch.bfloat16)):
            a = torch.randn(n, n).to(dtype)
            try:
                rates[i] = 2 * n**3 / best(lambda a=a: torch.mm(a, a), reps)
            except RuntimeError:  # no bf16 matmul on this CPU
                rates[i] = 0.0
        src, dst = torch.ones(16 * _MiB), torch.empty(16 * _MiB)  # 64 MiB each
        rates[2] = 64 * _MiB / best(lambda: dst.copy_(src), reps + 1)
        del src, dst
    rates[3] = -rates[3]  # the slowest rank's block time: the largest, by MIN of negatives
    out = dict(
        zip(("fp32", "bf16", "copy", "block"), reduce(rates, dist.ReduceOp.MIN), strict=True)
    )
    out["block"] = -out["block"]
    out["rss"] = int(reduce([rss], dist.ReduceOp.MAX)[0])
    out["slack"] = reduce(slack, dist.ReduceOp.MAX)[0]
    share, steps = 2 * (procs - 1) / procs, 2 * (procs - 1)
    for which, mesh in meshes.items():
        fit = []  # (bytes, seconds) for 64 KiB and 16 MiB
        for numel, calls in ((16 * 1024, 10), (4 * _MiB, 2)):
            x = torch.zeros(numel)
            psum(x, "x", mesh=mesh, out=x)  # warm up
            times = []
            for _ in range(3 if quick else 7):
                barrier(mesh=mesh)
                start = time.perf_counter()
                for _ in range(calls):
                    psum(x, "x", mesh=mesh, out=x)
                times.append((time.perf_counter() - start) / calls)
            fit.append((numel * 4, min(reduce(times, dist.ReduceOp.MAX))))
        (small, t_small), (large, t_large) = fit
        per_byte = (t_large - t_small) / (share * (large - small))
        per_byte = per_byte if per_byte > 0 else t_large / (share * large)  # noise won
        latency = max(0.0, t_small - share * small * per_byte) / steps
        x = torch.zeros(4 * _MiB)  # a ZeRO gather: into a new tensor, as training's are
        all_gather(x, "x", mesh=mesh)  # warm up
        times = []
        for _ in range(2 if quick else 4):
            barrier(mesh=mesh)
            start = time.perf_counter()
            all_gather(x, "x", mesh=mesh)
            times.append(time.perf_counter() - start)
        moved = (procs - 1) * x.numel() * 4  # of the whole, what each rank receives
        t_gather = max(min(reduce(times, dist.ReduceOp.MAX)) - (procs - 1) * latency, 1e-9)
        out[which] = {"bandwidth": 1 / per_byte, "latency": latency,
                      "gather_bandwidth": moved / t_gather}  # fmt: skip
    shutdown()
    if rank == 0:
        print(_MARK + json.dumps(out), flush=True)
