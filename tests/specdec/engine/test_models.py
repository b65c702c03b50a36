"""specdec/engine/models.py (resolution, dtypes, tokenizer fingerprints) and specdec/engine/kv_cache.py (pointer rollback)."""

from __future__ import annotations

import inspect

import pytest
import torch

from specdec.errors import ModelNotFoundError, SpecDecError
from specdec.engine.kv_cache import SequenceKVCache
from specdec.engine.models import load_model, parse_dtype

# --------------------------------------------------------------------------------------------------
from specdec.model_files import resolve_model_path, tokenizer_fingerprint
# resolution


def test_load_model_from_local_folder(target_dir, target_model):
    lm = load_model(str(target_dir), dtype="float32")
    assert lm.source == str(target_dir) and lm.name == str(target_dir)
    assert lm.dtype == torch.float32 and lm.device == torch.device("cpu")
    assert lm.vocab_size == 49152
    assert lm.eos_token_ids == frozenset({lm.tokenizer.eos_token_id})
    assert not lm.model.training
    assert all(not p.requires_grad for p in lm.model.parameters())
    for name, w in target_model.state_dict().items():
        assert torch.equal(lm.model.state_dict()[name], w), name


def test_load_model_dtype(target_dir):
    lm = load_model(str(target_dir), dtype="bf16")
    assert lm.dtype == torch.bfloat16
    assert lm.model.get_output_embeddings().weight.dtype == torch.bfloat16


def test_unknown_name_lists_what_was_tried(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError) as exc:
        load_model(str(missing))
    msg = str(exc.value)
    assert isinstance(exc.value, SpecDecError) and isinstance(exc.value, FileNotFoundError)
    assert str(missing) in msg
    assert "built-in names" in msg and "smollm2-135m" in msg and "gemma-3-270m" in msg
    assert "GGUF file" in msg and "local folder" in msg


def test_unknown_hub_id_says_cache_was_tried(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_path("nobody-org/definitely-not-a-model-xyz")
    msg = str(exc.value)
    assert "Hugging Face cache" in msg and "nobody-org/definitely-not-a-model-xyz" in msg
    assert "built-in names" in msg


def test_folder_without_config_or_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "README.md").write_text("not a model")
    with pytest.raises(ModelNotFoundError) as exc:
        load_model(str(tmp_path))
    assert "no config.json" in str(exc.value) and "0 .gguf" in str(exc.value)


# --------------------------------------------------------------------------------------------------
# dtypes


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, torch.float32),
        ("auto", torch.float32),
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bf16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
        ("FP16", torch.float16),
        ("float16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float64, torch.float64),
    ],
)
def test_parse_dtype(value, expected):
    assert parse_dtype(value) is expected


@pytest.mark.parametrize("bad", ["int8", "float", "", "q4"])
def test_parse_dtype_rejects_unknown(bad):
    with pytest.raises(ValueError) as exc:
        parse_dtype(bad)
    assert "bfloat16" in str(exc.value) and "auto" in str(exc.value)


# --------------------------------------------------------------------------------------------------
# tokenizer fingerprints


def test_tokenizer_fingerprint(tokenizer, tokenizer_dir, target_dir, other_tokenizer):
    from transformers import AutoTokenizer

    a = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tokenizer_dir))
    b = tokenizer_fingerprint(AutoTokenizer.from_pretrained(target_dir))
    assert a == b == tokenizer_fingerprint(tokenizer)
    assert len(a) == 32
    assert tokenizer_fingerprint(other_tokenizer) != a


def test_tokenizer_fingerprint_sees_added_tokens(tokenizer_dir):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(tokenizer_dir)
    extended = AutoTokenizer.from_pretrained(tokenizer_dir)
    extended.add_special_tokens({"additional_special_tokens": ["<|my_tool|>"]})
    assert tokenizer_fingerprint(plain) != tokenizer_fingerprint(extended)


def test_loaded_models_sharing_a_tokenizer_share_fingerprint(target_dir, good_draft_dir, other_vocab_dir):
    t = load_model(str(target_dir))
    d = load_model(str(good_draft_dir))
    o = load_model(str(other_vocab_dir))
    assert t.tokenizer_fingerprint == d.tokenizer_fingerprint
    assert o.tokenizer_fingerprint != t.tokenizer_fingerprint


# --------------------------------------------------------------------------------------------------
# KV cache: pointer rollback


@pytest.fixture(scope="module")
def lm(target_dir):
    return load_model(str(target_dir), dtype="float32")


def _forward(model, cache, ids, start):
    """Feed ``ids`` at positions start.. through the cache; return logits [len(ids), vocab]."""
    input_ids = torch.tensor([ids])
    pos = torch.arange(start, start + len(ids))[None]
    # transformers 5.x renamed past_key_values to cache
    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        return model(input_ids=input_ids, position_ids=pos, use_cache=True, **{kwarg: cache}).logits[0]


def _fresh(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


def _ids(n, seed):
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_kv_cache_incremental_equals_full_forward(lm):
    model = lm.model
    ids = _ids(40, 0)
    cache = SequenceKVCache(model.config.num_hidden_layers, max_length=256)
    pieces = [ids[:10], ids[10:11], ids[11:20], ids[20:40]]
    logits, start = [], 0
    for piece in pieces:
        logits.append(_forward(model, cache, piece, start))
        start += len(piece)
        assert cache.length == start == cache.get_seq_length()
    torch.testing.assert_close(torch.cat(logits), _fresh(model, ids), rtol=1e-4, atol=1e-4)


def test_kv_cache_truncate_then_reforward_equals_fresh(lm):
    model = lm.model
    ids = _ids(30, 1)
    other = _ids(12, 2)
    cache = SequenceKVCache(model.config.num_hidden_layers, max_length=256)
    _forward(model, cache, ids, 0)
    cache.truncate(17)  # roll back: the last 13 entries are stale and must be ignored / overwritten
    assert cache.length == 17
    new_logits = _forward(model, cache, other, 17)
    assert cache.length == 29
    torch.testing.assert_close(new_logits, _fresh(model, ids[:17] + other)[17:], rtol=1e-4, atol=1e-4)
    # roll back again, to zero, and refill
    cache.truncate(0)
    torch.testing.assert_close(_forward(model, cache, other, 0), _fresh(model, other), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError):
        cache.truncate(cache.length + 1)


def test_kv_cache_grows_past_initial_capacity(lm):
    """More than the 128-entry initial buffer, fed in uneven chunks with rollbacks in between."""
    model = lm.model
    ids = _ids(200, 3)
    cache = SequenceKVCache(model.config.num_hidden_layers, max_length=256)
    pos = 0
    last = None
    for chunk in (100, 50, 50):
        piece = ids[pos : pos + chunk]
        last = _forward(model, cache, piece + _ids(3, pos), pos)  # 3 junk tokens ...
        cache.truncate(pos + chunk)  # ... rolled back
        pos += chunk
    assert cache.length == 200
    assert cache.nbytes() > 0
    tail = _forward(model, cache, [ids[-1]], 200)
    full = _fresh(model, ids + [ids[-1]])
    torch.testing.assert_close(tail[0], full[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last[:50], full[150:200], rtol=1e-4, atol=1e-4)


def test_kv_cache_crop_protocol(lm):
    cache = SequenceKVCache(lm.model.config.num_hidden_layers, max_length=64)
    _forward(lm.model, cache, _ids(10, 4), 0)
    cache.crop(-3)  # transformers' semantics: negative removes from the end
    assert cache.length == 7
    cache.crop(5)  # positive keeps that many
    assert cache.length == 5


@pytest.mark.heavy
def test_concurrent_loads_keep_weight_tying(tmp_path, tokenizer):
    """transformers disables tie_weights on the class while it builds a model; two loads at once
    (draft and target services starting side by side) must not leave it disabled for the process."""
    import threading

    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

    from specdec.model_files import model_construction

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    with model_construction():
        LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    original = PreTrainedModel.__dict__["tie_weights"]
    errors: list[BaseException] = []

    def load_many():
        try:
            for _ in range(15):
                lm = load_model(str(tmp_path))
                assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=load_many) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert PreTrainedModel.__dict__["tie_weights"] is original
    fresh = LlamaForCausalLM(cfg)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight


def test_construction_guard_repairs_tying_broken_outside_it():
    """A load outside specdec's lock that leaves tie_weights disabled is repaired by the next guarded one."""
    from transformers import PreTrainedModel

    from specdec.model_files import model_construction

    with model_construction():  # first guarded use records transformers' own method
        pass
    original = PreTrainedModel.__dict__["tie_weights"]
    PreTrainedModel.tie_weights = lambda *a, **k: None  # what an interleaved no_tie_weights() leaves
    try:
        with model_construction():
            pass
        assert PreTrainedModel.__dict__["tie_weights"] is original
    finally:
        PreTrainedModel.tie_weights = original


def test_folders_with_the_same_tokenizer_files_share_one_tokenizer(target_dir, tmp_path):
    """~100 MiB each: specdec serve's gateway, target and draft (same vocabulary) hold one between them."""
    import json
    import shutil

    from specdec.engine.models import load_model

    from specdec.model_files import load_tokenizer

    copy = tmp_path / "copy"
    shutil.copytree(target_dir, copy)
    assert load_tokenizer(str(copy)) is load_tokenizer(str(target_dir)) is load_model(str(copy)).tokenizer
    other = tmp_path / "other"
    shutil.copytree(target_dir, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 77  # any change to a tokenizer file: a tokenizer of its own
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(str(other)) is not load_tokenizer(str(target_dir))
