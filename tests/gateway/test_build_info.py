"""The gateway's ``specdec_build_info`` method label is the drafting its draft service reports (GetInfo's
method): draft_model, ngram or hybrid, and target_only without a draft service. The served n-gram and hybrid
stacks check it end to end (tests/gateway/test_ngram_serving.py); tests/gateway/test_metrics.py the model draft."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.generation import Gateway


@pytest.mark.parametrize("draft_info, method", [
    (None, "target_only"),
    (SimpleNamespace(method="draft_model"), "draft_model"),
    (SimpleNamespace(method="ngram"), "ngram"),
    (SimpleNamespace(method="hybrid"), "hybrid"),
    (SimpleNamespace(method=""), "draft_model"),  # a draft service too old to say: it drafts with a model
])
def test_speculative_method_is_the_draft_services(draft_info, method):
    gateway = Gateway.__new__(Gateway)  # the property reads only what GetInfo answered
    gateway.draft_info = draft_info
    assert gateway.speculative_method == method
