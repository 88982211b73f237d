"""The planner's cluster description: presets that round-trip through data,
hjson and repr; units in files; bad input refused with the field and the
fix; and this host measured for real (numbers checked only for sanity)."""

from __future__ import annotations

import json

import attrs
import pytest

from shardax.errors import USER_ERRORS, PlanError
from shardax.plan import PRESETS, Cluster, Link, _probe, this_machine
from shardax.plan._cluster import A100_ACHIEVABLE, DTYPES, quantity

GiB = 2**30


# -- presets -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_round_trips(name):
    c = PRESETS[name]
    assert c.name == name and c.nodes == 1 and c.devices_per_node == 8
    assert Cluster.load(name) is c
    assert Cluster.from_text(c.to_hjson(), name) == c
    assert Cluster.from_dict(c.to_dict()) == c
    assert Cluster.from_text(json.dumps(c.to_dict())) == c  # JSON is hjson
    assert eval(repr(c), {"Cluster": Cluster, "Link": Link}) == c
    assert hash(c) == hash(eval(repr(c), {"Cluster": Cluster, "Link": Link}))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_with_nodes(name):
    c = PRESETS[name].with_nodes(4)
    assert (c.nodes, c.world_size) == (4, 32)
    assert c == attrs.evolve(PRESETS[name], nodes=4) != PRESETS[name]
    assert Cluster.from_text(c.to_hjson()) == c


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_is_sane(name):
    c = PRESETS[name]
    assert 70 * GiB < c.device_memory < 150 * GiB
    assert 0 < c.reserved_memory < c.device_memory
    assert set(c.peak_flops) == set(DTYPES)
    assert (
        c.peak_flops["fp32"] < c.peak_flops["tf32"] < c.peak_flops["bf16"] == c.peak_flops["fp16"]
    )
    assert c.inter.bandwidth < c.intra.bandwidth and c.inter.latency > c.intra.latency
    assert c.host_bandwidth < c.memory_bandwidth and c.overlap == 1.0


def test_a100_numbers():
    a100 = PRESETS["a100-80gb"]
    assert a100.device_memory == 80 * GiB  # 81920 MiB, as nvidia-smi reports
    assert a100.flops("bf16") == 312e12 * A100_ACHIEVABLE
    assert a100.flops("fp32") == a100.flops("tf32") == 156e12 * A100_ACHIEVABLE
    assert a100.flops("fp32", tf32=False) == 19.5e12 * A100_ACHIEVABLE
    # a ring all-reduce of 1 GiB over the node: 14 steps, 7/4 GiB per rank
    assert a100.intra.time(2 * 7 / 8 * GiB, steps=14) == pytest.approx(
        14 * 3.4e-6 + 1.75 * GiB / 230e9
    )


def test_flops_of_unknown_dtype_names_the_known_ones():
    with pytest.raises(PlanError, match=r"h100 has no matmul rate for 'bf61' \(did you mean "
                       r"'bf16'\?\); it knows fp32, tf32, bf16, fp16"):  # fmt: skip
        PRESETS["h100"].flops("bf61")


# -- units -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "unit", "value"),
    [
        ("80 GiB", "B", 80 * GiB),
        ("80GB", "B", 80e9),
        ("1.5 TiB", "B", 1.5 * 2**40),
        ("512", "B", 512),
        (1e9, "B/s", 1e9),
        ("600 GB/s", "B/s", 600e9),
        ("200 Gb/s", "B/s", 25e9),  # bits
        ("2 MiB/s", "B/s", 2 * 2**20),
        ("312 TFLOP/s", "FLOP/s", 312e12),
        ("19.5 TFLOPS", "FLOP/s", 19.5e12),
        ("5 us", "s", 5e-6),
        ("5 µs", "s", 5e-6),
        ("3 ms", "s", 3e-3),
        ("20ns", "s", 20e-9),
        (" 2 s ", "s", 2.0),
    ],
)
def test_quantity_reads_units(text, unit, value):
    assert quantity(text, unit) == pytest.approx(value, rel=1e-15)


@pytest.mark.parametrize(
    ("text", "unit", "words"),
    [
        ("80 GB/s", "B", "bytes, e.g. '80 GiB'"),
        ("80 GB", "B/s", "bytes/s, e.g. '600 GB/s'"),
        ("5 parsecs", "s", "seconds, e.g. '5 us'"),
        ("fast", "FLOP/s", "FLOP/s, e.g. '312 TFLOP/s'"),
        (True, "B", "bytes"),
        ("5 us", "s/B", "None"),
    ],
)
def test_quantity_refuses_other_units(text, unit, words):
    with pytest.raises(PlanError, match=f"x: cannot read {text!r} as {words}".replace("(", r"\(")):
        quantity(text, unit, "x")


def test_cluster_file_with_units(tmp_path):
    path = tmp_path / "mine.hjson"
    path.write_text(
        """{
          // two nodes of four GPUs; hjson: one quoteless value a line
          name: mine
          nodes: 2
          devices_per_node: 4
          device_memory: 24 GiB
          reserved_memory: 1 GiB
          peak_flops: {
            bf16: 165 TFLOP/s
            fp32: 82.6 TFLOPS
          }
          achievable: 0.6
          memory_bandwidth: 1 TB/s
          intra: {bandwidth: "20 GB/s", latency: "8 us"}
          inter: {bandwidth: "100 Gb/s", latency: "20 us"}
          host_bandwidth: 20 GB/s
          disk_bandwidth: 3 GB/s
          host_memory: 512 GiB
          overlap: 0.5
        }"""
    )
    c = Cluster.load(str(path))
    assert (c.world_size, c.device_memory, c.reserved_memory) == (8, 24 * GiB, GiB)
    assert c.flops("fp32") == pytest.approx(82.6e12 * 0.6)
    assert c.inter == Link(bandwidth=12.5e9, latency=20e-6)
    assert Cluster.from_text(c.to_hjson()) == c
    assert "device_memory: 25769803776  // 24 GiB" in c.to_hjson()


# -- bad input ---------------------------------------------------------------------


BAD = [
    # (field, value, the message names the field, the rule and the fix)
    ("memory_bandwidth", -5, "memory_bandwidth must be positive: bytes/s, e.g. '600 GB/s'; got -5"),
    ("host_bandwidth", "25 GB", "host_bandwidth: cannot read '25 GB' as bytes/s, e.g. '600 GB/s'"),
    (
        "achievable",
        1.5,
        "achievable must be in (0, 1]: the fraction of peak a large matmul "
        "reaches, e.g. 0.7; got 1.5",
    ),
    ("overlap", -0.1, "overlap must be in [0, 1]: the share of communication"),
    ("nodes", 0, "nodes must be >= 1: a whole number, e.g. 8; got 0"),
    ("devices_per_node", 2.5, "devices_per_node must be >= 1: a whole number, e.g. 8; got 2.5"),
    ("device_memory", float("inf"), "device_memory must be positive: bytes, e.g. '80 GiB'"),
    (
        "reserved_memory",
        100 * GiB,
        "reserved_memory (100 GiB) must be less than device_memory "
        "(80 GiB): nothing would be left for tensors; lower reserved_memory or raise device_memory",
    ),
    ("name", "", "name is a non-empty text, e.g. 'a100'; got ''"),
    ("peak_flops", {}, "peak_flops maps dtypes to FLOP/s, e.g. {bf16: '312 TFLOP/s'}; got {}"),
    (
        "peak_flops",
        {"bf61": 1e12},
        "unknown key peak_flops.bf61 (did you mean 'bf16'?); "
        "peak_flops takes fp32, tf32, bf16, fp16",
    ),
    ("peak_flops", {"bf16": 0}, "peak_flops.bf16 must be positive: FLOP/s, e.g. '312 TFLOP/s'"),
    ("intra", {"bandwidth": -1, "latency": 0}, "intra.bandwidth must be positive: bytes/s"),
    (
        "inter",
        {"bandwidth": 1e9, "latency": -1},
        "inter.latency must be >= 0: seconds, e.g. '5 us'",
    ),
    (
        "intra",
        {"bandwith": 1e9, "latency": 0},
        "unknown key intra.bandwith (did you mean 'bandwidth'?); intra takes bandwidth, latency",
    ),
    (
        "inter",
        {"bandwidth": 1e9},
        "inter is a link, both keys given: {bandwidth: '230 GB/s', latency: '3.4 us'}",
    ),
    (
        "intra",
        {"bandwidth": 1e9, "latency": 0, "gather_bandwidth": 0},
        "intra.gather_bandwidth must be positive: bytes/s",
    ),
    ("allocator_slack", -0.5, "allocator_slack must be >= 0: the share of the activations"),
    ("allocator_threshold", 0, "allocator_threshold must be >= 1: bytes"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_bad_field_names_it_and_the_fix(field, value, message):
    with pytest.raises(PlanError) as info:
        attrs.evolve(PRESETS["a100-80gb"], **{field: value})
    assert message in str(info.value)
    assert info.value.key_path.split(".")[0] == field


def test_bad_field_in_a_file_names_its_line():
    text = PRESETS["h100"].to_hjson().replace("latency: 9.6e-06", "latency: -1")
    with pytest.raises(PlanError, match=r"^h100.hjson:21: inter.latency must be >= 0"):
        Cluster.from_text(text, "h100.hjson")
    assert text.splitlines()[20].strip().startswith("latency: -1")


def test_unknown_and_missing_keys():
    data = PRESETS["h100"].to_dict()
    with pytest.raises(PlanError, match=r"^x.json: unknown key disk_bw \(did you mean "
                       r"'disk_bandwidth'\?\); the top level takes name, nodes, "):  # fmt: skip
        Cluster.from_dict({**data, "disk_bw": 1}, "x.json")
    del data["inter"], data["achievable"]
    with pytest.raises(PlanError, match=r"^cluster: missing achievable, inter; a cluster needs "
                       r"name, devices_per_node, device_memory, peak_flops, "):  # fmt: skip
        Cluster.from_dict(data)
    with pytest.raises(PlanError, match=r"^cluster: a cluster is an object of fields; got \[1\]"):
        Cluster.from_dict([1])  # type: ignore[arg-type]


def test_bad_text():
    with pytest.raises(PlanError, match=r"^c.hjson:1:\d+: not valid hjson"):
        Cluster.from_text("{name: [", "c.hjson")
    with pytest.raises(PlanError, match=r"^c.hjson:3: duplicate key 'name': keep one"):
        Cluster.from_text("{\nname: a\nname: b\n}", "c.hjson")


def test_load_names_the_choices(tmp_path):
    with pytest.raises(PlanError, match=r"unknown cluster 'h10' \(did you mean 'h100'\?\): give a "
                       r"preset \(a100-80gb, h100, h200\), 'this-machine' or "):  # fmt: skip
        Cluster.load("h10")
    with pytest.raises(PlanError, match=r"cannot read cluster file .*none\.hjson: No such file"):
        Cluster.load(str(tmp_path / "none.hjson"))
    with pytest.raises(PlanError, match=r"'this-machine:two': give ranks as a whole number"):
        Cluster.load("this-machine:two")


def test_load_this_machine_passes_the_ranks(monkeypatch):
    asked = []
    monkeypatch.setattr(_probe, "this_machine", lambda ranks: asked.append(ranks) or "probed")
    assert Cluster.load("this-machine") == Cluster.load("this-machine:4") == "probed"
    assert asked == [2, 4]


def test_plan_error_is_a_user_error():
    assert issubclass(PlanError, ValueError) and PlanError in USER_ERRORS
    for bad in (0, True, 1.5):
        with pytest.raises(PlanError, match=r"ranks is a whole number >= 1, e.g\. 2"):
            this_machine(bad)  # type: ignore[arg-type]


# -- this machine, measured ----------------------------------------------------------


@pytest.fixture(scope="module")
def measured():
    return this_machine(2, quick=True)


def test_this_machine_is_sane(measured):
    c = measured
    assert (c.name, c.nodes, c.devices_per_node, c.overlap) == ("this-machine", 1, 2, 0.0)
    assert 0.05 <= c.achievable <= 1.0  # a transformer block's share of the matmul rate
    assert 1e8 < c.flops("fp32") < 1e13
    assert set(c.peak_flops) <= {"fp32", "bf16"}
    assert 1e8 < c.memory_bandwidth < 1e12 and c.host_bandwidth == c.memory_bandwidth / 2
    for link in (c.intra, c.inter):
        assert 0 < link.bandwidth < 1e12 and 0 <= link.latency < 0.1
    assert 50 * 2**20 < c.reserved_memory < 2 * GiB
    assert c.device_memory == c.host_memory // 2 and c.host_memory > 2**30
    assert c.disk_bandwidth > 1e6
    for link in (c.intra, c.inter):  # a ZeRO gather into a new tensor: its own bandwidth
        assert 0 < link.gather < 1e12 and link.gather_bandwidth is not None
    assert c.allocator_slack >= 0 and c.allocator_threshold == 4 * 2**20
    assert Cluster.from_text(c.to_hjson()) == c


def test_a_link_with_its_own_gather_bandwidth_round_trips():
    link = Link(bandwidth="8 GB/s", latency="30 us", gather_bandwidth="1.4 GB/s")
    assert eval(repr(link)) == link and link.gather == 1.4e9
    assert Link(bandwidth=8e9, latency=0).gather == 8e9  # none given: the all-reduce's
    cluster = attrs.evolve(PRESETS["h100"], intra=link, allocator_slack=0.4,
                           allocator_threshold="4 MiB")  # fmt: skip
    assert Cluster.from_text(cluster.to_hjson()) == cluster
    assert "gather_bandwidth" not in PRESETS["h100"].to_dict()["intra"]
    assert "allocator_threshold" not in PRESETS["h100"].to_dict()  # None: left out
