"""Sharded checkpoints (to come).

safetensors shards plus one JSON index (global shape, dtype, spec, mesh,
per-shard boxes, checksums); save and load for any mesh, offline reshard by box
intersection, async save and atomic commit.
"""
