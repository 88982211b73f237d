"""Data for training: each rank's part of a global batch, a resumable sampler
so each rank loads only its own examples, and a byte-level text dataset.

>>> import torch, shardax as sx
>>> mesh = sx.Mesh({"dp": 1})
>>> data = sx.data.TextDataset("to be or not to be", seq_len=4, val_fraction=0)
>>> sampler = sx.data.Sampler(len(data), 2, mesh, seed=0)
>>> batch = next(sx.data.batches(data, sampler))
>>> batch["x"].shape, batch["y"].dtype
(torch.Size([2, 4]), torch.int64)
"""

from ._sampler import Sampler as Sampler
from ._sampler import batches as batches
from ._split import shard_batch as shard_batch
from ._split import shard_batches as shard_batches
from ._text import TextDataset as TextDataset

__all__ = ["Sampler", "TextDataset", "batches", "shard_batch", "shard_batches"]
