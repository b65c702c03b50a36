"""The EAGLE-3 head: training-time test equal to drafting, the published layout's loader and its refusals, and
the target's features (the inputs of the asked layers) as transformers computes them."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.calls import VerifyCall, until_finished
from specdec.engine.eagle3 import Eagle3Config, Eagle3Head, HeadCache
from specdec.engine.eagle3_files import load_head, save_head
from specdec.engine.runner import ModelRunner
from specdec.engine.workers import TargetWorker
from specdec.errors import ConfigError
from specdec.proposal import Proposal
from specdec.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0)


def _random_head(vocab: int = 300, draft_vocab: int = 100, seed: int = 0, hidden: int = 32) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config(hidden_size=hidden, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=vocab, draft_vocab_size=draft_vocab))
    with torch.no_grad():
        for p in (head.input_layernorm, head.hidden_norm, head.post_attention_layernorm, head.norm):
            p.add_(0.1 * torch.randn_like(p))
        head.d2t.copy_(torch.arange(draft_vocab) * 2)  # draft id i is target id 3i
        head.t2d[head.target_ids()] = True
    return head.eval()


def test_training_time_test_equals_drafting():
    """Step s of train_steps at position p is what drafting computes there: the cache of step 0 up to p - s,
    then s steps each on the head's own output (the negative control: step 1 without the diagonal differs)."""
    head = _random_head()
    ids, feats = torch.randint(0, 300, (14,)), torch.randn(14, 96)
    with torch.no_grad():
        outs = head.train_steps(ids, feats, 3)
        cache = HeadCache(2, 8, torch.float32, torch.device("cpu"))
        logits, _ = head.step(ids[1:], feats[:13], torch.arange(13), cache)
        torch.testing.assert_close(outs[0], logits, atol=1e-5, rtol=1e-5)
        for s in (1, 2):
            for p in (s, 6, 12):
                c = HeadCache(2, 8, torch.float32, torch.device("cpu"))
                _, prenorm = head.step(ids[1:p - s + 2], feats[:p - s + 1], torch.arange(p - s + 1), c)
                h = prenorm[-1]
                for i in range(1, s + 1):
                    step_logits, pre = head.step(ids[p - s + i + 1:p - s + i + 2], h[None],
                                                 torch.tensor([p - s + i]), c)
                    h = pre[0]
                torch.testing.assert_close(outs[s][p], step_logits[0], atol=1e-5, rtol=1e-5)
        # without the head's own outputs (the target's features at every step) step 1 is another function
        assert not torch.allclose(outs[1][6], outs[0][6], atol=1e-3)


def test_draft_ids_map_to_target_ids():
    head = _random_head()
    logits = torch.randn(2, 100)
    full = head.to_target_logits(logits)
    assert full.shape == (2, 300)
    assert torch.equal(full[:, ::3][:, :100], logits)
    assert torch.isinf(full[:, 1]).all()
    assert int(full[0].argmax()) == 3 * int(logits[0].argmax())


def _fed_then_drafted(heads) -> list[tuple[torch.Tensor, ...]]:
    """Each head (of ``_random_head(hidden=64)``'s shape) fed 11 positions with target features, then one tree level
    of 3 nodes from its own outputs: (logits, prenorm) of both steps, the same inputs for every head."""
    g = torch.Generator().manual_seed(1)
    ids, feats = torch.randint(0, 300, (12,), generator=g), torch.randn(12, 3 * 64, generator=g)
    out = []
    with torch.no_grad():
        for h in heads:
            cache = HeadCache(2, 16, torch.float32, torch.device("cpu"))
            logits, prenorm = h.step(ids[1:], feats[:11], torch.arange(11), cache)
            drafted, after = h.step(ids[:3], prenorm[-3:], torch.tensor([11, 11, 12]), cache,
                                    mask=torch.ones(3, 14, dtype=torch.bool))
            out.append((logits, prenorm, drafted, after))
    return out


def test_a_quantized_head_drafts_what_the_float_head_does_within_int8_error():
    """quantize("int8"): every product a W8A8 QuantLinear (the head reads a quarter of fp32's bytes per step); its
    logits stay close to the float head's, through the fed history and a drafted step from its own output."""
    import copy

    from specdec.engine.eagle3_files import quantize_head
    from specdec.engine.quant import QuantLinear

    head = _random_head(hidden=64)
    quant = copy.deepcopy(head)
    assert quantize_head(quant, "auto") == "int8"
    fused = {part for parts in Eagle3Head.FUSED.values() for part in parts}
    assert all(isinstance(getattr(quant, name), QuantLinear) for name in Eagle3Head.LINEARS if name not in fused)
    assert all(isinstance(getattr(quant, name), QuantLinear) and getattr(quant, part) is None  # q, k, v as one
               for name, parts in Eagle3Head.FUSED.items() for part in parts)
    got = [torch.cat([logits, drafted]) for logits, _, drafted, _ in _fed_then_drafted((head, quant))]
    cos = torch.nn.functional.cosine_similarity(got[0], got[1], dim=-1)
    assert cos.min() > 0.99, cos
    assert not torch.equal(got[0], got[1])  # (it is another formulation)
    plain = copy.deepcopy(head)
    assert quantize_head(plain, "none") == "none" and isinstance(plain.fc, torch.nn.Linear)
    with pytest.raises(ConfigError, match="fp8 runs on CUDA only"):
        quantize_head(copy.deepcopy(head), "fp8")


def test_quantize_fuses_the_products_that_share_an_input_with_the_same_outputs():
    """quantize() makes q, k and v one product, and gate and up another: each output column keeps its weight scale
    and the input its one scale, so the head's logits and outputs are bitwise those of the separate products."""
    import copy

    from specdec.engine.quant import QuantLinear

    head = _random_head(hidden=64)
    separate = copy.deepcopy(head)
    for name in Eagle3Head.LINEARS:
        linear = getattr(separate, name)
        del separate._modules[name]
        object.__setattr__(separate, name, QuantLinear(linear.weight.detach()))
    fused = copy.deepcopy(head).quantize("int8")
    assert set(fused._fused_sizes) == {"qkv_proj", "gate_up_proj"} and fused.q_proj is None
    got = _fed_then_drafted((separate, fused))
    assert all(torch.equal(a, b) for a, b in zip(*got))


@pytest.mark.parametrize("with_embedding", [True, False])
def test_published_layout_round_trip(tmp_path, with_embedding):
    head = _random_head()
    save_head(head, tmp_path, (0, 1, 2), with_embedding=with_embedding)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 100
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= names
    assert ("embed_tokens.weight" in names) == with_embedding
    embedding = None if with_embedding else head.embed_tokens.weight.detach().clone()
    loaded, layers = load_head(tmp_path, target_hidden_size=32, target_vocab_size=300, target_num_layers=4,
                               target_embedding=embedding)
    assert layers == (0, 1, 2)
    ids, feats = torch.randint(0, 300, (9,)), torch.randn(9, 96)
    with torch.no_grad():
        torch.testing.assert_close(loaded.train_steps(ids, feats, 2)[1], head.train_steps(ids, feats, 2)[1])


def test_pytorch_model_bin_and_default_layers(tmp_path):
    """A head saved as pytorch_model.bin without eagle_config reads vLLM's default layers (2, L/2, L-3)."""
    head = _random_head()
    save_head(head, tmp_path)
    from safetensors.torch import load_file

    torch.save(load_file(str(tmp_path / "model.safetensors")), tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    _, layers = load_head(tmp_path, target_hidden_size=32, target_vocab_size=300, target_num_layers=30)
    assert layers == (2, 15, 27)


@pytest.mark.parametrize("change, message", [
    ({"target_hidden_size": 64}, "trained for another target"),
    ({"target_vocab_size": 301}, "trained for another target"),
    ({"target_num_layers": 2, "layers": (0, 1, 2)}, "reads target layers"),
    ({"drop_embedding": True}, "shares the target's token embedding"),
    ({"config": {"speculators_model_type": "eagle3"}}, "speculators layout"),
    ({"config": {"intermediate_size": 65}}, "has shape"),
    ({"extra_weight": True}, "unexpected weights"),
])
def test_load_refuses_a_head_that_does_not_fit(tmp_path, change, message):
    head = _random_head()
    save_head(head, tmp_path, change.get("layers"), with_embedding=not change.get("drop_embedding"))
    if "config" in change:
        raw = json.loads((tmp_path / "config.json").read_text())
        raw.update(change["config"])
        (tmp_path / "config.json").write_text(json.dumps(raw))
    if change.get("extra_weight"):
        from safetensors.torch import load_file, save_file

        weights = load_file(str(tmp_path / "model.safetensors"))
        weights["midlayer.extra.weight"] = torch.zeros(2)
        save_file(weights, str(tmp_path / "model.safetensors"))
    kw = {"target_hidden_size": 32, "target_vocab_size": 300, "target_num_layers": 4}
    kw.update({k: v for k, v in change.items() if k.startswith("target_")})
    with pytest.raises(ConfigError, match=message):
        load_head(tmp_path, **kw)


# -- the target's features -------------------------------------------------------------------------
@pytest.mark.parametrize("lean", [True, False])
def test_verify_returns_the_inputs_of_the_asked_layers(target_lm, target_model, lean):
    """Prefill returns every prompt position's features; a round returns the positions whose next token it
    decided (the accepted drafts, the history fed), each the transformers model's hidden states."""
    worker = TargetWorker(ModelRunner(target_lm, 128, role="target", lean_forward=lean))
    ids = list(range(100, 130))
    layers = (2, 1, 1)
    with torch.no_grad():
        hs = target_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    expected = torch.cat([hs[i][0] for i in layers], dim=-1)

    first = until_finished(worker.verify_batch, VerifyCall("s", ids[:20], Proposal([]), GREEDY,
                                                           feature_layers=layers, feature_start=0))
    f = first.features
    assert (f.start, f.rows, f.width) == (0, 20, 3 * 64)
    # transformers' own forward over the whole sequence vs this target's passes: rounding only
    torch.testing.assert_close(f.data, expected[:20], atol=2e-4, rtol=1e-3)
    history = ids[:20] + [first.next_token_id]
    drafts = [first.next_token_id, 5, 6]  # a draft that repeats the last token: at least one row to compare
    second = until_finished(worker.verify_batch, VerifyCall("s", history, Proposal(drafts), GREEDY,
                                                            feature_layers=layers, feature_start=20))
    f = second.features
    assert (f.start, f.rows) == (20, 1 + second.num_accepted_tokens)
    with torch.no_grad():
        hs = target_model(torch.tensor([history + drafts]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(f.data, torch.cat([hs[i][0] for i in layers], dim=-1)[20:f.end], atol=2e-4, rtol=1e-3)
    # no features asked: none computed
    plain = until_finished(worker.verify_batch, VerifyCall("t", ids[:10], Proposal([]), GREEDY))
    assert plain.features is None


def test_features_asked_again_are_read_back_and_chunked_prompts_keep_theirs(target_lm):
    """feature_start before the target's cache (a draft that lost its state): the target's store beside its blocks
    gives those positions back (bfloat16) without feeding them again; other layers than the stored ones are fed
    again; a prompt prefilled in chunks returns the features of every chunk."""
    runner = ModelRunner(target_lm, 256, role="target", max_num_batched_tokens=16)
    worker = TargetWorker(runner)
    ids = list(range(200, 260))
    whole = until_finished(worker.verify_batch, VerifyCall("a", ids, Proposal([]), GREEDY,
                                                           feature_layers=(0, 1, 2), feature_start=0))
    assert (whole.features.start, whole.features.rows) == (0, 60)  # 4 chunks of 16
    again = until_finished(worker.verify_batch, VerifyCall("a", ids + [whole.next_token_id], Proposal([]), GREEDY,
                                                           feature_layers=(0, 1, 2), feature_start=10))
    assert (again.features.start, again.features.rows) == (10, 51)
    assert again.features.data.dtype == whole.features.data.dtype
    torch.testing.assert_close(again.features.data[:50], whole.features.data[10:], atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(again.features.data[50:], until_finished(  # the one position fed: exact
        TargetWorker(ModelRunner(target_lm, 256, role="target")).verify_batch,
        VerifyCall("x", ids + [whole.next_token_id], Proposal([]), GREEDY, feature_layers=(0, 1, 2),
                   feature_start=0)).features.data[60:], atol=1e-5, rtol=1e-4)
    other = until_finished(worker.verify_batch, VerifyCall("a", ids + [whole.next_token_id, 7], Proposal([]), GREEDY,
                                                           feature_layers=(2, 1, 0), feature_start=20))
    assert (other.features.start, other.features.rows) == (20, 42)  # other layers: fed again, full precision
    w = whole.features.data.shape[1] // 3
    torch.testing.assert_close(other.features.data[:40, :w], whole.features.data[20:, 2 * w:], atol=1e-5, rtol=1e-4)
    assert again.next_token_id == until_finished(
        TargetWorker(ModelRunner(target_lm, 256, role="target")).verify_batch,
        VerifyCall("b", ids + [whole.next_token_id], Proposal([]), GREEDY)).next_token_id


def test_a_prefix_cache_hit_returns_the_stored_features_of_the_shared_prompt(target_lm):
    """A second request sharing a finished request's prompt takes its blocks from the prefix cache and their
    features from the store beside them: every position's features come back, the shared blocks are not fed."""
    runner = ModelRunner(target_lm, 256, role="target")
    worker = TargetWorker(runner)
    shared = list(range(200, 240))  # two full blocks of 16 and 8 more
    first = until_finished(worker.verify_batch, VerifyCall("a", shared + [5, 6], Proposal([]), GREEDY,
                                                           feature_layers=(0, 1, 2), feature_start=0))
    worker.release("a")
    hits = runner.cache.stats().prefix_cache_hits
    second = until_finished(worker.verify_batch, VerifyCall("b", shared + [9, 8, 7], Proposal([]), GREEDY,
                                                            feature_layers=(0, 1, 2), feature_start=0))
    assert runner.cache.stats().prefix_cache_hits - hits == 32  # both full blocks of the shared prompt
    assert (second.features.start, second.features.rows) == (0, 43)
    torch.testing.assert_close(second.features.data[:40], first.features.data[:40], atol=1e-2, rtol=8e-3)
    fresh = until_finished(TargetWorker(ModelRunner(target_lm, 256, role="target", enable_prefix_caching=False))
                           .verify_batch, VerifyCall("c", shared + [9, 8, 7], Proposal([]), GREEDY,
                                                     feature_layers=(0, 1, 2), feature_start=0))
    torch.testing.assert_close(second.features.data[32:], fresh.features.data[32:], atol=1e-5, rtol=1e-4)
    assert second.next_token_id == fresh.next_token_id
