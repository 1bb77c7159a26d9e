"""Seeds derived from keys, so randomness depends on what is computed, never on who computes it."""

from __future__ import annotations

import hashlib


def derive_seed(*keys: int | str) -> int:
    """A 63-bit seed from a tuple of keys, e.g. ``derive_seed(seed, "init", unit)``."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
