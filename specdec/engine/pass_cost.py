"""How many rows a verify pass can hold for about the price of one, measured on the device (token trees' tile).

A token tree's nodes are rows of the target's pass. On a CPU the answer is known by construction: the
batch-invariant products run in tiles of ``INVARIANT_TILE_ROWS`` (16) rows, so 1 to 16 rows cost about what one
does and the 17th starts a second tile (``benchmarks/bench_verify_rows.py``). On a GPU a small model's pass stays
flat until its products turn from memory-bound to compute-bound (the roofline's knee), which depends on the card,
the model and the dtype: so it is measured, once, when the target's worker starts.

``measure_pass_costs`` times verify passes of several row counts over a scratch sequence (greedy, drafts the target
rejects, the scratch sequence released afterwards); ``knee`` picks the most rows whose pass costs at most
``TOLERANCE`` x a one-row pass. ``specdec.trees.fit_trees`` then cuts a batch's trees so they fill no more such
tiles than chains would.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch

from specdec.calls import UNFINISHED

logger = logging.getLogger(__name__)

# the rows tried (a pass of R rows: R - 1 drafts and the bonus row), and the history they are verified after
CANDIDATE_ROWS = (16, 32, 64, 128, 256)
CONTEXT_TOKENS = 128
ROWS_PER_SEQUENCE = 16  # a scratch sequence's rows per pass (15 drafts and the bonus row)
TOLERANCE = 1.2  # a pass "costs about one row's" while it costs at most this x a one-row pass
SCRATCH_ID = "specdec-pass-cost-scratch"
FALLBACK_TILE_ROWS = 64  # where the measurement fails


def knee(costs: dict[int, float], tolerance: float = TOLERANCE) -> int:
    """The most rows whose measured pass costs at most ``tolerance`` x the one-row pass (``costs[1]``); rows past
    a count that costs more are not taken even if they measure cheaper again (noise). At least 1."""
    base = costs[1]
    best = 1
    for rows in sorted(r for r in costs if r > 1):
        if costs[rows] > tolerance * base:
            break
        best = rows
    return best


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA and any other accelerator torch drives asynchronously)."""
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)
    if backend is not None and hasattr(backend, "synchronize"):
        backend.synchronize(device)


def measure_pass_costs(worker: Any, rows: tuple[int, ...] = CANDIDATE_ROWS, reps: int = 3,
                       context: int = CONTEXT_TOKENS) -> dict[int, float]:
    """Seconds per verify pass of 1 and each of ``rows`` rows (the median of ``reps`` after one warm-up): a pass of
    R rows verifies ceil(R / ROWS_PER_SEQUENCE) scratch sequences of ``context`` tokens, the rows shared among them
    (a proposal holds at most MAX_NUM_SPECULATIVE_TOKENS drafts, and a batch is how a pass gets many rows). Each
    sequence is prefilled first, untimed; every timed pass verifies the same history (the target rolls back what it
    accepted), so the context does not drift. Row counts past the scheduler's per-pass budget
    (max_num_batched_tokens) or the target's max_model_len are left out, and those above them. The scratch sequences
    are released afterwards (their blocks may stay in the prefix cache, as any finished sequence's)."""
    from specdec.calls import VerifyCall, until_finished
    from specdec.proposal import Proposal
    from specdec.sampling import SamplingParams

    runner = worker.runner
    device = torch.device(runner.lm.device)
    params = SamplingParams(temperature=0)
    context = max(2, min(context, runner.max_model_len // 2))
    budget = runner.scheduler.max_num_batched_tokens
    ids = [f"{SCRATCH_ID}-{i}" for i in range(-(-max((1, *rows)) // ROWS_PER_SEQUENCE))]
    histories = [[(i + j) % 100 + 1 for j in range(context)] for i in range(len(ids))]
    prefilled = 0
    costs: dict[int, float] = {}
    try:
        for n in (1, *rows):
            seqs = -(-n // ROWS_PER_SEQUENCE)
            shares = [n // seqs + (1 if i < n % seqs else 0) for i in range(seqs)]  # rows per sequence
            if n > budget or context + max(shares) > runner.max_model_len:
                break
            for i in range(prefilled, seqs):  # the new scratch sequences' prompts, untimed (chunked if need be)
                _check([until_finished(worker.verify_batch, VerifyCall(ids[i], histories[i], Proposal([]), params))])
            prefilled = max(prefilled, seqs)
            calls = [VerifyCall(ids[i], histories[i], Proposal([0] * (share - 1)), params)
                     for i, share in enumerate(shares)]
            times = []
            for _ in range(reps + 1):
                _sync(device)
                start = time.perf_counter()
                results = _check(worker.verify_batch(calls))
                _sync(device)
                times.append(time.perf_counter() - start)
                if any(r is UNFINISHED for r in results):  # the pass was split: it is not one pass of n rows
                    raise RuntimeError(f"a {n}-row verify pass was split by the scheduler")
            costs[n] = statistics.median(times[1:])
    finally:
        with runner.lock:
            for sid in ids:
                runner.release(sid)
    return costs


def _check(results: list) -> list:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def measured_tile_rows(worker: Any) -> int:
    """The rows a pass on this worker's device holds for about one row's cost (``knee`` of ``measure_pass_costs``),
    logged with the costs measured; FALLBACK_TILE_ROWS (said in a warning) where the measurement fails."""
    try:
        costs = measure_pass_costs(worker)
    except Exception as exc:  # a start-up measurement must not stop the service: trees then cut by the fallback
        logger.warning("token trees: could not measure the verify pass's cost by rows on %s (%s); cutting trees to "
                       "%d-row tiles (set --tree-tile-rows to choose)", worker.runner.lm.device, exc,
                       FALLBACK_TILE_ROWS)
        return FALLBACK_TILE_ROWS
    rows = knee(costs)
    logger.info("token trees: a verify pass of up to %d rows costs about one row's on %s (measured, ms by rows: %s)",
                rows, worker.runner.lm.device, ", ".join(f"{n}: {s * 1000:.2f}" for n, s in sorted(costs.items())))
    return rows
