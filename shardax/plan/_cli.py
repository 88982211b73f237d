"""``shardax plan``: the fastest layouts of a model on a cluster, as a table,
and the chosen one written as a run config."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import click

from ..errors import PlanError

__all__ = ["plan_command"]

# Well-known shapes, as Hugging Face configs (built on meta: no download).
KNOWN_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("gpt2", {"n_layer": 12, "n_embd": 768, "n_head": 12}),
    "gpt3-175b": ("gpt2", {"n_layer": 96, "n_embd": 12288, "n_head": 96, "n_positions": 2048,
                           "vocab_size": 51200}),
    "llama-3-8b": ("llama", {"hidden_size": 4096, "intermediate_size": 14336,
                             "num_hidden_layers": 32, "num_attention_heads": 32,
                             "num_key_value_heads": 8, "vocab_size": 128256}),
    "llama-3-70b": ("llama", {"hidden_size": 8192, "intermediate_size": 28672,
                              "num_hidden_layers": 80, "num_attention_heads": 64,
                              "num_key_value_heads": 8, "vocab_size": 128256}),
    "llama-3-405b": ("llama", {"hidden_size": 16384, "intermediate_size": 53248,
                               "num_hidden_layers": 126, "num_attention_heads": 128,
                               "num_key_value_heads": 8, "vocab_size": 128256}),
}  # fmt: skip


def load_model(spec: str) -> Any:
    """The model ``spec`` names, built on ``meta``: a known name
    (:data:`KNOWN_MODELS`), a Hugging Face ``config.json`` (or its folder),
    or ``FILE.py:FUNCTION`` / ``module:FUNCTION`` returning a module."""
    import torch

    with torch.device("meta"):
        if spec in KNOWN_MODELS:
            kind, kwargs = KNOWN_MODELS[spec]
            return _hf_model(kind, kwargs)
        path = Path(spec)
        if path.name == "config.json" or (path.is_dir() and (path / "config.json").exists()):
            from transformers import AutoConfig, AutoModelForCausalLM

            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))
        if ":" in spec:
            where, _, name = spec.rpartition(":")
            return getattr(_module(where), name)()
    raise PlanError(
        f"--model {spec!r}: give a known model ({', '.join(KNOWN_MODELS)}), a Hugging Face "
        "config.json (or its folder), or FILE.py:FUNCTION returning the model"
    )


def _hf_model(kind: str, kwargs: dict[str, Any]) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(**kwargs))
    return LlamaForCausalLM(LlamaConfig(**kwargs))


def _module(where: str) -> Any:
    if where.endswith(".py"):
        path = Path(where)
        if not path.exists():
            raise PlanError(f"--model: no file {where}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules.setdefault(path.stem, module)
        sys.path.insert(0, str(path.parent.resolve()))
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        finally:
            sys.path.pop(0)
        return module
    return importlib.import_module(where)


def _ints(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"a comma list of integers, e.g. 1,2,4; got {value!r}") from None


@click.command("plan")
@click.option(
    "--model",
    "model_spec",
    required=True,
    help="A known model (llama-3-8b, llama-3-70b, llama-3-405b, gpt3-175b, gpt2), a "
    "Hugging Face config.json, or FILE.py:FUNCTION returning the model.",
)
@click.option(
    "--cluster",
    "cluster_spec",
    default="this-machine",
    help="a100-80gb, h100, h200, this-machine[:RANKS] or an hjson file.",
)
@click.option("--nodes", type=int, help="Nodes of the cluster (default: the cluster's).")
@click.option("--batch", type=int, required=True, help="Global batch, sequences per step.")
@click.option("--seq", type=int, required=True, help="Tokens per sequence.")
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]), default="bf16")
@click.option(
    "--memory",
    "memory_gib",
    type=float,
    help="GiB per device the plan may use (default: the device's).",
)
@click.option("--attention", type=click.Choice(["flash", "materialized"]), default="flash")
@click.option("--tp", help="Tensor-parallel degrees to try, e.g. 1,2,4,8.")
@click.option("--pp", help="Pipeline degrees to try.")
@click.option("--zero", default="0,1,2,3", show_default=True, help="ZeRO stages to try.")
@click.option(
    "--data",
    default="flat",
    show_default=True,
    help="How data ranks across nodes split the state: flat, hsdp, zeropp (comma-separated).",
)
@click.option("--top", type=int, default=5, show_default=True, help="Plans shown.")
@click.option("--why", is_flag=True, help="Every part of the best plan's time and memory.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the best plan's run config (hjson) here.",
)
def plan_command(
    model_spec: str,
    cluster_spec: str,
    nodes: int | None,
    batch: int,
    seq: int,
    precision: str,
    memory_gib: float | None,
    attention: str,
    tp: str | None,
    pp: str | None,
    zero: str,
    data: str,
    top: int,
    why: bool,
    out: Path | None,
) -> None:
    """The fastest layouts of a model on a cluster: per-rank memory by role,
    the step split into compute, exposed communication and bubble,
    tokens/s, TFLOP/s and MFU (docs/plan.md).

    \b
      shardax plan --model llama-3-70b --cluster h100 --nodes 64 --batch 1024 --seq 8192
      shardax plan --model examples/gpt.py:small --cluster this-machine:2 --batch 16 --seq 128 \\
          --precision fp32 --out plan.hjson
    """  # fmt: skip
    from . import Cluster, Space, search

    model = load_model(model_spec)  # first: a bad name fails before a cluster is measured
    cluster = Cluster.load(cluster_spec)
    if nodes is not None:
        cluster = cluster.with_nodes(nodes)
    space = Space(tp=_ints(tp), pp=_ints(pp), zero=_ints(zero), data=tuple(data.split(",")))
    memory = memory_gib * 2**30 if memory_gib is not None else None
    ranking = search(model, cluster, batch=batch, seq=seq, space=space, precision=precision,
                     memory=memory, attention=attention, top=top)  # fmt: skip
    click.echo(f"{cluster.name}: {cluster.world_size} devices; batch {batch} x {seq} tokens")
    click.echo(str(ranking))
    if why:
        click.echo("\n" + ranking.why(0))
    if out is not None:
        out.write_text(ranking.config_text(0))
        click.echo(f"wrote the best plan's run config to {out}")
