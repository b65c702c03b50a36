"""The offline LLM API: stop conditions inside accepted blocks, max_model_len, request validation,
seeds and n, speculative_config validation, deprecated kwargs, vocabulary mismatch."""

from __future__ import annotations

import json
import warnings

import pytest

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.config import DEFAULT_NUM_SPECULATIVE_TOKENS
from specdec.proposal import MAX_NUM_SPECULATIVE_TOKENS
from specdec.errors import ConfigError, InvalidRequestError

pytestmark = pytest.mark.usefixtures("cached_model_loading")

PROMPT = "The quick brown fox"  # = conftest.PROMPTS[0]
K = 4  # with the target as its own draft every round accepts all K drafts: blocks of K + 1 tokens


def _greedy(**kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0, **kw)


@pytest.fixture(scope="module")
def self_spec_llm(target_dir, spec):
    """Target drafting for itself: every draft is accepted, so rounds emit K + 1 tokens."""
    return LLM(str(target_dir), speculative_config=spec(target_dir, K), dtype="float32")


@pytest.fixture(scope="module")
def ref(target_greedy_ref):
    ids, tokens = target_greedy_ref[PROMPT]
    return ids, tokens


def _produced(stats):
    """Tokens the rounds produced (accepted drafts + one bonus/recovered token per target pass)."""
    return stats.num_accepted_tokens + stats.num_target_passes


# --------------------------------------------------------------------------------------------------
# max_tokens / EOS / stop tokens / stop strings inside accepted blocks


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 6, 7, 9, 13])
def test_max_tokens_ends_exactly(self_spec_llm, ref, max_tokens):
    out = self_spec_llm.generate(PROMPT, _greedy(max_tokens=max_tokens))[0].outputs[0]
    assert len(out.token_ids) == max_tokens
    assert out.token_ids == ref[1][:max_tokens]
    assert out.finish_reason == "length" and out.stop_reason is None
    s = out.spec_decode_stats
    assert s.num_accepted_tokens == s.num_draft_tokens  # the self-draft is always accepted
    assert _produced(s) == max_tokens  # drafting was capped by the budget: nothing produced in vain


@pytest.fixture(scope="module")
def eos_case(target_dir, ref, tmp_path_factory):
    """A copy of the target (symlinked weights) whose generation_config declares ref[j] an EOS token."""
    tokens = ref[1]
    j = next(i for i in range(6, len(tokens)) if tokens[i] not in tokens[:i] and (i + 1) % (K + 1))
    folder = tmp_path_factory.mktemp("eos-target")
    for f in target_dir.iterdir():
        if f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    gen = json.loads((target_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], tokens[j]]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder, j


def test_eos_inside_accepted_block_ends_there(eos_case, target_dir, ref, spec):
    folder, j = eos_case
    tokens = ref[1]
    llm = LLM(str(folder), speculative_config=spec(target_dir, K), dtype="float32")
    assert tokens[j] in llm.target.eos_token_ids
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert out.token_ids == tokens[: j + 1]  # EOS is the last token id ...
    assert out.text == llm.get_tokenizer().decode(tokens[:j])  # ... and is not in the text
    assert out.finish_reason == "stop" and out.stop_reason is None
    # the EOS was mid-block: the round produced tokens after it, which were dropped
    assert _produced(out.spec_decode_stats) > len(out.token_ids)
    # ignore_eos: generation runs through it
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == tokens[:20] and out.finish_reason == "length"


def test_eos_target_alone(eos_case, ref):
    folder, j = eos_case
    llm = LLM(str(folder), dtype="float32")
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert out.token_ids == ref[1][: j + 1] and out.finish_reason == "stop"


def test_stop_token_ids_inside_accepted_block(self_spec_llm, ref, tokenizer):
    tokens = ref[1]
    j = next(i for i in range(7, len(tokens)) if tokens[i] not in tokens[:i] and (i + 1) % (K + 1))
    out = self_spec_llm.generate(PROMPT, _greedy(stop_token_ids=[tokens[j]]))[0].outputs[0]
    assert out.token_ids == tokens[: j + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tokens[j]
    assert out.text == tokenizer.decode(tokens[:j])
    assert _produced(out.spec_decode_stats) > len(out.token_ids)


@pytest.fixture(scope="module")
def stop_case(self_spec_llm, ref, tokenizer):
    """A stop string spanning the boundary between two tokens in the middle of an accepted block."""
    tokens = ref[1]
    full = self_spec_llm.generate(PROMPT, _greedy())[0].outputs[0]
    text = full.text
    assert text == tokenizer.decode(tokens[:24])
    ends = [len(tokenizer.decode(tokens[: i + 1])) for i in range(24)]
    for j in range(6, 20):
        if (j + 2) % (K + 1) == 0:
            continue  # token j + 1 would end its round: the stop must complete mid-block
        b = ends[j]
        stop = text[b - 2 : b + 2]
        if (
            len(stop) == 4
            and stop.isprintable()
            and ends[j] - ends[j - 1] >= 2
            and ends[j + 1] - ends[j] >= 2
            and text.find(stop) == b - 2
        ):
            return text, stop, j + 2  # the stop string completes with token j + 1
    pytest.fail(f"no suitable token boundary in {text!r}")


def test_stop_string_spanning_tokens_inside_accepted_block(self_spec_llm, stop_case, ref):
    text, stop, num_tokens = stop_case
    out = self_spec_llm.generate(PROMPT, _greedy(stop=[stop]))[0].outputs[0]
    assert out.text == text[: text.find(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == ref[1][:num_tokens]
    assert _produced(out.spec_decode_stats) > num_tokens


def test_stop_string_include_in_output(self_spec_llm, stop_case):
    text, stop, _ = stop_case
    out = self_spec_llm.generate(PROMPT, _greedy(stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert out.text == text[: text.find(stop) + len(stop)] and out.text.endswith(stop)
    assert out.stop_reason == stop


def test_stop_strings_earliest_wins_and_unmatched(self_spec_llm, stop_case):
    text, stop, _ = stop_case
    later = text[text.find(stop) + 6 : text.find(stop) + 9]
    assert len(later) == 3 and text.find(later) > text.find(stop)
    out = self_spec_llm.generate(PROMPT, _greedy(stop=[later, stop, "never-there-\u2603"]))[0].outputs[0]
    assert out.stop_reason == stop and out.text == text[: text.find(stop)]
    out = self_spec_llm.generate(PROMPT, _greedy(stop=["never-there-\u2603"]))[0].outputs[0]
    assert out.finish_reason == "length" and out.text == text


def test_stop_string_streaming(self_spec_llm, stop_case):
    text, stop, _ = stop_case
    ids = self_spec_llm.get_tokenizer()(PROMPT).input_ids
    seq = self_spec_llm.new_sequence(ids, _greedy(stop=[stop]))
    deltas = list(self_spec_llm.stream(seq))
    # the stream never released a piece of the stop string: what it sent is exactly the final text
    assert "".join(deltas) == seq.text == text[: text.find(stop)]
    assert len(deltas) > 1 and seq.finish_reason == "stop"


# --------------------------------------------------------------------------------------------------
# max_model_len


def _record_proposals(llm):
    seen = []
    worker = llm._draft_worker
    original = worker.propose

    def propose(sequence_id, token_ids, k, params):
        seen.append((len(token_ids), k))
        return original(sequence_id, token_ids, k, params)

    worker.propose = propose
    return seen


@pytest.mark.parametrize("room", [1, 2, 5, 7, 11])
def test_max_model_len_stops_with_length(target_dir, ref, spec, room):
    ids, tokens = ref
    max_len = len(ids) + room
    llm = LLM(str(target_dir), speculative_config=spec(target_dir, K), dtype="float32", max_model_len=max_len)
    seen = _record_proposals(llm)
    for max_tokens in (None, 100):
        out = llm.generate(PROMPT, _greedy(max_tokens=max_tokens))[0].outputs[0]
        assert len(ids) + len(out.token_ids) == max_len
        assert out.token_ids == tokens[:room]
        assert out.finish_reason == "length"
    # the draft never drafted past the end: drafts + the bonus token fit in max_model_len
    assert all(n + k < max_len for n, k in seen) and all(k >= 1 for _, k in seen)
    assert seen or room == 1


def test_max_model_len_target_alone(target_dir, ref):
    ids, tokens = ref
    llm = LLM(str(target_dir), dtype="float32", max_model_len=len(ids) + 6)
    out = llm.generate(PROMPT, _greedy(max_tokens=None))[0].outputs[0]
    assert out.token_ids == tokens[:6] and out.finish_reason == "length"


def test_max_model_len_from_speculative_config(target_dir, good_draft_dir, ref, spec):
    ids, tokens = ref
    llm = LLM(str(target_dir), speculative_config=spec(good_draft_dir, 8, max_model_len=len(ids) + 9), dtype="float32")
    assert llm.max_model_len == len(ids) + 9
    out = llm.generate(PROMPT, _greedy(max_tokens=None))[0].outputs[0]
    assert out.token_ids == tokens[:9] and out.finish_reason == "length"


def test_max_model_len_limited_by_draft_context(target_dir, short_ctx_draft_dir, ref, spec):
    """A draft with a 64-token context caps the pair at 64 and generation ends there cleanly."""
    ids, tokens = ref
    llm = LLM(str(target_dir), speculative_config=spec(short_ctx_draft_dir, 8), dtype="float32")
    assert llm.max_model_len == 64
    seen = _record_proposals(llm)
    out = llm.generate(PROMPT, _greedy(max_tokens=None))[0].outputs[0]
    assert len(ids) + len(out.token_ids) == 64 and out.finish_reason == "length"
    assert out.token_ids[:32] == tokens
    assert all(n + k < 64 for n, k in seen)
    assert LLM(str(target_dir), dtype="float32").max_model_len == 256  # the target alone: its own limit
    assert LLM(str(target_dir), dtype="float32", max_model_len=10_000).max_model_len == 256


# --------------------------------------------------------------------------------------------------
# request validation


@pytest.mark.parametrize(
    "prompt",
    ["", {"prompt_token_ids": []}, {"prompt": ""}],
    ids=["empty-string", "empty-ids", "empty-dict-prompt"],
)
def test_empty_prompt_rejected(self_spec_llm, prompt):
    with pytest.raises(InvalidRequestError) as exc:
        self_spec_llm.generate(prompt, _greedy())
    assert exc.value.param == "prompt"


@pytest.mark.parametrize("bad_id", [49152, 10**9, -1])
def test_out_of_vocab_prompt_ids_rejected(self_spec_llm, bad_id):
    with pytest.raises(InvalidRequestError) as exc:
        self_spec_llm.generate({"prompt_token_ids": [5, bad_id, 7]}, _greedy())
    assert exc.value.param == "prompt" and str(bad_id) in str(exc.value)


def test_padded_target_vocab_with_unpadded_draft(padded_target_dir, good_draft_dir, spec):
    """Prompt ids the target's padded embedding has but its tokenizer never produces (and the draft
    lacks) are refused as an invalid prompt, naming the ids — never an IndexError from inside the
    draft model. Ids both have decode exactly as the target alone does."""
    llm = LLM(str(padded_target_dir), speculative_config=spec(good_draft_dir, 3), dtype="float32")
    assert llm.target.vocab_size == 49152 + 64 and llm.draft.vocab_size == 49152
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(max_tokens=4))[0].outputs[0]
    alone = LLM(str(padded_target_dir), dtype="float32").generate({"prompt_token_ids": [5, 6, 7]}, _greedy(max_tokens=4))
    assert out.token_ids == alone[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match=str(49152 + 10)) as exc:
        llm.generate({"prompt_token_ids": [5, 49152 + 10, 7]}, _greedy(max_tokens=4))
    assert exc.value.param == "prompt"


def test_prompt_at_or_over_max_model_len_rejected(target_dir, spec):
    llm = LLM(str(target_dir), speculative_config=spec(target_dir, 2), dtype="float32", max_model_len=8)
    for n in (8, 9, 50):
        with pytest.raises(InvalidRequestError) as exc:
            llm.generate({"prompt_token_ids": list(range(100, 100 + n))}, _greedy())
        assert exc.value.param == "prompt" and "max_model_len" in str(exc.value)
    out = llm.generate({"prompt_token_ids": list(range(100, 107))}, _greedy())[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_bad_prompt_type_and_params_count(self_spec_llm):
    with pytest.raises(InvalidRequestError) as exc:
        self_spec_llm.generate([123], _greedy())
    assert exc.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as exc:
        self_spec_llm.generate(["a", "b"], [_greedy()])
    assert exc.value.param == "sampling_params"


def test_invalid_request_in_batch_fails_before_generating(self_spec_llm):
    with pytest.raises(InvalidRequestError):
        self_spec_llm.generate([PROMPT, ""], _greedy())
    assert not self_spec_llm._target_worker.runner.sequences


def test_prompt_forms_and_outputs(self_spec_llm, ref, tokenizer):
    ids, tokens = ref
    outs = self_spec_llm.generate(
        [PROMPT, {"prompt_token_ids": ids}, {"prompt": PROMPT}], [_greedy(max_tokens=5), _greedy(max_tokens=6), _greedy(max_tokens=7)]
    )
    assert [o.request_id for o in outs] == ["0", "1", "2"]
    assert [o.prompt for o in outs] == [PROMPT, None, PROMPT]
    assert all(o.prompt_token_ids == ids and o.finished for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == [tokens[:5], tokens[:6], tokens[:7]]
    assert outs[0].outputs[0].text == tokenizer.decode(tokens[:5])
    assert self_spec_llm.get_tokenizer() is self_spec_llm.target.tokenizer
    assert self_spec_llm.num_speculative_tokens == K


# --------------------------------------------------------------------------------------------------
# seeds and n


@pytest.fixture(scope="module")
def good_spec_llm(target_dir, good_draft_dir, spec):
    return LLM(str(target_dir), speculative_config=spec(good_draft_dir, 3, draft_sample_method="probabilistic"), dtype="float32")


@pytest.fixture(scope="module")
def plain_llm(target_dir):
    return LLM(str(target_dir), dtype="float32")


def _texts(llm, seed, n=1, **kw):
    params = SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=16, ignore_eos=True, **kw)
    return [o.token_ids for o in llm.generate(PROMPT, params)[0].outputs]


@pytest.mark.parametrize("which", ["plain_llm", "good_spec_llm"])
def test_seeded_runs_reproduce(request, which):
    llm = request.getfixturevalue(which)
    a = _texts(llm, seed=123)
    assert a == _texts(llm, seed=123)
    others = [_texts(llm, seed=s) for s in (124, 125, 126)]
    assert any(o != a for o in others)
    assert len(a[0]) == 16


def test_seeded_runs_reproduce_across_instances(target_dir, good_draft_dir, good_spec_llm, spec):
    fresh = LLM(str(target_dir), speculative_config=spec(good_draft_dir, 3, draft_sample_method="probabilistic"), dtype="float32")
    assert _texts(fresh, seed=7, top_k=20) == _texts(good_spec_llm, seed=7, top_k=20)


def test_unseeded_requests_differ_but_llm_seed_reproduces(target_dir):
    a = LLM(str(target_dir), dtype="float32", seed=5)
    b = LLM(str(target_dir), dtype="float32", seed=5)
    first = _texts(a, seed=None)
    assert first != _texts(a, seed=None)  # consecutive unseeded requests get fresh seeds
    assert first == _texts(b, seed=None)  # ... drawn from the LLM's own seeded RNG


@pytest.mark.parametrize("which", ["plain_llm", "good_spec_llm"])
def test_n_outputs(request, which):
    llm = request.getfixturevalue(which)
    out = llm.generate(PROMPT, SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=8, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    again = llm.generate(PROMPT, SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=8, ignore_eos=True))[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    # output 0 of an n=4 request is the n=1 request with the same seed
    single = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=9, max_tokens=8, ignore_eos=True))[0]
    assert single.outputs[0].token_ids == out.outputs[0].token_ids


def test_n_greedy_outputs_identical(good_spec_llm, ref):
    out = good_spec_llm.generate(PROMPT, _greedy(n=3, max_tokens=10))[0]
    assert len(out.outputs) == 3 and all(o.token_ids == ref[1][:10] for o in out.outputs)
    stats = out.spec_decode_stats  # merged over the three outputs
    assert stats.num_draft_tokens == sum(o.spec_decode_stats.num_draft_tokens for o in out.outputs)


# --------------------------------------------------------------------------------------------------
# speculative_config validation


def test_unknown_keys_list_valid_keys():
    with pytest.raises(ConfigError) as exc:
        SpeculativeConfig.from_any({"model": "x", "num_speculative_token": 3, "draft_tensor_parallel_size": 1})
    msg = str(exc.value)
    assert "num_speculative_token" in msg and "draft_tensor_parallel_size" in msg
    for key in SpeculativeConfig.valid_keys():
        assert key in msg
    assert {"model", "method", "num_speculative_tokens", "draft_sample_method", "use_heterogeneous_vocab"} <= set(
        SpeculativeConfig.valid_keys()
    )


@pytest.mark.parametrize("k", [0, -1, MAX_NUM_SPECULATIVE_TOKENS + 1, 100, 2.5, "4", True, None])
def test_bad_num_speculative_tokens(k):
    with pytest.raises(ConfigError) as exc:
        SpeculativeConfig.from_any({"model": "x", "num_speculative_tokens": k})
    assert "num_speculative_tokens" in str(exc.value) and str(MAX_NUM_SPECULATIVE_TOKENS) in str(exc.value)


@pytest.mark.parametrize("k", [1, MAX_NUM_SPECULATIVE_TOKENS])
def test_num_speculative_tokens_bounds_ok(k):
    assert SpeculativeConfig.from_any({"model": "x", "num_speculative_tokens": k}).num_speculative_tokens == k


@pytest.mark.parametrize("method", ["eagle", "medusa", "mtp", ""])
def test_unsupported_method(method):
    with pytest.raises(ConfigError) as exc:
        SpeculativeConfig.from_any({"model": "x", "method": method})
    assert "draft_model" in str(exc.value) and "ngram" in str(exc.value)


@pytest.mark.parametrize("value", ["typical", "Greedy", "", None])
def test_bad_draft_sample_method(value):
    with pytest.raises(ConfigError) as exc:
        SpeculativeConfig.from_any({"model": "x", "draft_sample_method": value})
    assert "greedy" in str(exc.value) and "probabilistic" in str(exc.value)


@pytest.mark.parametrize(
    "value, needle",
    [
        ({"num_speculative_tokens": 3}, "model"),
        ({"model": ""}, "model"),
        ({"model": "x", "use_heterogeneous_vocab": "yes"}, "use_heterogeneous_vocab"),
        ({"model": "x", "max_model_len": 1}, "max_model_len"),
        ({"model": "x", "max_model_len": "64"}, "max_model_len"),
    ],
)
def test_other_bad_configs(value, needle):
    with pytest.raises(ConfigError) as exc:
        SpeculativeConfig.from_any(value)
    assert needle in str(exc.value)


def test_config_forms():
    assert SpeculativeConfig.from_any(None) is None
    cfg = SpeculativeConfig.from_any('{"model": "d", "num_speculative_tokens": 5, "draft_sample_method": "probabilistic"}')
    assert (cfg.model, cfg.method, cfg.num_speculative_tokens, cfg.draft_sample_method) == ("d", "draft_model", 5, "probabilistic")
    assert SpeculativeConfig.from_any(cfg) is cfg
    assert SpeculativeConfig.from_any({"model": "d"}).num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS
    with pytest.raises(ConfigError, match="JSON"):
        SpeculativeConfig.from_any("{model: d}")
    with pytest.raises(ConfigError, match="dict"):
        SpeculativeConfig.from_any(["model", "d"])


def test_llm_validates_config_before_loading(tmp_path):
    """Config errors surface as ConfigError even when the models do not exist."""
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM(missing, speculative_config={"model": missing, "num_speculative_tokens": 0})
    with pytest.raises(ConfigError, match="valid keys"):
        LLM(missing, speculative_config={"model": missing, "k": 2})


def test_llm_max_model_len_validation(target_dir):
    with pytest.raises(ConfigError):
        LLM(str(target_dir), max_model_len=1)


def test_vocabulary_mismatch_needs_heterogeneous_flag(target_dir, other_vocab_dir, spec):
    with pytest.raises(ConfigError) as exc:
        LLM(str(target_dir), speculative_config=spec(other_vocab_dir, 2), dtype="float32")
    msg = str(exc.value)
    assert "use_heterogeneous_vocab" in msg
    assert str(other_vocab_dir) in msg and "vocabular" in msg


def test_same_tokenizer_different_folder_is_compatible(target_dir, shallow_draft_dir, spec):
    llm = LLM(str(target_dir), speculative_config=spec(shallow_draft_dir, 2), dtype="float32")
    assert llm.draft.tokenizer_fingerprint == llm.target.tokenizer_fingerprint


# --------------------------------------------------------------------------------------------------
# deprecated kwargs


def test_deprecated_speculative_model_kwargs(target_dir, good_draft_dir, ref):
    with pytest.warns(DeprecationWarning, match="speculative_config"):
        llm = LLM(str(target_dir), speculative_model=str(good_draft_dir), num_speculative_tokens=3, dtype="float32")
    assert llm.speculative_config.model == str(good_draft_dir)
    assert llm.num_speculative_tokens == 3 and llm.speculative_config.method == "draft_model"
    out = llm.generate(PROMPT, _greedy(max_tokens=12))[0]
    assert out.outputs[0].token_ids == ref[1][:12]
    assert out.spec_decode_stats.num_draft_tokens > 0
    with pytest.warns(DeprecationWarning):
        llm = LLM(str(target_dir), speculative_model=str(good_draft_dir), dtype="float32")
    assert llm.num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS


def test_deprecated_kwargs_conflicts(target_dir, good_draft_dir, spec):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ConfigError, match="either"):
            LLM(str(target_dir), speculative_config=spec(good_draft_dir, 2), speculative_model=str(good_draft_dir))
        with pytest.raises(ConfigError, match="speculative_model"):
            LLM(str(target_dir), num_speculative_tokens=2)
    with pytest.warns(DeprecationWarning):
        with pytest.raises(ConfigError):
            LLM(str(target_dir), speculative_model=str(good_draft_dir), num_speculative_tokens=0)


def test_no_warning_without_deprecated_kwargs(target_dir, good_draft_dir, spec):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        LLM(str(target_dir), speculative_config=spec(good_draft_dir, 2), dtype="float32")


def test_tli_proposals_values():
    assert SpeculativeConfig.from_any({"model": "x"}).tli_proposals == "text"
    assert SpeculativeConfig.from_any({"model": "x", "tli_proposals": "intersection"}).tli_proposals == "intersection"
    with pytest.raises(ConfigError, match="tli_proposals must be one of"):
        SpeculativeConfig.from_any({"model": "x", "tli_proposals": "words"})
