"""``Cluster``: the machines a plan runs on, as the planner reads them: how
fast a device computes and moves memory, how much it holds, and the links
within a node (``intra``) and between nodes (``inter``). From a preset
(``PRESETS``), a file (hjson or JSON, sizes as numbers or with units:
``"80 GiB"``, ``"600 GB/s"``, ``"312 TFLOP/s"``, ``"5 us"``), or measured
on this host (:func:`this_machine`).

>>> c = Cluster.load("a100-80gb").with_nodes(4)
>>> c.world_size, c.flops("bf16") / 1e12, round(c.intra.time(1e9), 6)
(32, 218.4, 0.004351)
>>> Cluster.from_text(c.to_hjson()) == c
True
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ..config._hjson import _line_of, _plain, _unknown, parse
from ..errors import ConfigError, PlanError

__all__ = ["A100_ACHIEVABLE", "DTYPES", "HOPPER_ACHIEVABLE", "PRESETS", "Cluster", "Link",
           "quantity"]  # fmt: skip

DTYPES = ("fp32", "tf32", "bf16", "fp16")  # the matmul dtypes a cluster may give a rate for

_MiB, _GiB, _TiB = 2**20, 2**30, 2**40
_PREFIXES = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}  # fmt: skip
_BASES = {"B": ("B", 1), "B/s": ("B/s", 1), "b/s": ("B/s", 1 / 8), "FLOP/s": ("FLOP/s", 1),
          "FLOPS": ("FLOP/s", 1)}  # fmt: skip
_TIMES = {"s": 1, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}  # divisors
_WORDS = {"B": "bytes, e.g. '80 GiB'", "B/s": "bytes/s, e.g. '600 GB/s'",
          "FLOP/s": "FLOP/s, e.g. '312 TFLOP/s'", "s": "seconds, e.g. '5 us'",
          "achievable": "the fraction of peak a large matmul reaches, e.g. 0.7",
          "overlap": "the share of communication hidden behind compute, e.g. 1",
          "allocator_slack": "the share of the activations the allocator keeps, e.g. 0.4"}  # fmt: skip
_NUMBER = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(\S*)\s*$")


def quantity(value: Any, unit: str, name: str = "value") -> float:
    """``value`` in ``unit`` (``"B"``, ``"B/s"``, ``"FLOP/s"``, ``"s"``): a number,
    or text with a unit and a decimal (``k M G T P``) or binary (``Ki Mi Gi
    Ti Pi``) prefix; ``b/s`` is bits/s (a network's line rate), ``FLOPS`` is
    ``FLOP/s``, times in ``s ms us µs ns``. Else a PlanError naming ``name``.

    >>> quantity("80 GiB", "B"), quantity("600 GB/s", "B/s"), quantity("200 Gb/s", "B/s")
    (85899345920.0, 600000000000.0, 25000000000.0)
    >>> quantity("312 TFLOP/s", "FLOP/s"), quantity("5 us", "s"), quantity(3, "s")
    (312000000000000.0, 5e-06, 3.0)
    >>> quantity("80 GB/s", "B", "device_memory")
    Traceback (most recent call last):
    ...
    shardax.errors.PlanError: device_memory: cannot read '80 GB/s' as bytes, e.g. '80 GiB'
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = _NUMBER.match(value) if isinstance(value, str) else None
    if m is not None and unit in ("B", "B/s", "FLOP/s", "s"):
        number, text = float(m.group(1)), m.group(2)
        if not text:
            return number
        if unit == "s" and text in _TIMES:
            return number / _TIMES[text]
        for prefix, factor in _PREFIXES.items():
            base = _BASES.get(text[len(prefix) :]) if text.startswith(prefix) else None
            if base is not None and base[0] == unit:
                return number * factor * base[1]
    words = _WORDS.get(unit) if unit else "a number"
    raise PlanError(f"{name}: cannot read {value!r} as {words}", name)


def _human(value: float, unit: str) -> str:
    """``value`` in ``unit`` with a prefix, three significant digits (for comments)."""
    if unit == "s":
        text = next((t for t in ("s", "ms", "us") if value * _TIMES[t] >= 1), "ns")
        return f"{value * _TIMES[text]:.3g} {text}"
    steps = ("Ti", "Gi", "Mi", "Ki") if unit == "B" else ("P", "T", "G", "M", "k")
    prefix = next((p for p in steps if value >= _PREFIXES[p]), "")
    return f"{value / _PREFIXES[prefix]:.3g} {prefix}{unit}"


def _number(name: str, unit: str, *, low: float = 0.0, closed: bool = False,
            high: float | None = None, integer: bool = False) -> Any:  # fmt: skip
    """A converter: ``value`` read by :func:`quantity` and checked to lie
    above ``low`` (or at it, with ``closed``) and at most ``high``."""
    where = (f"in {'[' if closed else '('}{low:g}, {high:g}]" if high is not None else
             f">= {low:g}" if closed else "positive")  # fmt: skip
    what = _WORDS.get(name) or _WORDS.get(unit) or "a whole number, e.g. 8"

    def convert(value: Any) -> Any:
        out = quantity(value, unit, name)
        ok = math.isfinite(out) and (out >= low if closed else out > low)
        whole = not integer or unit or out.is_integer()
        if not ok or (high is not None and out > high) or not whole:
            raise PlanError(f"{name} must be {where}: {what}; got {value!r}", name)
        return round(out) if integer else out

    return convert


_COUNT = {"low": 1, "closed": True, "integer": True}
_SHARE = {"closed": True, "high": 1.0}


@attrs.frozen(kw_only=True)
class Link:
    """A link between ranks, as a ring collective sees it: ``bandwidth`` in
    bytes/s per rank, one direction (NCCL's *bus bandwidth*, nccl-tests);
    ``latency`` in seconds per message step (alpha). A ring all-reduce of
    ``S`` bytes over ``n`` ranks: ``2(n-1)`` steps, ``2(n-1)/n * S`` bytes.
    ``gather_bandwidth``: the bus bandwidth of all-gathers and
    reduce-scatters where it differs from the all-reduce's (None: the same).

    >>> Link(bandwidth="230 GB/s", latency="3.4 us")
    Link(bandwidth=230000000000.0, latency=3.4e-06)
    """

    bandwidth: float = attrs.field(converter=_number("bandwidth", "B/s"))
    latency: float = attrs.field(converter=_number("latency", "s", closed=True))
    gather_bandwidth: float | None = attrs.field(
        default=None,
        converter=lambda v: None if v is None else _number("gather_bandwidth", "B/s")(v),
    )

    def __repr__(self) -> str:
        extra = (
            "" if self.gather_bandwidth is None else f", gather_bandwidth={self.gather_bandwidth!r}"
        )
        return f"Link(bandwidth={self.bandwidth!r}, latency={self.latency!r}{extra})"

    @property
    def gather(self) -> float:
        """The all-gather and reduce-scatter bus bandwidth."""
        return self.bandwidth if self.gather_bandwidth is None else self.gather_bandwidth

    def time(self, nbytes: float, steps: int = 1) -> float:
        """Seconds to move ``nbytes`` per rank in ``steps`` message steps:
        ``steps * latency + nbytes / bandwidth``.

        >>> n, link = 8, Link(bandwidth=230e9, latency=3.4e-6)
        >>> round(link.time(2 * (n - 1) / n * 2**30, steps=2 * (n - 1)) * 1e3, 2)  # ms
        8.22
        """
        return steps * self.latency + nbytes / self.bandwidth


def _link(name: str) -> Any:
    def convert(value: Any) -> Link:
        if isinstance(value, Link):
            return value
        keys, mapping = ["bandwidth", "latency", "gather_bandwidth"], isinstance(value, Mapping)
        extra = sorted(set(value) - set(keys)) if mapping else []
        if extra:
            raise PlanError(_unknown("", extra[0], f"{name}.", keys)[2:], f"{name}.{extra[0]}")
        if not mapping or not {"bandwidth", "latency"} <= set(value):
            example = "{bandwidth: '230 GB/s', latency: '3.4 us'}"
            raise PlanError(f"{name} is a link, both keys given: {example}; got {value!r}", name)
        try:
            return Link(**value)
        except PlanError as err:
            raise PlanError(f"{name}.{err}", f"{name}.{err.key_path}") from None

    return convert


def _flops(value: Any) -> dict[str, float]:
    if not isinstance(value, Mapping) or not value:
        example = f"peak_flops maps dtypes to FLOP/s, e.g. {{bf16: '312 TFLOP/s'}}; got {value!r}"
        raise PlanError(example, "peak_flops")
    for key in value:
        if key not in DTYPES:
            message = _unknown("", str(key), "peak_flops.", list(DTYPES))[2:]
            raise PlanError(message, f"peak_flops.{key}")
    return {k: _number(f"peak_flops.{k}", "FLOP/s")(value[k]) for k in DTYPES if k in value}


@attrs.frozen(kw_only=True)
class Cluster:
    """``nodes`` nodes of ``devices_per_node`` devices, and what a device,
    node and link can do; sizes are numbers or text with units (:func:`quantity`).

    Attributes:
        device_memory: bytes per device the job may use.
        reserved_memory: bytes per device the runtime holds before any tensor
            (CUDA context, NCCL buffers, allocator slack; on CPU: torch imported).
        peak_flops: dense FLOP/s per device by dtype (some of ``DTYPES``).
        achievable: the fraction of peak a large matmul reaches, in (0, 1].
        memory_bandwidth: device memory bytes/s, reads and writes counted.
        intra, inter: the :class:`Link` within a node, and between nodes.
        host_bandwidth: device↔host bytes/s per device, one direction.
        disk_bandwidth: bytes/s per node to local disk.
        host_memory: bytes of host memory per node.
        overlap: the share of communication that can run behind compute:
            1 on GPUs (copy engines), 0 where the computing cores move it.
        allocator_slack: the share of a step's short-lived memory (the
            activations) the allocator keeps on top of the first step's
            peak, step after step (fragmentation): measured on this machine,
            0 for the GPU presets (PyTorch's caching allocator is not modelled).
        allocator_threshold: tensors at least this many bytes go back to the
            system when freed and add no slack (glibc's mmap threshold, which
            ``shardax.init`` sets to 4 MiB); None: every size adds it.

    >>> Cluster.load("h100").with_nodes(2).world_size
    16
    >>> attrs.evolve(Cluster.load("h100"), achievable=1.5)
    Traceback (most recent call last):
    ...
    shardax.errors.PlanError: achievable must be in (0, 1]: the fraction of peak a large matmul reaches, e.g. 0.7; got 1.5
    """

    name: str
    nodes: int = attrs.field(default=1, converter=_number("nodes", "", **_COUNT))
    devices_per_node: int = attrs.field(converter=_number("devices_per_node", "", **_COUNT))
    device_memory: int = attrs.field(converter=_number("device_memory", "B", integer=True))
    reserved_memory: int = attrs.field(
        default=0, converter=_number("reserved_memory", "B", closed=True, integer=True)
    )
    peak_flops: dict[str, float] = attrs.field(converter=_flops, hash=False)
    achievable: float = attrs.field(converter=_number("achievable", "", high=1.0))
    memory_bandwidth: float = attrs.field(converter=_number("memory_bandwidth", "B/s"))
    intra: Link = attrs.field(converter=_link("intra"))
    inter: Link = attrs.field(converter=_link("inter"))
    host_bandwidth: float = attrs.field(converter=_number("host_bandwidth", "B/s"))
    disk_bandwidth: float = attrs.field(converter=_number("disk_bandwidth", "B/s"))
    host_memory: int = attrs.field(converter=_number("host_memory", "B", integer=True))
    overlap: float = attrs.field(default=1.0, converter=_number("overlap", "", **_SHARE))
    allocator_slack: float = attrs.field(
        default=0.0, converter=_number("allocator_slack", "", closed=True)
    )
    allocator_threshold: int | None = attrs.field(
        default=None,
        converter=lambda v: None if v is None else _number(
            "allocator_threshold", "B", low=1, closed=True, integer=True)(v),
    )  # fmt: skip

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"name is a non-empty text, e.g. 'a100'; got {self.name!r}", "name")
        if self.reserved_memory >= self.device_memory:
            raise PlanError(
                f"reserved_memory ({_human(self.reserved_memory, 'B')}) must be less than "
                f"device_memory ({_human(self.device_memory, 'B')}): nothing would be left for "
                "tensors; lower reserved_memory or raise device_memory",
                "reserved_memory",
            )

    @property
    def world_size(self) -> int:
        """Devices in all: ``nodes * devices_per_node``."""
        return self.nodes * self.devices_per_node

    def flops(self, dtype: str, *, tf32: bool = True) -> float:
        """The FLOP/s a large matmul in ``dtype`` reaches on one device:
        ``peak_flops[dtype] * achievable``. ``fp32`` takes the ``tf32`` rate
        where there is one (``torch.set_float32_matmul_precision("high")``,
        as Megatron-LM sets); ``tf32=False`` for strict fp32, torch's default.

        >>> a100 = Cluster.load("a100-80gb")
        >>> a100.flops("fp32") / 1e12, a100.flops("fp32", tf32=False) / 1e12
        (109.2, 13.65)
        >>> a100.flops("fp8")
        Traceback (most recent call last):
        ...
        shardax.errors.PlanError: a100-80gb has no matmul rate for 'fp8'; it knows fp32, tf32, bf16, fp16
        """
        key = "tf32" if dtype == "fp32" and tf32 and "tf32" in self.peak_flops else dtype
        if key not in self.peak_flops:
            close = difflib.get_close_matches(str(dtype), list(self.peak_flops), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PlanError(
                f"{self.name} has no matmul rate for {dtype!r}{hint}; it knows "
                f"{', '.join(self.peak_flops)}"
            )
        return self.peak_flops[key] * self.achievable

    def with_nodes(self, nodes: int) -> Cluster:
        """This cluster with ``nodes`` nodes (``attrs.evolve`` does the same).

        >>> Cluster.load("h200").with_nodes(16).world_size
        128
        """
        return attrs.evolve(self, nodes=nodes)

    def to_dict(self) -> dict[str, Any]:
        """As plain data, every field named but those None (what
        :meth:`from_dict` reads).

        >>> Cluster.load("h100").to_dict()["intra"]
        {'bandwidth': 360000000000.0, 'latency': 3.4e-06}
        """
        out = {k: v for k, v in attrs.asdict(self).items() if v is not None}
        for key in ("intra", "inter"):  # a link's gather bandwidth only where it has its own
            out[key] = {k: v for k, v in out[key].items() if v is not None}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "cluster") -> Cluster:
        """Build from parsed hjson/JSON; an unknown or missing key is an error.

        >>> Cluster.from_dict({**Cluster.load("h100").to_dict(), "node": 2})
        Traceback (most recent call last):
        ...
        shardax.errors.PlanError: cluster: unknown key node (did you mean 'nodes'?); the top level takes name, nodes, devices_per_node, device_memory, reserved_memory, peak_flops, achievable, memory_bandwidth, intra, inter, host_bandwidth, disk_bandwidth, host_memory, overlap, allocator_slack, allocator_threshold
        """
        if not isinstance(data, Mapping):
            raise PlanError(f"{source}: a cluster is an object of fields; got {data!r}")
        fields = attrs.fields(cls)
        for key in set(data) - set(attrs.fields_dict(cls)):
            raise PlanError(_unknown(source, str(key), "", [f.name for f in fields]), key)
        needed = [f.name for f in fields if f.default is attrs.NOTHING]
        missing = [name for name in needed if name not in data]
        if missing:
            raise PlanError(
                f"{source}: missing {', '.join(missing)}; a cluster needs {', '.join(needed)}",
                missing[0],
            )
        try:
            return cls(**data)
        except PlanError as err:
            raise PlanError(f"{source}: {err}", err.key_path) from None

    @classmethod
    def from_text(cls, text: str, source: str = "cluster") -> Cluster:
        """Parse hjson (or JSON) text; an error names the line of the key.

        >>> text = Cluster.load("h100").to_hjson().replace("achievable: 0.7", "achievable: 0")
        >>> Cluster.from_text(text, "h100.hjson")
        Traceback (most recent call last):
        ...
        shardax.errors.PlanError: h100.hjson:13: achievable must be in (0, 1]: the fraction of peak a large matmul reaches, e.g. 0.7; got 0
        """
        try:
            data = parse(text, source, unreadable="not valid hjson", twice="keep one")
        except ConfigError as err:
            raise PlanError(str(err)) from None
        try:
            return cls.from_dict(_plain(data), source)
        except PlanError as err:
            path = err.key_path
            line = _line_of(text, tuple(path.split("."))) if path else None
            if line is None or not str(err).startswith(f"{source}: "):
                raise
            message = str(err).replace(f"{source}: ", f"{source}:{line}: ", 1)
            raise PlanError(message, path) from None

    def to_hjson(self) -> str:
        """hjson text that :meth:`from_text` reads back to this value (exact
        numbers, each size also in words, as a comment).

        >>> print(Cluster.load("h100").to_hjson().splitlines()[4])
          device_memory: 85520809984  // 79.6 GiB
        """
        units = {"device_memory": "B", "reserved_memory": "B", "host_memory": "B",
                 "memory_bandwidth": "B/s", "host_bandwidth": "B/s", "disk_bandwidth": "B/s",
                 "bandwidth": "B/s", "gather_bandwidth": "B/s", "latency": "s",
                 "peak_flops": "FLOP/s", "allocator_threshold": "B"}  # fmt: skip

        def lines(data: Mapping[str, Any], indent: str, unit: str | None) -> list[str]:
            out = []
            for key, value in data.items():
                if isinstance(value, Mapping):
                    inner = lines(value, indent + "  ", units.get(key))
                    out += [f"{indent}{key}: {{", *inner, f"{indent}}}"]
                    continue
                text = json.dumps(value) if isinstance(value, str) else repr(value)
                u = unit or units.get(key)
                out.append(f"{indent}{key}: {text}" + (f"  // {_human(value, u)}" if u else ""))
            return out

        return "\n".join(["{", *lines(self.to_dict(), "  ", None), "}"]) + "\n"

    @classmethod
    def load(cls, spec: str) -> Cluster:
        """A preset's name (``PRESETS``), ``"this-machine"`` (measured now,
        :func:`this_machine`; ``"this-machine:4"`` for 4 ranks), or the path
        of an ``.hjson``/``.json`` file.

        >>> Cluster.load("a100-40gb")
        Traceback (most recent call last):
        ...
        shardax.errors.PlanError: unknown cluster 'a100-40gb' (did you mean 'a100-80gb'?): give a preset (a100-80gb, h100, h200), 'this-machine' or 'this-machine:RANKS' (measured now), or the path of an .hjson/.json file
        """
        if spec in PRESETS:
            return PRESETS[spec]
        if spec == "this-machine" or spec.startswith("this-machine:"):
            ranks = spec.partition(":")[2] or "2"
            if not ranks.isdigit() or int(ranks) < 1:
                raise PlanError(f"{spec!r}: give ranks as a whole number, e.g. 'this-machine:4'")
            from ._probe import this_machine

            return this_machine(int(ranks))
        path = Path(spec)
        if path.suffix in (".hjson", ".json") or path.exists():
            try:
                text = path.read_text()
            except OSError as err:
                raise PlanError(f"cannot read cluster file {spec}: {err.strerror}") from None
            return cls.from_text(text, spec)
        close = difflib.get_close_matches(spec, [*PRESETS, "this-machine"], n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise PlanError(
            f"unknown cluster {spec!r}{hint}: give a preset ({', '.join(PRESETS)}), "
            "'this-machine' or 'this-machine:RANKS' (measured now), or the path of an "
            ".hjson/.json file"
        )


A100_ACHIEVABLE = 0.7
"""The fraction of peak a large A100 matmul reaches: a placeholder, to be calibrated
against the model FLOP utilization in Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM" (SC'21)."""
HOPPER_ACHIEVABLE = 0.7
"""The same for H100 and H200: a placeholder, not yet calibrated."""


def _dgx(name: str, mib: int, hbm: float, nvlink: float, nic: float, pcie: float, disk: float,
         flops: dict[str, float], achievable: float) -> Cluster:  # fmt: skip
    """A DGX node: 8 GPUs of ``mib`` MiB at ``hbm`` B/s, bus bandwidths per GPU
    ``nvlink`` and ``nic``; 2 TiB of host memory (DGX datasheets: 2 TB), 2 GiB
    reserved per GPU (an estimate: CUDA context ~0.5 GiB, NCCL buffers, allocator
    slack); per-step latencies from NCCL's tuning model (``src/graph/tuning.cc``,
    ring/Simple ``hwLat``: 3.4 us NVLink, 9.6 us network; plus 8.4 us a collective)."""
    return Cluster(
        name=name, devices_per_node=8, device_memory=mib * _MiB, reserved_memory=2 * _GiB,
        peak_flops=flops, achievable=achievable, memory_bandwidth=hbm,
        intra=Link(bandwidth=nvlink, latency=3.4e-6), inter=Link(bandwidth=nic, latency=9.6e-6),
        host_bandwidth=pcie, disk_bandwidth=disk, host_memory=2 * _TiB,
    )  # fmt: skip


# NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB), DGX A100 datasheet: 81920 MiB as nvidia-smi
# reports (= 80 GiB, "80GB"); dense 19.5 TF fp32, 156 TF tf32, 312 TF bf16/fp16; HBM2e 2039
# GB/s. NVLink3 600 GB/s both ways: NCCL's all-reduce bus bandwidth ~230 GB/s (tuning.cc caps
# sm80 at 235). 8 HDR InfiniBand NICs of 200 Gb/s (25 GB/s), one per GPU, ~92% reached. PCIe
# Gen4 x16: 32 GB/s a way, ~25 reached. Disk: a guess for its NVMe RAID-0.
_AMPERE = {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}
_A100 = _dgx("a100-80gb", 81920, 2.039e12, 230e9, 23e9, 25e9, 2e9, _AMPERE, A100_ACHIEVABLE)
# NVIDIA H100 Tensor Core GPU datasheet (SXM5), DGX H100 datasheet: 81559 MiB as nvidia-smi
# reports ("80GB"); dense 67 TF fp32, 494.5 TF tf32, 989.5 TF bf16/fp16 (the datasheet's tensor
# figures are with sparsity: twice these); HBM3 3.35 TB/s. NVLink4 900 GB/s both ways: ~360
# GB/s all-reduce bus bandwidth (nccl-tests, no NVLink SHARP). 8 NDR InfiniBand NICs of 400
# Gb/s (50 GB/s), one per GPU, ~90% reached. PCIe Gen5 x16: 64 GB/s a way, ~50 reached. Disk:
# a guess (twice the A100 node's NVMe drives).
_HOPPER = {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12}
_H100 = _dgx("h100", 81559, 3.35e12, 360e9, 45e9, 50e9, 4e9, _HOPPER, HOPPER_ACHIEVABLE)
# NVIDIA H200 Tensor Core GPU datasheet (SXM): the H100 node with 143771 MiB of HBM3e as
# nvidia-smi reports ("141GB") at 4.8 TB/s.
_H200 = _dgx("h200", 143771, 4.8e12, 360e9, 45e9, 50e9, 4e9, _HOPPER, HOPPER_ACHIEVABLE)

PRESETS: dict[str, Cluster] = {c.name: c for c in (_A100, _H100, _H200)}
"""Named clusters of one node (:meth:`Cluster.with_nodes` for more). GPU memory is
the total nvidia-smi reports (NVIDIA's "GB" of HBM is close to GiB); rates are
decimal (a datasheet's TB/s is 1e12 B/s)."""
