"""specdec/engine/pass_cost.py: the rows a verify pass holds for about one row's cost, measured where it is not
known by construction (a GPU), from real passes over scratch sequences that leave nothing behind."""

from __future__ import annotations

import pytest

import specdec.engine.workers as workers
from specdec.engine import pass_cost
from specdec.engine.pass_cost import knee, measure_pass_costs
from specdec.engine.runner import ModelRunner
from specdec.engine.workers import TargetWorker
from specdec.proposal import Proposal
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("cached_model_loading")


@pytest.mark.parametrize("costs, rows", [
    ({1: 1.0, 16: 1.05, 32: 1.1, 64: 1.19, 128: 1.6, 256: 3.0}, 64),  # flat to 64 rows, then compute-bound
    ({1: 1.0, 16: 1.0, 32: 1.5, 64: 1.1}, 16),  # a step at 32: 64 measuring cheaper again is noise, not a knee
    ({1: 1.0, 16: 1.3}, 1),  # even 16 rows cost more: no room
    ({1: 1.0}, 1),
])
def test_knee_is_the_most_rows_before_the_first_step(costs, rows):
    assert knee(costs) == rows


def test_knee_tolerance():
    assert knee({1: 1.0, 16: 1.3, 32: 1.4}, tolerance=1.5) == 32


def test_measured_passes_leave_no_sequence_behind(target_lm):
    runner = ModelRunner(target_lm, 256, role="target")
    worker = TargetWorker(runner)
    before = runner.kv_stats()
    costs = measure_pass_costs(worker, rows=(16, 32), reps=2, context=24)
    assert set(costs) == {1, 16, 32} and all(c > 0 for c in costs.values())
    assert not any(s.startswith(pass_cost.SCRATCH_ID) for s in runner.sequences)
    assert runner.kv_stats().used_blocks == before.used_blocks == 0
    # the worker verifies as a fresh one does
    call = ("s", [1, 2, 3, 4], Proposal([5, 6]), SamplingParams(temperature=0))
    fresh = TargetWorker(ModelRunner(target_lm, 256, role="target")).verify(*call)
    out = worker.verify(*call)
    assert (out.num_accepted_tokens, out.next_token_id) == (fresh.num_accepted_tokens, fresh.next_token_id)


def test_the_default_measurement_runs_whole_passes_on_a_fixed_history(target_lm):
    """The defaults (128-token histories, up to 256 rows over 16 scratch sequences, the default per-pass budget): the
    prompts are fed first, untimed and in chunks, and each timed pass is one pass; nothing stays behind."""
    runner = ModelRunner(target_lm, 1024, role="target")
    worker = TargetWorker(runner)
    costs = measure_pass_costs(worker, reps=1)
    assert set(costs) == {1, *pass_cost.CANDIDATE_ROWS}, costs
    assert runner.kv_stats().used_blocks == 0 and not runner.sequences


def test_rows_past_the_pass_budget_are_left_out(target_lm):
    worker = TargetWorker(ModelRunner(target_lm, 512, role="target", max_num_batched_tokens=48))
    assert set(measure_pass_costs(worker, rows=(16, 32, 64), reps=1, context=40)) == {1, 16, 32}


def test_a_failed_measurement_falls_back_and_says_so(target_lm, monkeypatch, caplog):
    def broken(worker):
        raise RuntimeError("no such pass")

    monkeypatch.setattr(pass_cost, "measure_pass_costs", broken)
    worker = TargetWorker(ModelRunner(target_lm, 256, role="target"))
    with caplog.at_level("WARNING"):
        assert pass_cost.measured_tile_rows(worker) == pass_cost.FALLBACK_TILE_ROWS
    assert "could not measure" in caplog.text and "--tree-tile-rows" in caplog.text


def test_rows_a_short_context_cannot_hold_are_left_out(target_lm):
    worker = TargetWorker(ModelRunner(target_lm, 24, role="target"))
    costs = measure_pass_costs(worker, rows=(16, 32), reps=1, context=12)
    assert set(costs) == {1}  # a sequence's 12+ history tokens and 16 rows exceed max_model_len 24


def test_a_device_without_a_known_tile_measures_its_own(target_lm, monkeypatch):
    """On a GPU (no tile by construction) the worker measures the knee when it starts; here the CPU stands in."""
    monkeypatch.setattr(workers, "tile_rows_of", lambda device, rows=0: rows or 0)
    seen = []
    monkeypatch.setattr(pass_cost, "measure_pass_costs", lambda worker: seen.append(worker) or
                        {1: 1.0, 16: 1.0, 32: 1.05, 64: 2.0})
    worker = TargetWorker(ModelRunner(target_lm, 256, role="target"))
    assert seen == [worker] and worker.tree_tile_rows == 32
    assert TargetWorker(ModelRunner(target_lm, 256, role="target"), tree_tile_rows=8).tree_tile_rows == 8
    assert len(seen) == 1  # a tile given is not measured
