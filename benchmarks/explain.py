"""``explain`` at scale (issue 36): the sharding plan of Llama-3-405B on 16,384 abstract ranks.

The model is Hugging Face's ``LlamaForCausalLM`` with Llama-3-405B's
config (d=16384, f=53248, 126 layers, 128 heads, 8 key/value heads,
vocabulary 128256, untied head: 1139 tensors, 405.9B parameters), built on
the meta device — no memory, nothing downloaded. Each case plans it on an
``AbstractMesh`` in one process:

- ``dp2048-tp8-zero3-megatron``: ``{"dp": 2048, "tp": 8}``,
  ``rules.zero(3, "dp") + rules.megatron("tp", names="auto")``;
- ``dp16384-zero3``: ``{"dp": 16384}``, ``rules.zero(3, "dp")``;
- ``plan-16384``: the whole planner, ``sx.plan.search`` of the model on
  2,048 H100 nodes (16,384 GPUs; batch 2048 × 8192 tokens) over the
  default space — every candidate predicted, the best ones exactly (their
  state by ``explain``, their bubble simulated); its rows give the search
  time in ``explain_s`` and the layouts tried in ``leaves``.

Every case runs in a fresh process (a process's peak RSS only grows): it
builds the model, then times ``sx.explain(params, mesh, rules)`` and
``str()`` of the result ``--repeats`` times. One JSON line per case — the
median and every wall time, the RSS before the first ``explain`` and the
peak (``VmHWM``) after the last ``str()``, the plan's per-rank maximum and
training state — then a summary line; a readable table goes to stderr.
It times whichever shardax Python imports, so an older checkout on
``PYTHONPATH`` gives the numbers before a change.

    python benchmarks/explain.py --json explain.json
    python benchmarks/explain.py --smoke       # a tiny Llama on the same meshes, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

CASES = {
    "dp2048-tp8-zero3-megatron": {"dp": 2048, "tp": 8},
    "dp16384-zero3": {"dp": 16384},
    "plan-16384": {"dp": 16384},
}
LLAMA_3_405B = {
    "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
    "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256,
    "tie_word_embeddings": False,
}  # fmt: skip
TINY = {
    "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
    "tie_word_embeddings": False,
}  # fmt: skip


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _rules(case: str) -> Any:
    import shardax as sx

    rules = sx.rules.zero(3, "dp")
    return rules + sx.rules.megatron("tp", names="auto") if "megatron" in case else rules


def measure_plan(config: dict[str, Any], repeats: int, smoke: bool) -> dict[str, Any]:
    """``sx.plan.search`` of the model of ``config`` on 16,384 H100s (2 nodes: smoke)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import shardax as sx

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    cluster = sx.plan.Cluster.load("h100").with_nodes(2 if smoke else 2048)
    space = sx.plan.Space(sp=(1, 2)) if smoke else sx.plan.Space()
    batch, seq = (16, 256) if smoke else (2048, 8192)
    rss_before = _status_mib("VmRSS")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ranking = sx.plan.search(model, cluster, batch=batch, seq=seq, space=space)
        times.append(time.perf_counter() - start)
    peak = _status_mib("VmHWM")
    return {
        "case": "plan-16384",
        "mesh": {"devices": cluster.world_size},
        "ranks": cluster.world_size,
        "leaves": ranking.tried,
        "parameters": sum(p.numel() for p in model.parameters()),
        "explain_s": statistics.median(times),
        "str_s": 0.0,
        "explain_s_all": times,
        "str_s_all": [],
        "rss_before_mib": rss_before,
        "peak_rss_mib": peak,
        "peak_rss_delta_mib": peak - rss_before,
        "summary_lines": str(ranking).splitlines()[2:3] + str(ranking).splitlines()[-1:],
    }


def measure(case: str, config: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Plan the model of ``config`` on ``case``'s mesh in this process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import shardax as sx

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    params = sx.params_of(model)
    mesh = sx.AbstractMesh(CASES[case])
    rss_before = _status_mib("VmRSS")
    explain_s, str_s = [], []
    for _ in range(repeats):
        rules = _rules(case)  # fresh: nothing decided by an earlier run
        start = time.perf_counter()
        plan = sx.explain(params, mesh, rules)
        middle = time.perf_counter()
        text = str(plan)
        explain_s.append(middle - start)
        str_s.append(time.perf_counter() - middle)
    peak = _status_mib("VmHWM")
    roles = dict(plan.roles)
    return {
        "case": case,
        "mesh": CASES[case],
        "ranks": mesh.world_size,
        "leaves": len(plan.rows),
        "parameters": sum(p.numel() for p in params.values()),
        "explain_s": statistics.median(explain_s),
        "str_s": statistics.median(str_s),
        "explain_s_all": explain_s,
        "str_s_all": str_s,
        "rss_before_mib": rss_before,
        "peak_rss_mib": peak,
        "peak_rss_delta_mib": peak - rss_before,
        "max_bytes_per_rank": max(plan.rank_bytes),
        "training_state_max_bytes": {role: max(b) for role, b in roles.items()},
        "summary_lines": text.splitlines()[-2:],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated, of " + ", ".join(CASES)
    )
    parser.add_argument("--repeats", type=int, default=3, help="explain + str() runs per case")
    parser.add_argument("--json", help="also write the lines here, as one JSON document")
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama, 1 repeat: seconds")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # measure this case, print its row
    args = parser.parse_args(argv)
    config = TINY if args.smoke else LLAMA_3_405B
    repeats = 1 if args.smoke else args.repeats
    if args.child == "plan-16384":
        print(json.dumps(measure_plan(config, repeats, args.smoke)))
        return 0
    if args.child:
        print(json.dumps(measure(args.child, config, repeats)))
        return 0
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; the cases are {list(CASES)}")
    import shardax

    header = {
        "benchmark": "explain",
        "model": "tiny-llama" if args.smoke else "llama-3-405b",
        "config": config,
        "cases": cases,
        "repeats": repeats,
        "shardax": shardax.__file__,
    }
    print(json.dumps(header), flush=True)
    rows = []
    for case in cases:
        argv_child = [sys.executable, __file__, "--child", case, "--repeats", str(repeats)]
        done = subprocess.run(
            argv_child + (["--smoke"] if args.smoke else []), capture_output=True, text=True
        )
        if done.returncode:
            sys.stderr.write(done.stdout + done.stderr)
            return done.returncode
        rows.append(json.loads(done.stdout.splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    summary = {
        "summary": {
            r["case"]: {k: r[k] for k in ("explain_s", "str_s", "peak_rss_delta_mib")} for r in rows
        }
    }
    print(json.dumps(summary))
    for r in rows:
        what, did = (
            ("layouts", "search") if r["case"].startswith("plan") else ("tensors", "explain")
        )
        print(
            f"{r['case']:<28} {r['ranks']} ranks, {r['leaves']} {what}: {did} "
            f"{r['explain_s']:.3f} s, str {r['str_s']:.3f} s, peak RSS {r['peak_rss_mib']:.0f} MiB "
            f"(+{r['peak_rss_delta_mib']:.0f})",
            file=sys.stderr,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows, **summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
