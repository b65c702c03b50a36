"""Seeds: where a seeded request's random numbers come from, in one place.

A seeded sequence draws its random numbers from a stream that is a function of (seed, role, number of
tokens already committed): each round re-seeds the sequence's generator from a hash of the three and
then draws in a fixed order. So a service that rebuilds a sequence from its resent history (restart,
eviction, TTL expiry, another replica) draws exactly what it would have drawn, and no two rounds of a
sequence share a stream. Unseeded sequences keep one generator with fresh randomness.
"""

from __future__ import annotations

import hashlib

_SEED_RANGE = 2**63


def output_seed(seed: int | None, index: int) -> int | None:
    """The seed of output ``index`` of a request with n > 1 outputs: distinct and reproducible."""
    if seed is None:
        return None
    return (seed + index) % _SEED_RANGE


def _mix(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _SEED_RANGE


def stream_key(seed: int | None, role: str) -> int | None:
    """A sequence's key for one role ("draft" / "target"): the two sides draw independent numbers."""
    return None if seed is None else _mix("specdec-stream", seed, role)


def round_seed(key: int, position: int) -> int:
    """The generator seed of the round that starts with ``position`` tokens committed."""
    return _mix(key, position)
