"""The byte-level text dataset: tokens are bytes, y is x shifted by one, the
val split is the end of the text, the unigram baseline is the entropy of
the byte frequencies, and the shipped Tiny Shakespeare is found."""

from __future__ import annotations

import collections
import hashlib
import math
from pathlib import Path

import pytest
import torch

import shardax as sx
from shardax.data import Sampler, TextDataset, batches

ROOT = Path(__file__).resolve().parents[2]
SHAKESPEARE = ROOT / "examples" / "data" / "tinyshakespeare.txt"
TEXT = "Beware the Jabberwock, my son! — the jaws that bite, the claws that catch!"


@pytest.mark.parametrize("text", ["", "hello", TEXT, "日本語 ünïcödé \n\t\x00"])
def test_encode_decode_round_trip(text):
    tokens = TextDataset.encode(text)
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == list(text.encode("utf-8"))
    assert TextDataset.decode(tokens) == text
    assert TextDataset.decode(tokens.tolist()) == text


def test_decode_replaces_invalid_bytes_and_rejects_non_bytes():
    assert TextDataset.decode(torch.tensor([104, 0xFF, 105])) == "h\ufffdi"
    with pytest.raises(ValueError, match=r"0\.\.255; got \[256\]"):
        TextDataset.decode([104, 256])


@pytest.mark.parametrize(("seq_len", "stride"), [(1, None), (5, None), (5, 2), (8, 1), (3, 7)])
def test_examples_are_windows_with_y_shifted_by_one(seq_len, stride):
    ds = TextDataset(TEXT, seq_len, stride=stride, val_fraction=0)
    raw = list(TEXT.encode("utf-8"))
    step = seq_len if stride is None else stride
    assert ds.stride == step
    assert len(ds) == (len(raw) - seq_len - 1) // step + 1
    assert (len(ds) - 1) * step + seq_len + 1 <= len(raw) < len(ds) * step + seq_len + 1
    for i in [0, 1, len(ds) - 1]:
        example = ds[i]
        assert set(example) == {"x", "y"}
        assert example["x"].dtype == example["y"].dtype == torch.int64
        assert example["x"].tolist() == raw[i * step : i * step + seq_len]
        assert example["y"].tolist() == raw[i * step + 1 : i * step + seq_len + 1]
    assert ds[-1]["x"].tolist() == ds[len(ds) - 1]["x"].tolist()
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]
    with pytest.raises(TypeError, match="indexed by one int"):
        ds[0:2]


@pytest.mark.parametrize("val_fraction", [0.0, 0.1, 0.25, 0.5])
def test_val_is_the_end_of_the_text(val_fraction):
    raw = TEXT.encode("utf-8")
    train = TextDataset(raw, 2, val_fraction=val_fraction)
    n_val = int(len(raw) * val_fraction)
    assert bytes(train.tokens.tolist()) == raw[: len(raw) - n_val]
    assert train.tokens.dtype == torch.uint8  # one byte per token, kept once
    if n_val >= 3:
        val = TextDataset(raw, 2, split="val", val_fraction=val_fraction)
        assert bytes(val.tokens.tolist()) == raw[len(raw) - n_val :]
        assert len(train.tokens) + len(val.tokens) == len(raw)


@pytest.mark.parametrize(
    ("text", "entropy"),
    [
        ("abab", math.log(2)),
        ("aaaa", 0.0),
        ("abcd", math.log(4)),
        (bytes(range(256)), math.log(256)),
    ],
)
def test_unigram_entropy_of_known_texts(text, entropy):
    ds = TextDataset(text, 1, val_fraction=0)
    assert ds.unigram_entropy() == pytest.approx(entropy, abs=1e-12)


def test_tinyshakespeare_is_the_shipped_copy():
    assert hashlib.sha256(SHAKESPEARE.read_bytes()).hexdigest() == (
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    )
    train = TextDataset.tinyshakespeare(seq_len=128)
    val = TextDataset.tinyshakespeare(seq_len=128, split="val")
    assert len(train.tokens) + len(val.tokens) == 1_115_394
    assert len(val.tokens) == 111_539
    assert train.text.startswith("First Citizen:\nBefore we proceed any further")
    counts = collections.Counter(val.tokens.tolist())
    expected = -sum(c / len(val.tokens) * math.log(c / len(val.tokens)) for c in counts.values())
    assert val.unigram_entropy() == pytest.approx(expected, rel=1e-12)
    assert 2.5 < val.unigram_entropy() < math.log(train.vocab_size)
    assert repr(val) == "TextDataset.tinyshakespeare(seq_len=128, split='val', val_fraction=0.1)"


def test_tinyshakespeare_says_where_it_looked(monkeypatch, tmp_path):
    from shardax.data import _text

    monkeypatch.setattr(_text, "__file__", str(tmp_path / "shardax" / "data" / "_text.py"))
    with pytest.raises(FileNotFoundError) as err:
        TextDataset.tinyshakespeare(seq_len=8)
    assert str(tmp_path / "examples" / "data" / "tinyshakespeare.txt") in str(err.value)
    assert "TextDataset.from_file" in str(err.value)


def test_from_a_file_path_and_a_repr_that_rebuilds(tmp_path):
    path = tmp_path / "poem.txt"
    path.write_text(TEXT)
    by_str = TextDataset.from_file(str(path), 8, stride=4)
    by_path = TextDataset(path, 8, stride=4)
    assert torch.equal(by_str.tokens, by_path.tokens)
    assert torch.equal(by_str.tokens, TextDataset(TEXT, 8, stride=4).tokens)
    namespace = {"TextDataset": TextDataset}
    for ds in (by_str, TextDataset("abcdefgh", 2, split="val", val_fraction=0.5)):
        again = eval(repr(ds), namespace)
        assert repr(again) == repr(ds)
        assert torch.equal(again.tokens, ds.tokens)
    assert repr(TextDataset(TEXT * 2, 4)) == (
        "TextDataset(<text of 152 bytes>, seq_len=4, split='train', val_fraction=0.1)"
    )


BAD = [  # args, kwargs, error, message fragment
    (("abc", 3), {"val_fraction": 0}, ValueError, "seq_len + 1 = 4"),
    (("abcdefghij", 2), {"split": "val"}, ValueError, "a larger val_fraction"),
    (("abc", 1), {"split": "test"}, ValueError, "'train' or 'val'"),
    (("abc", 1), {"val_fraction": 1.0}, ValueError, "in [0, 1)"),
    (("abc", 0), {}, ValueError, "seq_len must be at least 1"),
    (("abcdef", 2), {"stride": 0}, ValueError, "stride must be at least 1"),
    (("", 1), {}, ValueError, "no text"),
    ((123, 1), {}, TypeError, "text (str), bytes, or a file path"),
]


@pytest.mark.parametrize(("args", "kwargs", "error", "fragment"), BAD)
def test_bad_input_is_a_clear_error(args, kwargs, error, fragment):
    with pytest.raises(error) as err:
        TextDataset(*args, **kwargs)
    assert fragment in str(err.value), str(err.value)


def test_feeds_the_sampler_and_loader():
    ds = TextDataset(TEXT, 6, val_fraction=0)
    sampler = Sampler(len(ds), 4, sx.AbstractMesh({"dp": 2}), seed=1, rank=1)
    for idx, batch in zip(sampler, batches(ds, sampler, num_steps=5), strict=False):
        assert batch["x"].shape == batch["y"].shape == (2, 6)
        assert torch.equal(batch["x"], torch.stack([ds[i]["x"] for i in idx]))
        assert torch.equal(batch["x"][:, 1:], batch["y"][:, :-1])
    first = next(batches(ds, sampler))
    assert first["y"].dtype == torch.int64
