"""Agreeing which rank writes each box when the ranks save different trees.

Most jobs save the same tree on every rank, and every rank computes the
same index on its own. A pipeline does not: each rank holds its stages'
parameters (the first and the last stage both hold the embeddings), on
the submesh of its stage. Then every rank posts a digest of its index; if
they differ, each posts its index, rank 0 merges them — one entry per key
path, shapes and dtypes checked to agree, each distinct box written once,
by the lowest rank holding it — and every rank writes what the merged
index gives it. The checkpoint is the same as a one-mesh save of the whole
model: key paths and global shapes, whatever the pipeline.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol

import torch

from ..errors import CheckpointError
from ._format import Index, TensorEntry

__all__ = ["agree_on_owners"]


class _Store(Protocol):
    def set(self, key: str, value: str) -> None: ...

    def get(self, keys: list[str], what: str) -> list[str]: ...


def _file_rank(name: str) -> int:
    return int(name.split("-")[1])


def agree_on_owners(
    index: Index,
    items: list[tuple[str, torch.Tensor]],
    spare: list[tuple[str, torch.Tensor]],
    rank: int,
    world: int,
    store: _Store,
    mine: str,
) -> tuple[Index, list[tuple[str, torch.Tensor]]]:
    """The index every rank saves under and this rank's items to write.
    ``items``: the boxes this rank would write alone (RNG states included);
    ``spare``: plain tensors it holds that rank 0 was taken to write."""
    if world == 1:
        return index, items
    tree = json.dumps(index.to_json()["leaves"], sort_keys=True)
    store.set(f"digest{rank}", hashlib.sha256(tree.encode()).hexdigest())
    digests = store.get([f"digest{r}" for r in range(world)], "every rank's tree digest")
    if len(set(digests)) == 1:
        return index, items
    store.set(f"tree{rank}", tree)
    if rank == 0:
        trees = store.get([f"tree{r}" for r in range(world)], "every rank's tree")
        try:
            leaves = _merge([json.loads(t) for t in trees])
        except CheckpointError as err:
            store.set("merged", json.dumps({"error": str(err)}))
            raise
        store.set("merged", json.dumps({"leaves": leaves}))
    else:
        (raw,) = store.get(["merged"], "rank 0's merged index")
        merged = json.loads(raw)
        if "error" in merged:
            raise CheckpointError(merged["error"])
        leaves = merged["leaves"]
    as_json = index.to_json()
    as_json["leaves"] = leaves
    merged_index = Index.from_json(as_json, "the merged index")
    owned = {
        b.name
        for e in merged_index.leaves.values()
        if isinstance(e, TensorEntry)
        for b in e.boxes
        if b.file == mine
    }
    keep = [(n, t) for n, t in items if n in owned or n.startswith("__rng__.")]
    keep += [(n, t) for n, t in spare if n in owned]
    return merged_index, keep


def _merge(trees: list[dict[str, Any]]) -> dict[str, Any]:
    """One leaf per key path over every rank's leaves (rank order)."""
    out: dict[str, Any] = {}
    holders: dict[str, list[int]] = {}
    for r, leaves in enumerate(trees):
        for path, entry in leaves.items():
            holders.setdefault(path, []).append(r)
            first = out.get(path)
            if first is None:
                out[path] = json.loads(json.dumps(entry))
                continue
            if first["kind"] != entry["kind"] or (
                entry["kind"] == "tensor"
                and (first["shape"], first["dtype"]) != (entry["shape"], entry["dtype"])
            ):
                raise CheckpointError(
                    f"{path!r} is saved by rank {holders[path][0]} as {_what(first)} and by rank "
                    f"{r} as {_what(entry)}: every rank holding a key path must hold the same "
                    "tensor (its own piece of it)"
                )
            if entry["kind"] == "tensor":
                boxes = {(tuple(b["offsets"]), tuple(b["sizes"])): b for b in first["boxes"]}
                for b in entry["boxes"]:
                    key = (tuple(b["offsets"]), tuple(b["sizes"]))
                    if key not in boxes or _file_rank(b["file"]) < _file_rank(boxes[key]["file"]):
                        boxes[key] = b
                first["boxes"] = [boxes[k] for k in sorted(boxes)]
    for path, entry in out.items():
        if entry["kind"] == "tensor" and not entry["mesh"]:  # a plain tensor: its lowest holder
            for b in entry["boxes"]:
                b["file"] = b["file"].replace("rank-00000-", f"rank-{holders[path][0]:05d}-", 1)
    return out


def _what(entry: dict[str, Any]) -> str:
    if entry["kind"] != "tensor":
        return "a value"
    return f"{entry['dtype']} {tuple(entry['shape'])}"
