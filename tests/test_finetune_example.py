"""``examples/finetune_hf.py --smoke`` as a user launches it: a GPT-2 built
offline, ZeRO-3 × Megatron with the rules found from its module names, a few
steps on Tiny Shakespeare, a checkpoint consolidated into a Hugging Face
folder that ``from_pretrained`` loads with the trained model's logits; and
(``pytest -m slow``) the same script fine-tunes that folder (``--model``)
on dp=2."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "shardax", "launch", "--nproc-per-node", "2"]


def launch(*args: str) -> str:
    done = subprocess.run(
        [*LAUNCH, "examples/finetune_hf.py", "--smoke", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]


def test_the_fine_tuning_example_round_trips_through_hugging_face(tmp_path):
    out = launch("--out", str(tmp_path / "a"))
    assert "Mesh({'dp': 1, 'tp': 2}): GPT2LMHeadModel" in out
    assert f"consolidated to {tmp_path / 'a' / 'hf'}" in out
    diff = float(re.search(r"max \|logit difference\| (\S+)", out).group(1))
    assert diff <= 1e-5
    assert 5.0 < losses(out)[0] < 6.0  # ln 256 = 5.55: a fresh byte model


@pytest.mark.slow
def test_the_fine_tuning_example_fine_tunes_a_local_folder(tmp_path):
    first = losses(launch("--out", str(tmp_path / "a")))
    again = launch("--model", str(tmp_path / "a" / "hf"), "--tp", "1", "--out", str(tmp_path / "b"))
    assert "Mesh({'dp': 2, 'tp': 1})" in again
    assert losses(again)[0] < first[0]  # starts from the fine-tuned weights
    assert (tmp_path / "b" / "hf" / "config.json").is_file()
