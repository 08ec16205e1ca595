"""Deterministic train/validation split by conversation group.

A conversation is in validation when a hash of its group key falls below `val_fraction`: the decision depends on
nothing but the key and the seed, so it is stable across runs, shard counts, dataset sizes and orderings, and a
validation conversation is never trained on.
"""

import hashlib


def is_validation(group: str, val_fraction: float, seed: int = 0) -> bool:
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    digest = hashlib.sha256(f"{seed}:{group}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction
