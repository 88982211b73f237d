"""Cutting a model into stages: the blocks found as they are in our GPT and
in Hugging Face models, balanced by layers, parameters, time or counts
(the partition exact against brute force), the outer parameters on the
first and last stage and the buffers on every stage, and every bad request
a ScheduleError naming what would work."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch
from _tiny import example_gpt, gpt2, llama

from shardax import pipeline
from shardax.errors import ScheduleError
from shardax.pipeline._stages import partition


def _brute(sizes, stages, first, last):
    n, best = len(sizes), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        loads = [sum(sizes[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[0] += first
        loads[-1] += last
        if best is None or max(loads) < best:
            best = max(loads)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_the_partition_is_the_best_there_is(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    stages = rng.randint(1, n)
    sizes = [rng.uniform(0.1, 5) for _ in range(n)]
    first, last = rng.uniform(0, 4), rng.uniform(0, 4)
    counts = partition(sizes, stages, first, last)
    assert len(counts) == stages and sum(counts) == n and min(counts) >= 1
    bounds = [0, *itertools.accumulate(counts)]
    loads = [sum(sizes[a:b]) for a, b in itertools.pairwise(bounds)]
    loads[0] += first
    loads[-1] += last
    assert max(loads) == pytest.approx(_brute(sizes, stages, first, last))


def test_the_blocks_are_found_in_every_model():
    assert pipeline.split(example_gpt(n_layers=4), 2).blocks == "blocks"
    assert pipeline.split(gpt2(n_layer=4), 4).blocks == "transformer.h"
    split = pipeline.split(llama(num_hidden_layers=2), 2)
    assert split.blocks == "model.layers" and "model.rotary_emb.inv_freq" in split.shared


def test_outer_parameters_live_on_the_first_and_last_stage_buffers_everywhere():
    model = llama(num_hidden_layers=4)
    stages = pipeline.split(model, 4)
    schedule = pipeline.gpipe(4, 4)
    everything = dict(model.named_parameters()) | dict(model.named_buffers())
    held = [set(stages.local(everything, schedule, r)) for r in range(4)]
    assert "model.embed_tokens.weight" in held[0] and "lm_head.weight" in held[3]
    assert "model.embed_tokens.weight" in held[3] and "lm_head.weight" in held[0]
    assert not any(k.startswith(("model.embed", "lm_head")) for k in held[1] | held[2])
    assert all("model.rotary_emb.inv_freq" in h for h in held)
    assert {k for k in held[2] if "layers" in k} == {
        k for k in everything if k.startswith("model.layers.2.")
    }


def test_balancing_by_parameters_and_by_counts():
    model = example_gpt(n_layers=6, vocab_size=4096)  # a large embedding: the ends take less
    assert pipeline.split(model, 3, balance="params").counts == (1, 4, 1)
    assert pipeline.split(model, 3, balance=[1, 2, 3]).counts == (1, 2, 3)
    timed = pipeline.split(model, 3, balance="time", sample=torch.zeros(2, 8, dtype=torch.long))
    assert sum(timed.counts) == 6 and len(timed.counts) == 3


class _SlowBackward(torch.autograd.Function):
    """The identity, whose backward takes 0.2 s (a block's forward here
    takes microseconds: a margin of thousands, no race)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.2)
        return g


class _Blocks(torch.nn.Module):
    def __init__(self, slow: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
        self.slow = self.blocks[slow]
        self.slow.register_forward_hook(lambda m, a, out: _SlowBackward.apply(out))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_balancing_by_time_counts_the_backward():
    """The last block's backward is slow, its forward not: balanced by
    forward and backward time it gets a stage of its own; the model's
    ``.grad`` are left as they were."""
    model = _Blocks(slow=3)
    stages = pipeline.split(model, 2, balance="time", sample=torch.ones(2, 4))
    assert stages.counts == (3, 1)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stages": 4}, r"6 blocks do not split evenly into 4 stages; use 1, 2, 3 or 6 stages"),
        ({"stages": 7}, r"6 blocks cannot fill 7 stages \(at most 6: one block each\)"),
        ({"stages": 2, "balance": [3, 2]}, r"balance=\[3, 2\] must give 2 counts summing to the 6"),
        ({"stages": 2, "balance": "flops"}, r"balance is 'layers', 'params', 'time' or a list"),
        ({"stages": 2, "balance": "time"}, r"times the model on an input: pass sample="),
        ({"stages": 2, "blocks": "wte"}, r"'wte' is a Embedding, not an nn.ModuleList"),
        ({"stages": 2, "blocks": "nope"}, r"the model has no module 'nope'"),
        ({"stages": 0}, r"stages is an int >= 1 or a Schedule; got 0"),
    ],
)
def test_a_bad_split_is_a_schedule_error(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        pipeline.split(example_gpt(n_layers=6), **kwargs)


def test_a_schedule_for_another_number_of_stages_is_refused():
    stages = pipeline.split(example_gpt(n_layers=4), 2)
    with pytest.raises(ScheduleError, match=r"split into 2 stages but the schedule runs 4"):
        stages.local({}, pipeline.zbv(2, 4), 0)


def test_given_the_schedule_the_balance_is_per_rank():
    """In a V, rank 0 runs the first and the last stage (the embedding and
    the head): the busiest rank's parameters, not the busiest stage's, are
    the fewest."""
    model = example_gpt(n_layers=8, vocab_size=2048)
    schedule = pipeline.zbv(2, 4)

    def worst_rank(counts):
        stages = pipeline.Stages("blocks", counts)
        return max(
            sum(p.numel() for k, p in model.named_parameters() if stages.held(k, mine))
            for mine in ([0, 3], [1, 2])
        )

    per_rank = pipeline.split(model, schedule, balance="params").counts
    every = [c for c in itertools.product(range(1, 6), repeat=4) if sum(c) == 8]
    assert worst_rank(per_rank) == min(worst_rank(c) for c in every)
