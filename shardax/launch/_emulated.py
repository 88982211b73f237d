"""Two "nodes" on one host, joined by a slow link: for measuring what a
layout sends between nodes without a cluster (tests and benchmarks).

Each node is a Linux network namespace with its own loopback; a veth pair
joins them, its bandwidth capped by ``tc`` (a token bucket, ``tbf``) and,
where the kernel has ``netem``, its latency set. The ranks of a node run
inside its namespace under ``shardax launch`` and share memory with each
other (``SHARDAX_NODE_ID`` names the node, so the shared-memory backend
keeps to it); gloo crosses the veth. The addresses exist only inside the
namespaces, which :class:`EmulatedCluster` creates and removes. It needs
root (``ip netns``); :func:`unavailable` says why not where it cannot run.

Bytes crossing the link are read from the veth's own counters
(:meth:`EmulatedCluster.sent`, or from inside a rank:
:func:`link_bytes_sent`).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import LaunchError

__all__ = ["LINK_ENV", "EmulatedCluster", "link_bytes_sent", "unavailable", "wait_all"]

LINK_ENV = "SHARDAX_EMULATED_LINK"
"""Set in every rank of an emulated node: the node's end of the link (its
veth device), whose counters :func:`link_bytes_sent` reads."""
_ADDRESSES = ("10.77.0.1", "10.77.0.2")
_CLUSTERS = itertools.count()


def unavailable() -> str | None:
    """Why two emulated nodes cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} (iproute2) not found"
    return None


def link_bytes_sent() -> int:
    """The bytes this rank's node has sent over the link so far (its veth's
    ``tx_bytes``; the rank runs inside the node's namespace)."""
    device = os.environ.get(LINK_ENV)
    if not device:
        raise LaunchError(f"link_bytes_sent: {LINK_ENV} is not set: not a rank of an emulated node")
    return int(Path(f"/sys/class/net/{device}/statistics/tx_bytes").read_text())


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise LaunchError(f"emulated cluster: `{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


class EmulatedCluster:
    """Two nodes on this host joined by a link of ``rate`` (``tc`` syntax:
    ``"1gbit"``, ``"100mbit"``) and, where given, ``delay_ms`` each way.
    A context manager: the namespaces exist inside the ``with`` block.

    >>> EmulatedCluster("1gbit")
    EmulatedCluster('1gbit', delay_ms=None)
    """

    def __init__(self, rate: str = "1gbit", delay_ms: float | None = None) -> None:
        self.rate, self.delay_ms = rate, delay_ms
        # unique per cluster: a deleted namespace's veth goes away lazily
        tag = f"{os.getpid() % 10**6}{next(_CLUSTERS) % 1000:03d}"
        self.namespaces = (f"sx{tag}a", f"sx{tag}b")
        self.devices = (f"sxv{tag}a", f"sxv{tag}b")
        self.made = False

    def __repr__(self) -> str:
        return f"EmulatedCluster({self.rate!r}, delay_ms={self.delay_ms!r})"

    @property
    def master_addr(self) -> str:
        """Node 0's address on the link: where the rendezvous store listens."""
        return _ADDRESSES[0]

    def __enter__(self) -> EmulatedCluster:
        why = unavailable()
        if why:
            raise LaunchError(f"emulated cluster: {why}")
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _make(self) -> None:
        (a, b), (va, vb) = self.namespaces, self.devices
        self.made = True
        for ns in (a, b):
            _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, dev, address in zip((a, b), (va, vb), _ADDRESSES, strict=True):
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", dev, "up")
            if self.delay_ms is None:
                shape = ["tbf", "rate", self.rate, "burst", "256kb", "latency", "100ms"]
            else:  # netem holds both; kernels without it refuse, by name
                shape = ["netem", "delay", f"{self.delay_ms}ms", "rate", self.rate]
            try:
                _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *shape)
            except LaunchError as err:
                if self.delay_ms is not None and "unknown" in str(err):
                    raise LaunchError(
                        "emulated cluster: this kernel has no netem qdisc, so the link's "
                        "latency cannot be set; pass delay_ms=None (bandwidth only, tbf)"
                    ) from None
                raise

    def remove(self) -> None:
        """Delete both namespaces (their veth ends go with them)."""
        if not self.made:
            return
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=60)
        self.made = False

    def sent(self) -> tuple[int, int]:
        """Bytes each node has sent over the link so far."""
        return tuple(  # type: ignore[return-value]
            int(_run("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"))
            for ns, dev in zip(self.namespaces, self.devices, strict=True)
        )

    def launch(
        self,
        argv: Sequence[str],
        nproc_per_node: int,
        env: Mapping[str, str] | None = None,
        timeout: float = 300,
        port: int = 29500,
    ) -> list[subprocess.CompletedProcess]:
        """Run ``python argv...`` as ``shardax launch`` does on each node,
        ``nproc_per_node`` ranks per node, both at once; each node's result
        (rank output on stdout)."""
        if not self.made:
            raise LaunchError("emulated cluster: launch inside its `with` block")
        procs = []
        for k, (ns, dev) in enumerate(zip(self.namespaces, self.devices, strict=True)):
            node_env = {**os.environ, **(env or {})}
            node_env.update(SHARDAX_NODE_ID=f"emulated-{k}", GLOO_SOCKET_IFNAME=dev)
            node_env[LINK_ENV] = dev
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "shardax", "launch",
                   "--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", str(nproc_per_node),
                   "--master-addr", self.master_addr, "--master-port", str(port),
                   "--launcher", "none", *argv]  # fmt: skip
            procs.append(
                subprocess.Popen(
                    cmd, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        try:
            return wait_all(procs, timeout)
        except subprocess.TimeoutExpired:
            raise LaunchError(f"emulated cluster: the run took over {timeout} s") from None


def wait_all(
    procs: Sequence[subprocess.Popen], timeout: float
) -> list[subprocess.CompletedProcess]:
    """Each of ``procs`` (started with pipes) run to its end, its output
    read; past ``timeout`` seconds for one, every one is killed and reaped
    and ``subprocess.TimeoutExpired`` raised."""
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.communicate()  # reap it and close its pipes
            raise
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results
