"""Every Helm example deploys backends that start: each example's draft and target services are started here,
in this process, from the settings the chart renders for their containers (env + args, parsed by the `specdec`
CLI's own parser), with only what cannot exist on this machine swapped: the models (tiny local folders of the
suite), the device (cpu where the example asks for cuda), the listening address (loopback, any port) and TLS
files (the test PKI's, where the example mounts a Secret). Rendering alone passed for examples whose draft pod
exited at once ("--draft-model-num-speculative-tokens ... needs a model and a lookup method")."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helm.test_chart import EXAMPLES, _parse_like_the_cli, by_component, container, example

NAMES = [p.name.removesuffix("-values.yaml") for p in EXAMPLES]


def _local(config, model, pki, target_dir=None, head=None):
    """The chart's config with what cannot exist here swapped for local stand-ins (``head``: an EAGLE-3 head's, for
    the tiny target)."""
    swaps = {"model": str(model), "revision": None, "host": "127.0.0.1", "port": 0, "num_threads": 1,
             "device": "cpu"}
    if getattr(config, "method", None) == "eagle3":
        swaps.update(model=str(head), target_model=str(target_dir))
    if config.metrics_port is not None:
        swaps["metrics_port"] = 0
    if getattr(config, "target_tokenizer", None):  # the draft's, with TLI
        swaps["target_tokenizer"] = str(target_dir)
    if config.tls_cert_file:
        swaps.update(tls_cert_file=pki.pod_cert, tls_key_file=pki.pod_key,
                     tls_client_ca_file=pki.ca if config.tls_client_ca_file else None)
    return dataclasses.replace(config, **swaps)


@pytest.mark.heavy
@pytest.mark.parametrize("name", NAMES)
def test_the_examples_backends_start_from_the_charts_settings(name, monkeypatch, target_dir, good_draft_dir, pki,
                                                              eagle3_head_dir):
    from draft_service.server import create_server as create_draft
    from target_service.server import create_server as create_target

    deployments = by_component(example(name), "Deployment")
    target_config = _parse_like_the_cli(monkeypatch, container(deployments["target"]))
    draft_config = _parse_like_the_cli(monkeypatch, container(deployments["draft"]))
    handles = []
    try:
        handles.append(create_target(_local(target_config, target_dir, pki)))
        handles.append(create_draft(_local(draft_config, good_draft_dir, pki, target_dir, eagle3_head_dir)))
        for handle in handles:
            assert handle.backend.ready.is_set(), f"{name}: {handle.backend.role} did not load"
    finally:
        for handle in handles:
            handle.stop(0)


def test_hybrid_k_is_rendered_for_hybrid_drafting_only():
    """speculativeConfig.draft_model_num_speculative_tokens reaches the draft only where it applies."""
    from tests.helm.test_chart import env_of

    def draft_env(spec: dict) -> dict:
        return env_of(container(by_component({"speculativeConfig": spec}, "Deployment")["draft"]))

    key = "SPECDEC_DRAFT_DRAFT_MODEL_NUM_SPECULATIVE_TOKENS"
    assert draft_env({})[key] == "3"  # the default pair: suffix decoding before the EAGLE-3 head, depth 3
    assert draft_env({"method": "suffix", "draft_model_num_speculative_tokens": 1})[key] == "1"  # suffix + a model
    assert draft_env({"method": "draft_model", "prompt_lookup_max": 4, "num_speculative_tokens": 4,
                      "draft_model_num_speculative_tokens": 1})[key] == "1"
    assert "SPECDEC_DRAFT_ENABLE_SUFFIX_DECODING" not in draft_env({"method": "suffix"})  # the head's key only
    assert key not in draft_env({"method": "draft_model", "num_speculative_tokens": 4})
    assert key not in draft_env({"method": "ngram", "prompt_lookup_max": 4})
    assert key not in draft_env({"method": "suffix", "model": "none"})


def test_token_trees_reach_the_draft_and_it_starts_with_them(monkeypatch, target_dir, good_draft_dir, pki):
    """speculativeConfig.speculative_token_tree renders the draft's env, and a draft started from it proposes trees."""
    from draft_service.server import create_server as create_draft
    from tests.helm.test_chart import env_of

    deployments = by_component({"speculativeConfig": {"method": "suffix", "speculative_token_tree": "dynamic",
                                                      "num_speculative_tokens": 12, "speculative_eagle_topk": 3}},
                               "Deployment")
    assert env_of(container(deployments["draft"]))["SPECDEC_DRAFT_SPECULATIVE_TOKEN_TREE"] == "dynamic"
    # the default pair drafts trees; null renders nothing (the draft's default: chains)
    assert env_of(container(by_component({}, "Deployment")["draft"]))["SPECDEC_DRAFT_SPECULATIVE_TOKEN_TREE"] == "dynamic"
    assert "SPECDEC_DRAFT_SPECULATIVE_TOKEN_TREE" not in env_of(container(by_component(
        {"speculativeConfig": {"speculative_token_tree": None}}, "Deployment")["draft"]))
    config = _parse_like_the_cli(monkeypatch, container(deployments["draft"]))
    assert (config.speculative_token_tree, config.speculative_eagle_topk) == ("dynamic", 3)
    handle = create_draft(_local(config, good_draft_dir, pki, target_dir))
    try:  # the suffix hybrid: the suffix trees branch, the draft model grows top-3 trees
        assert handle.backend.ready.wait(60) and handle.backend.lookup.settings.token_tree
        assert handle.backend.worker.model.tree.top_k == 3
    finally:
        handle.stop(0)
