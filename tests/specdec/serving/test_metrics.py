"""specdec.serving.metrics: the KV cache pool's series, read from the runner's kv_stats() at scrape time."""

from __future__ import annotations

from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

from specdec.serving import metrics as M


@dataclass
class FakeKVStats:
    """The fields of the engine's KVStats."""

    num_blocks: int = 100
    block_size: int = 16
    free_blocks: int = 75
    used_blocks: int = 25
    usage: float = 0.25
    capacity_tokens: int = 1600
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0


KV_SERIES = ("specdec_kv_cache_", "specdec_prefix_cache_", "specdec_num_preemptions")


def _series(model: str) -> dict[tuple[str, str], float]:
    """(sample name, its family's type) -> value, for the fake model's target."""
    out = {}
    for family in text_string_to_metric_families(M.exposition().decode()):
        for sample in family.samples:
            if sample.labels.get("model_name") == model and sample.name.startswith(KV_SERIES):
                assert sample.labels == {"service": "target", "model_name": model}
                out[(sample.name, family.type)] = sample.value
    return out


def test_kv_cache_series_are_read_at_scrape_time():
    model = "kv-test-model"
    stats = FakeKVStats()
    service = M.ServiceMetrics("target", model)
    service.track_kv_cache(lambda: stats)
    assert _series(model) == {
        ("specdec_kv_cache_usage_ratio", "gauge"): 0.25,
        ("specdec_kv_cache_free_blocks", "gauge"): 75,
        ("specdec_prefix_cache_queries_total", "counter"): 0,
        ("specdec_prefix_cache_hits_total", "counter"): 0,
        ("specdec_num_preemptions_total", "counter"): 0,
    }
    # the runner's cumulative counts are the counters; a scrape reads the pool as it is now
    stats = replace(stats, usage=0.5, free_blocks=50, used_blocks=50, prefix_cache_queries=320,
                    prefix_cache_hits=96, preemptions=2)
    after = _series(model)
    assert after[("specdec_kv_cache_usage_ratio", "gauge")] == 0.5
    assert after[("specdec_kv_cache_free_blocks", "gauge")] == 50
    assert after[("specdec_prefix_cache_queries_total", "counter")] == 320
    assert after[("specdec_prefix_cache_hits_total", "counter")] == 96
    assert after[("specdec_num_preemptions_total", "counter")] == 2
    service.untrack_kv_cache()
    assert _series(model) == {}


def test_a_failing_pool_does_not_fail_the_scrape():
    def broken():
        raise RuntimeError("not loaded")

    service = M.ServiceMetrics("target", "kv-broken-model")
    service.track_kv_cache(broken)
    try:
        assert "# TYPE specdec_kv_cache_usage_ratio gauge" in M.exposition().decode()
        assert _series("kv-broken-model") == {}
    finally:
        service.untrack_kv_cache()


def test_a_closed_backend_does_not_remove_a_newer_pool_under_its_labels():
    old, new = M.ServiceMetrics("target", "kv-restart-model"), M.ServiceMetrics("target", "kv-restart-model")
    old.track_kv_cache(lambda: FakeKVStats(preemptions=1))
    new.track_kv_cache(lambda: FakeKVStats(preemptions=7))
    old.untrack_kv_cache()
    try:
        assert _series("kv-restart-model")[("specdec_num_preemptions_total", "counter")] == 7
    finally:
        new.untrack_kv_cache()


def _build_info_series(service: str, model: str) -> list[dict]:
    text = M.exposition().decode()
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "specdec_build_info" and s.labels["service"] == service and s.labels["model_name"] == model]


def test_build_info_is_one_series_per_service_and_model():
    """A service configured again in the same process replaces its build_info labels: one series says 1, with
    the method it runs now (not the first one's)."""
    M.set_build_info("gateway", "build-info-model", num_speculative_tokens=4, method="draft_model")
    M.set_build_info("gateway", "build-info-other", num_speculative_tokens=2, method="ngram")
    M.set_build_info("gateway", "build-info-model", num_speculative_tokens=0, method="target_only")
    (series,) = _build_info_series("gateway", "build-info-model")
    assert (series["method"], series["num_speculative_tokens"]) == ("target_only", "0")
    (other,) = _build_info_series("gateway", "build-info-other")  # another model's series stays
    assert other["method"] == "ngram"
