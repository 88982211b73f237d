"""Optimizer state on disk (``rules.offload("opt_state", "disk", path=...)``):
on real ranks under ZeRO-3 and ZeRO-1, with plain fp32 params and with
bf16 params over fp32 master weights, by the fused step (streamed in waves,
several per step here) and by ``optim.step``: the losses and params of the
run that keeps the state in memory, bit for bit, and the state still on
disk after every step, its files gone from the folder; bad settings named."""

from __future__ import annotations

import os

import pytest
import torch
from _dist import run_ranks
from _tiny import VOCAB, example_gpt

import shardax as sx
from shardax.optim import _native
from shardax.shard._memory import allocate, is_disk, kind_of, prefetch, release

OPT = ("opt_state",)
BOTH = ("params", "opt_state")
CASES = [
    (3, "fused", torch.float32, OPT),
    (3, "step", torch.float32, OPT),
    (1, "fused", torch.float32, OPT),
    (3, "fused", torch.bfloat16, OPT),
    (3, "fused", torch.float32, BOTH),  # ZeRO-3's shards on disk too
    (3, "step", torch.bfloat16, BOTH),
    (1, "step", torch.float32, BOTH),  # ZeRO-1: every rank's whole params on disk
    (3, "fused", torch.float32, ("params", "grads", "opt_state")),  # reduced grads too
    (2, "fused", torch.float32, ("grads", "opt_state")),
]
IDS = ["zero3-fused", "zero3-step", "zero1-fused", "zero3-bf16-master", "zero3-params",
       "zero3-params-bf16-step", "zero1-params-step", "zero3-all", "zero2-grads"]  # fmt: skip


def _state_tensors(state):
    import optree

    leaves = optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, sx.Sharded))
    return [x.local for x in leaves if isinstance(x, sx.Sharded)]


def _train(zero, how, dtype, roles, folder):
    mesh = sx.Mesh({"dp": 2})
    me = mesh.axis_index("dp")
    _native.WAVE = 4096  # several waves a step, leaves split across them
    batches = torch.randint(0, VOCAB, (5, 4, 8), generator=torch.Generator().manual_seed(1))
    runs = []
    for where in (None, folder):
        torch.manual_seed(0)
        model = example_gpt()
        rules = sx.rules.zero(zero, "dp")
        if where is not None:
            rules += sx.rules.offload(roles, "disk", path=f"{where}/rank{me}")
        params = sx.shard(sx.params_of(model), mesh, rules)
        opt = sx.optim.adamw(1e-2, weight_decay=0.1)
        if dtype != torch.float32:
            params = {k: v.astype(dtype) for k, v in params.items()}  # on disk if it was
            opt = sx.optim.with_master_weights(opt)
        state = opt.init(params)
        stepper = sx.optim.fused_step(opt)
        losses, on_disk = [], []
        for x in batches:
            mine = x[2 * me : 2 * me + 2]

            def loss_fn(p, x, model=model):
                logits = sx.apply(model, p, x)
                return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten())

            loss, grads = sx.value_and_grad(loss_fn)(params, mine)
            grads_on_disk = [is_disk(g.local) for g in grads.values() if g.local.numel() > 1]
            if how == "fused":
                params, state = stepper.step(params, grads, state)
            else:
                params, state = sx.optim.step(opt, grads, state, params)
            losses.append(loss.item())
            tensors = _state_tensors(state)
            if "params" in roles or where is None:
                tensors += [v.local for v in params.values()]
            on_disk.append(all(is_disk(t) for t in tensors if t.numel() > 1))
            if where is not None and "grads" in roles:
                on_disk[-1] = on_disk[-1] and all(grads_on_disk)
            elif where is None:
                on_disk[-1] = on_disk[-1] or any(grads_on_disk)
        files = os.listdir(f"{where}/rank{me}") if where is not None else []
        gathered = {k: sx.gather(v).float() for k, v in params.items()}
        runs.append((losses, gathered, on_disk, files))
    return runs


@pytest.mark.parametrize(("zero", "how", "dtype", "roles"), CASES, ids=IDS)
def test_state_on_disk_trains_as_in_memory(tmp_path, zero, how, dtype, roles):
    for memory, disk in run_ranks(_train, zero, how, dtype, roles, str(tmp_path)):
        assert disk[0] == memory[0]
        for k, v in memory[1].items():
            assert torch.equal(disk[1][k], v), k
        assert all(disk[2]) and not any(memory[2])  # every moment on disk after every step
        assert disk[3] == []  # unlinked as made: nothing left in the folder


def test_streamed_waves_equal_one_launch():
    """Leaves split across waves, a wave spanning leaves: the native
    kernel's results are the same, and the disk buffers keep them."""
    lib = _native.native()
    if lib is None:
        pytest.skip("no native kernels here (no compiler)")
    torch.manual_seed(0)
    sizes = [5000, 3, 9000, 1]
    grads = [torch.randn(n) for n in sizes]
    results = []
    for wave in (None, 1024):
        kind = "device" if wave is None else "disk:" + os.path.join(os.getcwd(), ".offload-test")
        params = [torch.linspace(-1, 1, n) for n in sizes]
        mu = [allocate((n,), torch.float32, kind) for n in sizes]
        nu = [allocate((n,), torch.float32, kind) for n in sizes]
        scalars = (0.1, 0.999, 0.001, (1 - 0.999) ** 0.5, 1e-8, 1 / 0.1, 0.01, -1e-2)
        for _ in range(3):
            if wave is None:
                lib.launch("sx_adamw", mu, nu, grads, params, params, None, True, scalars)
            else:
                _native.stream(
                    lib, "sx_adamw", mu, nu, grads, params, params, None, True, scalars, wave
                )
        results.append((params, mu, nu))
    for a, b in zip(*results, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    os.rmdir(os.path.join(os.getcwd(), ".offload-test"))


def _resident_kib(t):
    """The KiB of disk tensor ``t``'s mapping that sit in this process."""
    ptr = t.data_ptr()
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= ptr < end
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


def _zero3_gpt(roles, folder):
    """The example GPT under ZeRO-3 on dp=2, ``roles`` on disk in ``folder``:
    ``(mesh, this rank, model, rules, params)``."""
    mesh = sx.Mesh({"dp": 2})
    me = mesh.axis_index("dp")
    torch.manual_seed(0)
    model = example_gpt()
    rules = sx.rules.zero(3, "dp") + sx.rules.offload(roles, "disk", path=f"{folder}/s{me}")
    return mesh, me, model, rules, sx.shard(sx.params_of(model), mesh, rules)


def _resident_after_a_step(folder):
    _, me, model, _, params = _zero3_gpt("params", folder)
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(me))
    shards = {k: v.local for k, v in params.items()}
    before = sum(_resident_kib(t) for t in shards.values())
    touched = sum(_resident_kib(t) for t in shards.values() if t.sum() is not None)
    sx.value_and_grad(lambda p: sx.apply(model, p, x).square().mean())(params)
    return before, touched, {k: _resident_kib(t) for k, t in shards.items()}


def test_shards_on_disk_leave_the_process_once_gathered(tmp_path):
    """Under value_and_grad too: forward and backward's gathers read the
    shards, then hand their pages back to the files."""
    for before, touched, after in run_ranks(_resident_after_a_step, str(tmp_path)):
        assert before == 0 and touched > 0 and len(after) > 3
        assert after == dict.fromkeys(after, 0)


def test_a_disk_tensor_keeps_what_is_written_when_released(tmp_path):
    t = allocate((3, 2048), torch.float32, f"disk:{tmp_path}")
    assert is_disk(t) and os.listdir(tmp_path) == [] and t.sum() == 0
    t[1].fill_(2.5)
    release(t)  # out of the process, into the file
    prefetch(t, 2048, 2048)
    assert t[1].sum().item() == 2.5 * 2048 and t[0].sum() == 0


def test_disk_tensors_hold_no_file_descriptors(tmp_path):
    """A model's thousands of tensors on disk stay under a 1024-file limit."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs Linux's /proc/self/fd")
    before = len(os.listdir("/proc/self/fd"))
    tensors = [allocate((1024,), torch.float32, f"disk:{tmp_path}") for _ in range(64)]
    assert len(os.listdir("/proc/self/fd")) == before and os.listdir(tmp_path) == []
    assert all(is_disk(t) for t in tensors)


def test_a_copy_of_a_disk_tensor_is_not_one(tmp_path):
    """``torch.save`` and load, deepcopy: the copy carries the disk mark along
    but lives in RAM — it is not handed back (that would drop its values)."""
    import copy
    import io

    t = allocate((1 << 16,), torch.float32, f"disk:{tmp_path}")
    t.fill_(1.0)
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    del t
    for c in (
        torch.load(buffer),
        copy.deepcopy(allocate((1 << 16,), torch.float32, f"disk:{tmp_path}")),
    ):
        c.fill_(1.0)
        release(c)
        assert not is_disk(c) and kind_of(c) == "device" and c.sum() == 1 << 16


def test_a_disk_tensors_blocks_are_taken_when_it_is_made(tmp_path):
    """Not a sparse file: a full disk is a clear error at allocation, not a
    SIGBUS at the first write into a hole."""
    if not os.path.isdir("/proc/self/map_files"):
        pytest.skip("needs Linux's /proc/self/map_files")
    t = allocate((3, 4096), torch.float32, f"disk:{tmp_path}")
    start = t.data_ptr()
    end = start + t._shardax_map[1]
    assert os.stat(f"/proc/self/map_files/{start:x}-{end:x}").st_blocks * 512 >= t.nbytes


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: sx.rules.offload("opt_state", "disk"), r"needs the folder for the files: path="),
        (lambda: sx.rules.offload("opt_state", "nvme"), r"'device', 'host' or 'disk:PATH'"),
        (lambda: sx.rules.offload("master", "disk", path="/tmp/x"), r"places the roles \('params', 'grads', 'opt_state'\)"),
        (lambda: sx.rules.offload("opt_state", "host", path="/tmp/x"), r"path= is for kind 'disk'"),
        (
            lambda: allocate((4,), torch.float32, "disk:/proc/shardax-cannot-write"),
            r"'disk:/proc/shardax-cannot-write': cannot create a file there",
        ),
        (  # a GPU rank's tensors: a clear refusal, not a device mismatch later
            lambda: allocate((4,), torch.float32, "host", device="cuda"),
            r"memory kind .host. for a tensor on cuda: offload runs on CPU ranks only so far",
        ),
    ],
)  # fmt: skip
def test_bad_offload_settings_are_named(call, match):
    with pytest.raises(sx.ShardingError, match=match):
        call()


def _checkpoint(folder):
    mesh, _, _, rules, params = _zero3_gpt("opt_state", folder)
    opt = sx.optim.adamw(1e-2)
    state = opt.init(params)
    grads = {k: v.with_local(torch.full_like(v.local, 0.5)) for k, v in params.items()}
    params, state = sx.optim.fused_step(opt).step(params, grads, state)
    sx.ckpt.save(f"{folder}/ckpt", {"params": params, "opt_state": state})
    with torch.device("meta"):  # a target of shapes only: loaded where its placement says
        meta = sx.shard(sx.params_of(example_gpt()), mesh, rules)
    out = []
    for target_params in (params, meta):
        target = {"params": target_params, "opt_state": opt.init(target_params)}
        loaded = sx.ckpt.load(f"{folder}/ckpt", target)["opt_state"]
        pairs = zip(_state_tensors(state), _state_tensors(loaded), strict=True)
        out.append([(torch.equal(a, b), is_disk(b) or b.numel() <= 1) for a, b in pairs])
    return out


def test_a_checkpoint_of_state_on_disk_loads_back_onto_disk(tmp_path):
    """Saved from its files, loaded into the target's files: the same
    values, and the loaded moments on disk, as the target's were — or, for
    a target on ``meta``, as its placement says."""
    for rank in run_ranks(_checkpoint, str(tmp_path)):
        for target in rank:
            assert target and all(equal and disk for equal, disk in target)


def _saved_in_the_background(folder):
    """A background save of disk state snapshots it into files, not RAM:
    the checkpoint holds the values of the moment it was taken."""
    mesh = sx.Mesh({"dp": 2})
    me = mesh.axis_index("dp")
    rules = sx.rules.zero(3, "dp") + sx.rules.offload(BOTH, "disk", path=f"{folder}/s{me}")
    params = sx.shard({"w": torch.arange(4096.0).view(64, 64)}, mesh, rules)
    opt = sx.optim.adamw(1e-2)
    state = opt.init(params)
    params, state = sx.optim.fused_step(opt).step(params, {"w": params["w"]}, state)
    handle = sx.ckpt.save_async(f"{folder}/ckpt", {"params": params, "opt_state": state})
    before = params["w"].local.clone()
    params["w"].local.add_(1.0)  # the next step writes the files in place meanwhile
    handle.wait()
    loaded = sx.ckpt.load(f"{folder}/ckpt", {"params": params, "opt_state": state})
    return torch.equal(loaded["params"]["w"].local, before), is_disk(loaded["params"]["w"].local)


def test_a_background_save_of_disk_state_keeps_the_values_it_was_given(tmp_path):
    for same, disk in run_ranks(_saved_in_the_background, str(tmp_path)):
        assert same and disk


def _peak_growth_mib(fn):
    """How far this process's resident memory rose above where it stood
    while ``fn()`` ran (``VmHWM`` reset first), in MiB."""

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak back to the current resident memory
    before = status("VmRSS:")
    fn()
    return status("VmHWM:") - before


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")
def test_a_save_reads_state_on_disk_one_piece_at_a_time(tmp_path):
    """``save`` and ``save_async`` hand each piece of disk state back to its
    file once it is written (or snapshot): the process holds about one
    piece of it at a time, not all 32 MiB (which a rank's state on disk
    would then cost again at every checkpoint)."""
    pieces, piece_mib = 8, 4  # 2**20 float32 a piece
    folder = f"disk:{tmp_path}/s"
    state = {f"m{i}": allocate((2**20,), torch.float32, folder) for i in range(pieces)}
    for i, t in enumerate(state.values()):
        t.fill_(float(i))
        release(t)
    grew = _peak_growth_mib(lambda: sx.ckpt.save(tmp_path / "a", state))
    grew_async = _peak_growth_mib(lambda: sx.ckpt.save_async(tmp_path / "b", state).wait())
    # at most a piece and its snapshot in the process at once (save_async), plus the
    # writer's small buffers: under 3 pieces; all 8 without the hand-back
    assert grew < 3 * piece_mib and grew_async < 3 * piece_mib, (grew, grew_async)
    assert all(_resident_kib(t) == 0 for t in state.values())
    loaded = sx.ckpt.load(tmp_path / "b")
    assert [float(v[0]) for v in loaded.values()] == [float(i) for i in range(pieces)]
