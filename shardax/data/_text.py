"""A byte-level text dataset: the tokens are the bytes of the text (vocab 256)."""

from __future__ import annotations

import operator
import os
from pathlib import Path
from typing import Any, ClassVar, Literal

import attrs
import torch

__all__ = ["TextDataset"]

Split = Literal["train", "val"]
_SHOWN_BYTES = 40  # reprs show data up to this long as a literal


def _as_int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int; got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}; got {value}")
    return value


def _read(data: str | bytes | os.PathLike[str]) -> tuple[bytes, str]:
    """The bytes of ``data``, and the start of a call that rebuilds it (for repr)."""
    if isinstance(data, os.PathLike):
        path = Path(data)
        return path.read_bytes(), f"TextDataset.from_file({str(path)!r}, "
    if isinstance(data, str):
        raw = data.encode("utf-8")
        shown = repr(data) if len(raw) <= _SHOWN_BYTES else f"<text of {len(raw)} bytes>"
        return raw, f"TextDataset({shown}, "
    if isinstance(data, bytes | bytearray):
        raw = bytes(data)
        shown = repr(raw) if len(raw) <= _SHOWN_BYTES else f"<{len(raw)} bytes>"
        return raw, f"TextDataset({shown}, "
    raise TypeError(
        "TextDataset takes text (str), bytes, or a file path (pathlib.Path); got "
        f"{type(data).__name__}"
    )


@attrs.frozen(init=False, repr=False, eq=False)
class TextDataset:
    """Byte-level language modelling on a text: every byte is a token.

    The text is split once: the last ``val_fraction`` of the bytes is the
    ``"val"`` split, the rest ``"train"``. Example ``i`` of a split is
    ``{"x": t[i*stride : i*stride + seq_len], "y": t[i*stride + 1 : i*stride +
    seq_len + 1]}`` (``y`` is ``x`` shifted by one: the next byte), as int64;
    ``stride`` defaults to ``seq_len`` (non-overlapping windows). The split's
    bytes are kept once, as a uint8 tensor, and sliced per example.

    Args:
        data: the text (``str``, utf-8 encoded), its ``bytes``, or a
            ``pathlib.Path`` to read (for a path given as a ``str``, use
            :meth:`from_file`).
        seq_len: tokens per example.
        split: ``"train"`` or ``"val"``.
        val_fraction: the share of bytes, from the end, that is ``"val"``.
        stride: tokens between the starts of consecutive examples (default
            ``seq_len``); smaller overlaps examples.

    Raises:
        ValueError: a split too short for one example (it needs ``seq_len +
            1`` bytes), or sizes out of range.

    >>> from shardax.data import TextDataset
    >>> ds = TextDataset("hello world!", seq_len=4, val_fraction=0.25)
    >>> len(ds), ds[1]
    (2, {'x': tensor([111,  32, 119, 111]), 'y': tensor([ 32, 119, 111, 114])})
    >>> ds.decode(ds[1]["x"]), TextDataset("hello world!", 2, split="val", val_fraction=0.25).text
    ('o wo', 'ld!')
    """

    vocab_size: ClassVar[int] = 256

    tokens: torch.Tensor
    seq_len: int
    split: Split
    val_fraction: float
    stride: int
    _origin: str

    def __init__(
        self,
        data: str | bytes | os.PathLike[str],
        seq_len: int,
        *,
        split: Split = "train",
        val_fraction: float = 0.1,
        stride: int | None = None,
    ) -> None:
        raw, origin = _read(data)
        self._build(raw, origin, seq_len, split, val_fraction, stride)

    def _build(
        self,
        raw: bytes,
        origin: str,
        seq_len: int,
        split: Split,
        val_fraction: float,
        stride: int | None,
    ) -> None:
        seq_len = _as_int("seq_len", seq_len, 1)
        stride = seq_len if stride is None else _as_int("stride", stride, 1)
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val'; got {split!r}")
        if not isinstance(val_fraction, int | float) or not 0 <= val_fraction < 1:
            raise ValueError(
                f"val_fraction is the share of the text kept for 'val', in [0, 1); got {val_fraction!r}"
            )
        if not raw:
            raise ValueError(f"{origin}...) has no text")
        cut = len(raw) - int(len(raw) * val_fraction)
        everything = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        tokens = everything[:cut] if split == "train" else everything[cut:]
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"the {split!r} split of {origin}...) has {len(tokens)} bytes (of {len(raw)}, with "
                f"val_fraction={val_fraction}), but an example needs seq_len + 1 = {seq_len + 1} "
                "(x, and y one byte further); use a shorter seq_len, more text, or "
                + ("a smaller val_fraction" if split == "train" else "a larger val_fraction")
            )
        self.__attrs_init__(tokens, seq_len, split, float(val_fraction), stride, origin)

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        seq_len: int,
        *,
        split: Split = "train",
        val_fraction: float = 0.1,
        stride: int | None = None,
    ) -> TextDataset:
        """The bytes of the file at ``path``.

        >>> import tempfile, pathlib
        >>> from shardax.data import TextDataset
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = pathlib.Path(d, "t.txt")
        ...     _ = path.write_text("to be or not to be")
        ...     len(TextDataset.from_file(path, seq_len=4, val_fraction=0))
        4
        """
        return cls(Path(path), seq_len, split=split, val_fraction=val_fraction, stride=stride)

    @classmethod
    def tinyshakespeare(
        cls,
        seq_len: int,
        *,
        split: Split = "train",
        val_fraction: float = 0.1,
        stride: int | None = None,
    ) -> TextDataset:
        """Tiny Shakespeare (1,115,394 bytes, public domain), the copy shipped
        with the repository at ``examples/data/tinyshakespeare.txt``.

        Raises:
            FileNotFoundError: the copy is not beside the installed package
                (an install without the repository checkout); the message says
                where it looked.

        >>> from shardax.data import TextDataset
        >>> train = TextDataset.tinyshakespeare(seq_len=256)
        >>> len(train), train.decode(train[0]["x"][:14])
        (3921, 'First Citizen:')
        """
        # the repository root: shardax/data/_text.py -> parents[2]
        path = Path(__file__).resolve().parents[2] / "examples" / "data" / "tinyshakespeare.txt"
        if not path.is_file():
            raise FileNotFoundError(
                f"tinyshakespeare.txt is not at {path} (looked in examples/data/ of the repository "
                "that holds the shardax package, as in a source checkout); install shardax "
                "from its repository (pip install -e .), or pass the file yourself: "
                "TextDataset.from_file(path, seq_len)"
            )
        dataset = cls.__new__(cls)
        origin = "TextDataset.tinyshakespeare("
        dataset._build(path.read_bytes(), origin, seq_len, split, val_fraction, stride)
        return dataset

    # -- examples --------------------------------------------------------------
    def __len__(self) -> int:
        return (len(self.tokens) - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        try:
            if isinstance(index, bool):
                raise TypeError
            index = operator.index(index)
        except TypeError:
            raise TypeError(f"a TextDataset is indexed by one int; got {index!r}") from None
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"example {index} is out of range for {n} examples")
        start = (index % n) * self.stride
        window = self.tokens[start : start + self.seq_len + 1].long()
        return {"x": window[:-1], "y": window[1:]}

    @property
    def text(self) -> str:
        """This split's text (bytes that are not utf-8 decode as U+FFFD)."""
        return self.decode(self.tokens)

    # -- tokens ----------------------------------------------------------------
    @staticmethod
    def encode(text: str) -> torch.Tensor:
        """The tokens of ``text``: its utf-8 bytes, as int64.

        >>> from shardax.data import TextDataset
        >>> TextDataset.encode("hé")
        tensor([104, 195, 169])
        """
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    @staticmethod
    def decode(tokens: torch.Tensor | list[int]) -> str:
        """The text of ``tokens`` (utf-8; invalid bytes become U+FFFD).

        >>> from shardax.data import TextDataset
        >>> TextDataset.decode(TextDataset.encode("hé")), TextDataset.decode([104, 195])
        ('hé', 'h�')
        """
        values = tokens.reshape(-1).tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        bad = [v for v in values if not 0 <= v < 256]
        if bad:
            raise ValueError(f"byte tokens are 0..255; got {bad[:5]}")
        return bytes(values).decode("utf-8", errors="replace")

    def unigram_entropy(self) -> float:
        """Entropy of this split's byte frequencies, in nats per token: the loss
        of a model that ignores context (the unigram baseline); a language model
        that learns anything goes well below it.

        >>> from shardax.data import TextDataset
        >>> round(TextDataset("abab", seq_len=1, val_fraction=0).unigram_entropy(), 4)
        0.6931
        """
        counts = torch.bincount(self.tokens, minlength=self.vocab_size).double()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log()).sum())

    def __repr__(self) -> str:
        stride = "" if self.stride == self.seq_len else f", stride={self.stride}"
        return (
            f"{self._origin}seq_len={self.seq_len}, split={self.split!r}, "
            f"val_fraction={self.val_fraction}{stride})"
        )
