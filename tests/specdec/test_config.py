"""The embedded default pair's config (specdec.config.default_speculative_config) on a machine without
ArcticInference: the first command still serves, drafting with the pair's EAGLE-3 head, and says why."""

from __future__ import annotations

import logging

import pytest

import specdec.config as config
import specdec.suffix as suffix
from specdec.config import SpeculativeConfig, default_speculative_config, draft_model_pair_config
from specdec.errors import ConfigError


@pytest.fixture
def no_arctic(monkeypatch):
    def missing():
        raise ConfigError(f"{suffix.INSTALL_HINT} (No module named 'arctic_inference')")

    monkeypatch.setattr(config, "suffix_tree_class", missing)
    monkeypatch.setattr(config, "_warned", set())


def test_the_default_pair_drafts_suffix_trees_where_arcticinference_is_installed():
    assert suffix.suffix_available() == (True, "")
    pair = default_speculative_config()
    assert pair["method"] == "eagle3" and pair["enable_suffix_decoding"] and pair["speculative_token_tree"] == "dynamic"
    assert pair["model"] == config.DEFAULT_EAGLE3_HEAD and pair["suffix_decoding_min_score"] == 1.5
    assert pair["speculative_eagle_topk"] == config.DEFAULT_PAIR_HEAD_TOP_K == 6
    assert SpeculativeConfig.from_any(pair).uses_suffix
    assert draft_model_pair_config()["method"] == "suffix"  # the pair before the head, still one call away


def test_without_arcticinference_the_default_pair_drafts_with_its_head(no_arctic, caplog):
    ok, why = suffix.suffix_available()
    assert not ok and "arctic-inference" in why
    with caplog.at_level(logging.WARNING, logger="specdec.config"):
        pair = default_speculative_config()
        default_speculative_config()
    assert pair == {"method": "eagle3", "model": config.DEFAULT_EAGLE3_HEAD, "num_speculative_tokens": 3,
                    "speculative_eagle_topk": config.DEFAULT_PAIR_HEAD_TOP_K,
                    "disable_by_batch_size": config.DEFAULT_PAIR_DISABLE_BY_BATCH_SIZE,
                    "speculative_token_tree": "dynamic"}
    spec = SpeculativeConfig.from_any(pair)  # a config every part accepts
    assert spec.method == "eagle3" and spec.tree_shape() is not None and not spec.uses_suffix
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no suffix decoding" in warnings[0] and "pip install" in warnings[0]
    assert draft_model_pair_config()["method"] == "draft_model"  # the draft-model pair's own fallback


def test_serve_without_a_model_takes_the_fallback(no_arctic):
    from specdec.entrypoints.serve import ServeConfig, resolve_speculative_config

    spec = resolve_speculative_config(ServeConfig())
    assert spec.method == "eagle3" and not spec.enable_suffix_decoding


def test_asking_for_suffix_without_arcticinference_is_still_refused(no_arctic):
    with pytest.raises(ConfigError, match="arctic-inference"):
        suffix.SuffixCache()
