"""Monitoring a training run: a wall-clock breakdown of each step (forward,
backward — reported by :func:`shardax.value_and_grad` — optimizer, and your
own named timers), throughput (samples/s, tokens/s, TFLOP/s, MFU given a
peak), a log of every collective (calls, bytes, time, algbw/busbw in
nccl-tests' conventions), peak memory per rank, written to stdout, CSV,
JSONL or TensorBoard, with a progress line on rank 0. Everything is off
unless asked for; a monitor that only logs costs a clock read per step.

>>> import torch, shardax as sx
>>> mon = sx.monitor.Monitor(writers=(), timers=True, log_every=1, tokens_per_step=64)
>>> with mon.step(1):
...     with mon.timer("optimizer"):
...         pass
...     mon.log(loss=2.5)
>>> record = mon.records[-1]
>>> record["step"], record["loss"], "optimizer_ms" in record, record["tokens_per_s"] > 0
(1, 2.5, True, True)
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from . import _timing
from .collectives._traffic import Traffic, traffic
from .mesh import Mesh
from .moe import _stats

__all__ = [
    "Monitor",
    "comm_rows",
    "peak_memory",
    "reset_peak_memory",
    "transformer_flops_per_token",
]

WRITERS = ("stdout", "csv", "jsonl", "tensorboard")


def transformer_flops_per_token(
    n_params: int, n_layers: int, seq_len: int, d_model: int, *, training: bool = True
) -> float:
    """FLOPs per token of a decoder-only transformer: ``6N + 12·L·T·d`` for
    a training step (forward and backward; PaLM's appendix B), a third of
    that for a forward pass.

    >>> transformer_flops_per_token(1_000_000, 2, 64, 64)
    6098304.0
    """
    fwd_bwd = 6.0 * n_params + 12.0 * n_layers * seq_len * d_model
    return fwd_bwd if training else fwd_bwd / 3.0


def peak_memory() -> dict[str, float]:
    """This process's peak resident memory (``VmHWM``) and, on a GPU, the
    peak allocated by torch, in MiB.

    >>> peak_memory()["peak_rss_mib"] > 0
    True
    """
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    out["peak_rss_mib"] = int(line.split()[1]) / 1024
    except OSError:
        import resource

        out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def reset_peak_memory() -> bool:
    """Start the peaks :func:`peak_memory` reads again from the current
    memory (Linux's ``/proc/self/clear_refs``; on a GPU, torch's peak
    statistics too), so the next reading is the peak of what runs in
    between; whether the resident peak could be reset (False where the
    kernel has no such reset: :func:`peak_memory` then reads the peak of
    the whole process).

    >>> reset_peak_memory() in (True, False)
    True
    """
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Writer:
    def write(self, record: dict[str, Any]) -> None: ...
    def write_comm(self, step: int, rows: list[dict[str, Any]]) -> None: ...
    def close(self) -> None: ...


class _Stdout(_Writer):
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def write(self, record: dict[str, Any]) -> None:
        parts = [f"step {record['step']:>5}"]
        for key, value in record.items():
            if key == "step":
                continue
            if key.endswith("_per_s"):
                parts.append(f"{value:,.0f} {key[:-6]}/s")
            elif key.endswith("_ms"):
                parts.append(f"{key[:-3]} {value:.1f} ms")
            elif key.endswith("_mib"):
                parts.append(f"{key[:-4]} {value:,.0f} MiB")
            elif key == "mfu":
                parts.append(f"MFU {100 * value:.1f}%")
            elif key == "loss":
                parts.append(f"loss {value:.4f}")
            elif key == "tflops":
                parts.append(f"tflops {value:.3g}")
            elif isinstance(value, float):
                parts.append(f"{key} {value:.3g}")
            elif not isinstance(value, (list, dict)):
                parts.append(f"{key} {value}")
        print("  ".join(parts), file=self.stream or sys.stdout, flush=True)

    def write_comm(self, step: int, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            print(
                f"  comm {r['collective']}: {r['calls']} calls, {r['bytes'] / 2**20:.2f} MiB, "
                f"{1e3 * r['seconds']:.1f} ms, algbw {r['algbw_gbps']:.2f} GB/s, "
                f"busbw {r['busbw_gbps']:.2f} GB/s",
                file=self.stream or sys.stdout,
                flush=True,
            )


class _Jsonl(_Writer):
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.file = open(directory / "metrics.jsonl", "a")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def write_comm(self, step: int, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            self.file.write(json.dumps({"step": step, "comm": r}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class _Csv(_Writer):
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.metrics: tuple[TextIO, csv.DictWriter] | None = None
        self.comm: tuple[TextIO, csv.DictWriter] | None = None

    def _open(self, name: str, fields: Sequence[str]) -> tuple[TextIO, csv.DictWriter]:
        f = open(self.directory / name, "a", newline="")  # noqa: SIM115
        writer = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        if f.tell() == 0:
            writer.writeheader()
        return f, writer

    def write(self, record: dict[str, Any]) -> None:
        flat = {k: v for k, v in record.items() if not isinstance(v, (list, dict))}
        if self.metrics is None:
            self.metrics = self._open("metrics.csv", flat)
        self.metrics[1].writerow(flat)
        self.metrics[0].flush()

    def write_comm(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        if self.comm is None:
            self.comm = self._open("comm.csv", ["step", *rows[0]])
        for r in rows:
            self.comm[1].writerow({"step": step, **r})
        self.comm[0].flush()

    def close(self) -> None:
        for pair in (self.metrics, self.comm):
            if pair is not None:
                pair[0].close()


class _TensorBoard(_Writer):
    def __init__(self, directory: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "the tensorboard writer needs the tensorboard package: pip install "
                f"'shardax[monitor]' ({err})"
            ) from None
        self.writer = SummaryWriter(str(directory))

    def write(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key == "step" or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, record["step"])
            elif key == "expert_load":  # one curve per expert: its share of the pairs
                for i, share in enumerate(value):
                    self.writer.add_scalar(f"expert_load/{i}", share, record["step"])

    def write_comm(self, step: int, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            self.writer.add_scalar(f"comm/{r['collective']}/busbw_gbps", r["busbw_gbps"], step)
            self.writer.add_scalar(f"comm/{r['collective']}/bytes", r["bytes"], step)

    def close(self) -> None:
        self.writer.close()


class Monitor:
    """Measures steps and writes what it measured every ``log_every`` steps.

    Args:
        log_every: steps between records (throughput and timers are
            averaged over them).
        writers: any of ``"stdout"``, ``"csv"``, ``"jsonl"`` (both into
            ``dir``: ``metrics.*`` and the comm log), ``"tensorboard"``
            (needs ``shardax[monitor]``).
        dir: where file writers write.
        timers: time the phases of each step: ``forward`` and ``backward``
            (inside :func:`shardax.value_and_grad`), and every
            :meth:`timer` you open (``optimizer``, ``data``, …).
        comm: log every collective of the logged steps, by op and axes:
            calls, bytes, time, ``algbw = bytes / time`` and ``busbw =
            wire bytes / time`` (nccl-tests' conventions), and ``comm_ms``.
        memory: peak resident memory (and GPU allocation) of each rank.
        experts: each record's mixture-of-experts routing, over the steps
            since the last and every rank of the batch: ``expert_load``
            (each expert's share of the routed (token, choice) pairs,
            summed over the layers), ``expert_load_max`` (the busiest
            expert's share times the number of experts: 1.0 is perfectly
            balanced) and ``dropped_fraction`` (pairs past capacity). One
            small all-reduce per record, on every rank of the batch.
        samples_per_step, tokens_per_step: for samples/s and tokens/s.
        flops_per_token: for TFLOP/s (e.g. :func:`transformer_flops_per_token`).
        peak_tflops: one device's peak, for MFU (model FLOPs utilisation).
        mesh: gathers every rank's memory to rank 0 (and decides who writes:
            rank 0 only); without one, this process writes.
        total_steps, progress: a progress line on rank 0 (``\\r``-updated
            on a terminal, a line per record otherwise) with the ETA.

    Records are also kept in :attr:`records` (and the comm logs in
    :attr:`comm_logs`) on the writing rank.
    """

    def __init__(
        self,
        *,
        log_every: int = 25,
        writers: Iterable[str] = ("stdout",),
        dir: str | os.PathLike[str] = "runs/run",
        timers: bool = False,
        comm: bool = False,
        memory: bool = False,
        experts: bool = False,
        samples_per_step: int | None = None,
        tokens_per_step: int | None = None,
        flops_per_token: float | None = None,
        peak_tflops: float | None = None,
        mesh: Mesh | None = None,
        total_steps: int | None = None,
        progress: bool = False,
        stream: TextIO | None = None,
    ) -> None:
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"log_every must be a positive int; got {log_every!r}")
        names = tuple(writers)
        bad = [w for w in names if w not in WRITERS]
        if bad:
            raise ValueError(f"unknown writers {bad}; choose from {WRITERS}")
        if peak_tflops is not None and flops_per_token is None:
            raise ValueError("MFU needs flops_per_token as well as peak_tflops")
        self.log_every, self.timers, self.comm, self.memory = log_every, timers, comm, memory
        self.experts = experts
        self._routing = _stats.listener() if experts else None
        self.samples_per_step, self.tokens_per_step = samples_per_step, tokens_per_step
        self.flops_per_token, self.peak_tflops = flops_per_token, peak_tflops
        self.mesh, self.total_steps, self.progress = mesh, total_steps, progress
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"mesh is a shardax.Mesh (or None); got {type(mesh).__name__}")
        self.rank = mesh.rank if mesh is not None else 0
        self.world = mesh.world_size if mesh is not None else 1
        self.stream = stream
        directory = Path(dir)
        make = {"stdout": lambda: _Stdout(stream), "csv": lambda: _Csv(directory),
                "jsonl": lambda: _Jsonl(directory), "tensorboard": lambda: _TensorBoard(directory)}  # fmt: skip
        self.writers: list[_Writer] = [make[w]() for w in names] if self.rank == 0 else []
        self.records: list[dict[str, Any]] = []
        self.comm_logs: list[tuple[int, list[dict[str, Any]]]] = []
        self._phases: dict[str, float] = {}
        self._scalars: dict[str, Any] = {}
        self._steps_since = 0
        self._since = time.perf_counter()
        self._start = self._since
        self._traffic: Traffic | None = None

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> Monitor:
        """From a :class:`shardax.config.MonitorConfig`; ``kwargs`` add what
        a config cannot know (``mesh``, ``tokens_per_step``, …)."""
        return cls(
            log_every=config.log_every,
            writers=config.writers,
            dir=config.dir,
            timers=config.timers,
            comm=config.comm,
            memory=config.memory,
            experts=config.experts,
            peak_tflops=config.peak_tflops,
            progress=config.progress,
            **kwargs,
        )

    def _logs(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.total_steps

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Measure step ``step`` (1-based); on a logged step, write a record."""
        logged = self._logs(step)
        token = _timing.ACTIVE.set(self.timer) if self.timers else None
        comm = traffic() if self.comm and logged else contextlib.nullcontext()
        routing = (
            _stats.listening(self._routing)
            if self._routing is not None
            else contextlib.nullcontext()
        )
        try:
            with comm as counted, routing:
                yield
        finally:
            if token is not None:
                _timing.ACTIVE.reset(token)
        self._steps_since += 1
        if isinstance(counted, Traffic):
            self._traffic = counted
        if logged:
            self._record(step)

    @contextlib.contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Add the time spent inside to the phase ``name`` (when timers are on)."""
        if not self.timers:
            yield
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - started

    def log(self, **scalars: Any) -> None:
        """Values for the current step's record (loss, lr, …); floats of
        tensors are taken only on logged steps."""
        self._scalars.update(scalars)

    def _record(self, step: int) -> None:
        now = time.perf_counter()
        n = max(self._steps_since, 1)
        seconds = (now - self._since) / n
        record: dict[str, Any] = {"step": step}
        for key, value in self._scalars.items():
            record[key] = float(value) if hasattr(value, "item") else value
        record["step_ms"] = 1e3 * seconds
        for name, total in self._phases.items():
            record[f"{name}_ms"] = 1e3 * total / n
        if self.samples_per_step:
            record["samples_per_s"] = self.samples_per_step / seconds
        if self.tokens_per_step:
            record["tokens_per_s"] = self.tokens_per_step / seconds
            if self.flops_per_token:
                tflops = self.flops_per_token * self.tokens_per_step / seconds / 1e12 / self.world
                record["tflops"] = tflops  # per rank
                if self.peak_tflops:
                    record["mfu"] = tflops / self.peak_tflops
        rows: list[dict[str, Any]] = []
        if self._traffic is not None:
            rows = comm_rows(self._traffic)
            record["comm_ms"] = 1e3 * sum(r["seconds"] for r in rows)
            record["comm_bytes"] = sum(r["bytes"] for r in rows)
            record["comm_wire_bytes"] = sum(r["wire_bytes"] for r in rows)
        if self._routing is not None:
            record.update(self._routing.load_record())
            self._routing = _stats.listener()
        if self.memory:
            mem = peak_memory()
            if self.mesh is not None and self.world > 1:
                import torch

                from .collectives import all_gather

                local = torch.tensor([mem["peak_rss_mib"]], dtype=torch.float64)
                everyone = all_gather(local, self.mesh.axis_names, mesh=self.mesh)
                record["peak_rss_mib_per_rank"] = [float(v) for v in everyone]
                record["peak_rss_mib"] = float(everyone.max())
            else:
                record.update(mem)
        if self.rank == 0:
            self.records.append(record)
            if rows:
                self.comm_logs.append((step, rows))
            for w in self.writers:
                w.write(record)
                if rows:
                    w.write_comm(step, rows)
            if self.progress and self.total_steps:
                self._progress(step, now)
        self._phases.clear()
        self._scalars.clear()
        self._steps_since, self._since, self._traffic = 0, time.perf_counter(), None

    def _progress(self, step: int, now: float) -> None:
        done = step / self.total_steps
        eta = (now - self._start) / done * (1 - done) if done else 0.0
        bar = "#" * int(30 * done) + "-" * (30 - int(30 * done))
        stream = self.stream or sys.stderr
        line = f"[{bar}] {100 * done:5.1f}% step {step}/{self.total_steps} ETA {eta:,.0f} s"
        if stream.isatty():
            print("\r" + line, end="" if step < self.total_steps else "\n", file=stream, flush=True)
        else:
            print(line, file=stream, flush=True)

    def close(self) -> None:
        """Flush and close the writers."""
        for w in self.writers:
            w.close()
        self.writers = []

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def comm_rows(t: Traffic) -> list[dict[str, Any]]:
    """One row per collective kind (op over axes) of a :class:`Traffic`:
    calls, bytes (nccl-tests' size), wire bytes (bus bytes), seconds,
    ``algbw_gbps = bytes / seconds`` and ``busbw_gbps = wire / seconds``.

    >>> t = Traffic(); t.add("psum", ("dp",), 8_000_000, 8_000_000.0); t.add_time("psum", ("dp",), 0.004)
    >>> comm_rows(t)[0]["busbw_gbps"]
    2.0
    """
    rows = []
    for name, r in t.summary().items():
        sec = r["seconds"]
        rows.append(
            {
                "collective": name,
                "calls": r["calls"],
                "bytes": r["bytes"],
                "wire_bytes": r["wire"],
                "seconds": sec,
                "algbw_gbps": r["bytes"] / sec / 1e9 if sec > 0 else 0.0,
                "busbw_gbps": r["wire"] / sec / 1e9 if sec > 0 else 0.0,
            }
        )
    return rows
