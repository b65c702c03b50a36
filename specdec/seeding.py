"""Seeds: where a seeded request's random numbers come from, in one place.

Rejection sampling's streams. A seeded sequence draws its random numbers from a stream that is a
function of (seed, role, number of tokens already committed): each round re-seeds the sequence's
generator from a hash of the three and then draws in a fixed order. So a service that rebuilds a
sequence from its resent history (restart, eviction, TTL expiry, another replica) draws exactly what it
would have drawn, and no two rounds of a sequence share a stream. Unseeded sequences keep one generator
with fresh randomness.

The coupled rule's noise (``seeded_sampling="coupled"``, the default for seeded sampled requests). The
token at absolute position t (t tokens before it, prompt included) is the winner of an exponential race,
``argmax_v p_t(v) / E_t(v)``: with E_t(v) ~ Exp(1) i.i.d., id v wins with probability p_t(v), so the
token is an exact sample of the target's processed distribution p_t (Gumbel-max in another form). Here
E_t is a function of (request seed, t) ONLY (``race_noise``): the same for the draft and the target (one
key for both roles, unlike the per-role streams above), for any k, any drafter, speculation on or off,
and across restarts. Hence a seeded request's text is a function of (target, seed, prompt, parameters):

* the target emits ``argmax p_t / E_t`` at every position, whatever was proposed: it accepts draft j while
  draft j equals that winner, emits the winner at the first mismatch, and the winner at position k (the
  bonus) when every draft matched. With no drafts (k = 0) it is plain decoding by the same race;
* a probabilistic draft proposes ``argmax q_t / E_t`` with the same E_t — an exact sample of q, which
  equals the target's winner whenever both races agree (probability >= (1 - TV) / (1 + TV), TV the total
  variation distance between p_t and q_t; Daliri, Musco and Suresh 2024, "Coupling without communication
  and drafter-invariant speculative decoding"). The draft only changes how many tokens a round accepts.

Noise layout: ids are cut into blocks of ``NOISE_BLOCK`` ids; block b of position t is ``torch.rand`` of
NOISE_BLOCK floats from a CPU generator seeded by a hash of (key, t, b), and E = -log(u) (u = 0 gives
+inf: that id cannot win). So a row of any vocabulary size gets the same noise on the ids it shares with a
wider or narrower one (a draft whose logit row has another size), and any device gets the same numbers
(drawn on the CPU, then moved).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the seeds are plain integers (a gateway reads them); the noise is torch's, imported where drawn
    import torch

_SEED_RANGE = 2**63

# The rules a seeded sampled request may follow on the target (SamplingParams.couples says which
# requests count as seeded): the draft-invariant exponential race, or Leviathan/Chen rejection sampling.
SEEDED_SAMPLING = ("coupled", "rejection")
DEFAULT_SEEDED_SAMPLING = "coupled"
NOISE_BLOCK = 4096  # ids per block of race noise (each block has a generator of its own)


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


def check_seeded_sampling(value: str, name: str = "seeded_sampling") -> str:
    """``value`` if it names a rule, else ValueError naming the setting and the choices."""
    if value not in SEEDED_SAMPLING:
        raise ValueError(f"{name} must be one of {list(SEEDED_SAMPLING)}, got {value!r}")
    return value


def coupling_key(seed: int) -> int:
    """The race key of a request's seed: one key for the draft and the target (no role in it)."""
    return _mix("specdec-coupled", seed)


def race_noise(seed: int, positions: Sequence[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Exp(1) noise [len(positions), vocab] float32 on ``device``: row i is E_t for t = positions[i] (the
    number of tokens before the token being chosen, prompt included), a function of (seed, t) only, and
    the same on the ids two calls with different ``vocab`` share (see the module docstring)."""
    import torch

    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    key = coupling_key(seed)
    blocks = -(-vocab // NOISE_BLOCK)
    out = torch.empty(len(positions), blocks * NOISE_BLOCK)
    g = torch.Generator()
    for i, position in enumerate(positions):
        if position < 0:
            raise ValueError(f"positions must be >= 0, got {position}")
        for b in range(blocks):
            g.manual_seed(_mix(key, position, b))
            torch.rand(NOISE_BLOCK, generator=g, out=out[i, b * NOISE_BLOCK:(b + 1) * NOISE_BLOCK])
    noise = out[:, :vocab].log_().neg_()  # -log(u) ~ Exp(1); u = 0 gives +inf: that id cannot win
    return noise.to(device)
