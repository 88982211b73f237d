"""Checkpoints hold the model's own names and shapes on any mesh, and come
back as the model's own files: ``consolidate`` of a checkpoint saved with
``sx.ckpt.model_metadata(model)`` loads with ``load_state_dict(strict=True)``
(tied weights under each name, non-persistent buffers left out), and
``consolidate(hf=True)`` gives a folder that ``from_pretrained`` loads —
for the example GPT, Hugging Face GPT-2 (tied head, packed ``c_attn`` split
block by block) and Llama; and after 3 steps of ZeRO-3 on dp=2 × tp=2 the
Hugging Face model's logits equal the sharded model's."""

from __future__ import annotations

import _tiny as tiny
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from _dist import run_ranks

import shardax as sx

VOCAB, SEQ = tiny.VOCAB, tiny.SEQ


def gpt2() -> torch.nn.Module:
    return tiny.gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)


MODELS = {
    "gpt": (tiny.example_gpt, sx.rules.GPT_NAMES),
    "hf-gpt2": (gpt2, sx.rules.GPT2_NAMES),
    "hf-llama": (tiny.llama, sx.rules.LLAMA_NAMES),
}


def _logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("family", list(MODELS))
def test_the_consolidated_file_loads_strictly_into_the_model(family, tmp_path):
    make, names = MODELS[family]
    torch.manual_seed(0)
    model = make().eval()
    mesh = sx.Mesh({"dp": 1, "tp": 1})
    params = sx.shard(
        sx.params_of(model), mesh, sx.rules.zero(3) + sx.rules.megatron("tp", names=names)
    )
    ckpt = sx.ckpt.save(tmp_path / "c", {"params": params}, metadata=sx.ckpt.model_metadata(model))
    out = sx.ckpt.consolidate(ckpt, tmp_path / "model.safetensors", only="params")
    torch.manual_seed(1)
    fresh = make().eval()
    fresh.load_state_dict(safetensors.torch.load_file(out), strict=True)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    x = torch.randint(0, VOCAB, (2, SEQ))
    assert torch.equal(_logits(fresh, x), _logits(model, x))
    if family == "gpt":
        with pytest.raises(sx.CheckpointError, match="records no Hugging Face config"):
            sx.ckpt.consolidate(ckpt, tmp_path / "hf", only="params", hf=True)
        return
    from transformers import AutoModelForCausalLM

    folder = sx.ckpt.consolidate(ckpt, tmp_path / "hf", only="params", hf=True)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded).__name__ == type(model).__name__
    torch.testing.assert_close(_logits(loaded, x), _logits(model, x), rtol=0, atol=1e-6)


def _train_save_consolidate(path: str) -> tuple[torch.Tensor, list[float]]:
    """3 AdamW steps of GPT-2 under ZeRO-3 and Megatron on dp=2 × tp=2, then
    a checkpoint; rank 0 consolidates it as a Hugging Face folder. Returns
    the sharded model's logits on a fixed batch (whole: the head's gathered)."""
    mesh = sx.Mesh({"dp": 2, "tp": 2})
    rules = sx.rules.zero(3) + sx.rules.megatron("tp", names=sx.rules.GPT2_NAMES)
    torch.manual_seed(0)
    model = gpt2()
    params = sx.shard(sx.params_of(model), mesh, rules)
    opt = sx.optim.adamw(1e-2)
    opt_state = opt.init(params)

    def run(p: dict, x: torch.Tensor) -> torch.Tensor:
        return sx.apply(model, p, x, use_cache=False).logits  # the whole vocabulary's

    def loss_fn(p: dict, x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(run(p, x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())

    grad_fn = sx.value_and_grad(loss_fn)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        x = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        x = x[2 * mesh.axis_index("dp") : 2 * mesh.axis_index("dp") + 2]  # this dp rank's half
        loss, grads = grad_fn(params, x)
        params, opt_state = sx.optim.fused_step(opt).step(params, grads, opt_state)
        losses.append(float(loss))
    sx.ckpt.save(path + "/c", {"params": params}, metadata=sx.ckpt.model_metadata(model))
    if mesh.rank == 0:
        sx.ckpt.consolidate(path + "/c", path + "/hf", only="params", hf=True)
    sx.collectives.barrier(mesh=mesh)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        logits = run(params, x)
    return logits, losses


@pytest.mark.world_size(4)
def test_gpt2_trained_on_dp2_tp2_loads_into_hugging_face(tmp_path):
    from transformers import AutoModelForCausalLM

    results = run_ranks(_train_save_consolidate, str(tmp_path), world_size=4)
    index = sx.ckpt.read_index(tmp_path / "c")
    c_attn = index.leaves["params.transformer.h.0.attn.c_attn.weight"]
    assert c_attn.shape == (16, 48)  # the model's own shape, split block by block
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        hf_logits = loaded(x).logits
    for logits, losses in results:
        assert losses[-1] < losses[0]
        torch.testing.assert_close(hf_logits, logits, rtol=0, atol=1e-6)
    assert torch.isfinite(F.log_softmax(hf_logits, -1)).all()


def test_the_command_line_writes_the_hugging_face_folder(tmp_path):
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from shardax.cli import main

    torch.manual_seed(0)
    model = gpt2().eval()
    mesh = sx.Mesh({"tp": 1})
    params = sx.shard(sx.params_of(model), mesh, sx.rules.megatron("tp", names=sx.rules.GPT2_NAMES))
    ckpt = sx.ckpt.save(tmp_path / "c", {"params": params}, metadata=sx.ckpt.model_metadata(model))
    done = CliRunner().invoke(
        main,
        ["ckpt", "consolidate", str(ckpt), str(tmp_path / "hf"), "--only", "params", "--hf", "-q"],
    )
    assert done.exit_code == 0, done.output
    assert f"wrote {tmp_path / 'hf'}" in done.output
    x = torch.randint(0, VOCAB, (2, SEQ))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=1e-6)
    plain = sx.ckpt.save(tmp_path / "p", {"params": params})  # no model metadata
    done = CliRunner().invoke(
        main, ["ckpt", "consolidate", str(plain), str(tmp_path / "hf2"), "--hf"]
    )
    assert done.exit_code == 2 and "records no Hugging Face config" in done.output
