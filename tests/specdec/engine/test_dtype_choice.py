"""specdec/engine/dtype_choice.py: ``--dtype auto`` on CPU measures float32 against bfloat16, caches the choice,
and load_model loads what it chose; an explicit dtype is never overridden.

tests/conftest.py pins ``SPECDEC_DTYPE_AUTO=float32`` for the suite; these tests unset it to measure.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from specdec.engine import dtype_choice
from specdec.engine.dtype_choice import CACHE_FILE, DtypeChoice, cpu_auto_choice, cpu_auto_dtype
from specdec.engine.models import load_model, parse_dtype


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """No pin, a fresh cache, bf16 products available, and timings faked: set ``fake["ms"]``; ``fake["calls"]``
    lists the (hidden, intermediate) of every measurement."""
    monkeypatch.delenv(dtype_choice.PIN_ENV, raising=False)
    monkeypatch.delenv(dtype_choice.CACHE_ENV, raising=False)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(dtype_choice, "bf16_supported", lambda: True)
    fake = {"ms": {"float32": 10.0, "bfloat16": 8.0}, "calls": []}

    def time_products(hidden, intermediate):
        fake["calls"].append((hidden, intermediate))
        return dict(fake["ms"])

    monkeypatch.setattr(dtype_choice, "time_products", time_products)
    return fake


def _no_timing(*args, **kwargs):
    raise AssertionError("timed although the answer was known")


@pytest.mark.parametrize("bf16_ms, expected", [
    (8.0, torch.bfloat16),  # 20% faster: bf16
    (9.0, torch.bfloat16),  # exactly the 10% margin
    (9.5, torch.float32),  # 5% faster: not worth bf16's rounding
    (12.0, torch.float32),  # slower
])
def test_the_choice_follows_the_timings(measuring, bf16_ms, expected):
    measuring["ms"] = {"float32": 10.0, "bfloat16": bf16_ms}
    choice = cpu_auto_choice(576, 1536)
    assert choice.dtype is expected and choice.how == "measured"
    assert choice.ms == {"float32": 10.0, "bfloat16": bf16_ms} and measuring["calls"] == [(576, 1536)]
    text = choice.describe()
    assert text.startswith(f"{str(expected).removeprefix('torch.')} (measured: float32 10.00 ms, bfloat16")
    assert choice.cpu in text and CACHE_FILE in text


def test_no_bf16_means_float32_without_timing(measuring, monkeypatch, tmp_path):
    monkeypatch.setattr(dtype_choice, "bf16_supported", lambda: False)
    monkeypatch.setattr(dtype_choice, "time_products", _no_timing)
    choice = cpu_auto_choice(576, 1536)
    assert choice.dtype is torch.float32 and choice.how == "unsupported"
    assert not (tmp_path / CACHE_FILE).exists()


def test_the_cache_is_written_then_read(measuring, monkeypatch, tmp_path):
    assert cpu_auto_dtype(576, 1536, threads=2) is torch.bfloat16
    entries = json.loads((tmp_path / CACHE_FILE).read_text())
    (key, entry), = entries.items()
    cpu, flags = dtype_choice.cpu_info()
    assert cpu in key and torch.__version__ in key and "2 threads" in key and "576" in key and "1536" in key
    assert all(f in key for f in flags)
    assert entry["dtype"] == "bfloat16" and entry["ms"] == {"float32": 10.0, "bfloat16": 8.0}

    monkeypatch.setattr(dtype_choice, "time_products", _no_timing)
    again = cpu_auto_choice(576, 1536, threads=2)
    assert again.dtype is torch.bfloat16 and again.how == "cached" and again.ms == entry["ms"]
    assert "read from" in again.describe()


def test_the_cache_is_keyed_by_shape_and_threads(measuring):
    cpu_auto_choice(576, 1536, threads=2)
    cpu_auto_choice(576, 1536, threads=2)
    cpu_auto_choice(64, 128, threads=2)  # another model size
    cpu_auto_choice(576, 1536, threads=1)  # another thread count
    assert measuring["calls"] == [(576, 1536), (64, 128), (576, 1536)]


def test_measure_again_on_request(measuring, monkeypatch, tmp_path):
    assert cpu_auto_dtype(576, 1536) is torch.bfloat16
    monkeypatch.setenv(dtype_choice.CACHE_ENV, "0")
    measuring["ms"] = {"float32": 10.0, "bfloat16": 11.0}  # e.g. a new machine under the same cache
    assert cpu_auto_dtype(576, 1536) is torch.float32 and len(measuring["calls"]) == 2
    monkeypatch.delenv(dtype_choice.CACHE_ENV)
    assert cpu_auto_choice(576, 1536).how == "cached" and cpu_auto_dtype(576, 1536) is torch.float32
    assert len(measuring["calls"]) == 2


@pytest.mark.parametrize("content", ["not json", "[]", '{"x": 1}'])
def test_a_broken_cache_is_measured_again(measuring, tmp_path, content):
    (tmp_path / CACHE_FILE).write_text(content)
    assert cpu_auto_dtype(576, 1536) is torch.bfloat16 and len(measuring["calls"]) == 1
    assert len(json.loads((tmp_path / CACHE_FILE).read_text())) >= 1


def test_a_broken_cache_entry_is_measured_again(measuring, tmp_path):
    cpu_auto_choice(576, 1536)
    entries = json.loads((tmp_path / CACHE_FILE).read_text())
    entries = {key: {"dtype": "int3"} for key in entries}
    (tmp_path / CACHE_FILE).write_text(json.dumps(entries))
    assert cpu_auto_choice(576, 1536).how == "measured" and len(measuring["calls"]) == 2


def test_the_pin_wins_without_timing(measuring, monkeypatch):
    monkeypatch.setattr(dtype_choice, "time_products", _no_timing)
    for value, dtype in (("bfloat16", torch.bfloat16), ("FP32", torch.float32), ("bf16", torch.bfloat16)):
        monkeypatch.setenv(dtype_choice.PIN_ENV, value)
        choice = cpu_auto_choice(576, 1536)
        assert choice.dtype is dtype and choice.how == "pinned" and dtype_choice.PIN_ENV in choice.describe()
        assert parse_dtype("auto", "cpu") is dtype and parse_dtype(None) is dtype
        assert parse_dtype("auto", "cuda") is torch.bfloat16  # CUDA: bfloat16 by rule
        assert parse_dtype("float32") is torch.float32 and parse_dtype("bfloat16") is torch.bfloat16
    monkeypatch.setenv(dtype_choice.PIN_ENV, "int8")
    with pytest.raises(ValueError, match="SPECDEC_DTYPE_AUTO"):
        cpu_auto_choice(576, 1536)


def test_a_real_measurement(monkeypatch, tmp_path):
    """The timing itself, on small shapes: both dtypes timed, positive, and the choice is one of them."""
    monkeypatch.delenv(dtype_choice.PIN_ENV, raising=False)
    monkeypatch.delenv(dtype_choice.CACHE_ENV, raising=False)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    choice = cpu_auto_choice(64, 128)
    assert choice.dtype in (torch.float32, torch.bfloat16)
    if choice.how == "unsupported":
        assert choice.dtype is torch.float32
    else:
        assert choice.how == "measured" and set(choice.ms) == {"float32", "bfloat16"}
        assert all(ms > 0 for ms in choice.ms.values())
        assert cpu_auto_choice(64, 128).how == "cached"


# --------------------------------------------------------------------------------------------------
# load_model


@pytest.fixture
def chooser(monkeypatch, tmp_path):
    """The chooser says bfloat16 (as measured); ``calls`` lists the shapes it was asked about."""
    monkeypatch.delenv(dtype_choice.PIN_ENV, raising=False)
    calls = []

    def choose(hidden, intermediate, threads=None):
        calls.append((hidden, intermediate))
        return DtypeChoice(torch.bfloat16, "measured", {"float32": 3.0, "bfloat16": 1.5}, "test cpu",
                           tmp_path / CACHE_FILE)

    monkeypatch.setattr(dtype_choice, "cpu_auto_choice", choose)
    return calls


def test_load_model_auto_loads_the_measured_dtype(target_dir, chooser, caplog):
    with caplog.at_level(logging.INFO, logger="specdec.engine.models"):
        lm = load_model(str(target_dir), dtype="auto")
    assert chooser == [(64, 128)]  # the tiny target's hidden_size and intermediate_size
    assert lm.dtype is torch.bfloat16 and next(lm.model.parameters()).dtype is torch.bfloat16
    assert "dtype auto: bfloat16 (measured: float32 3.00 ms, bfloat16 1.50 ms" in caplog.text
    assert "test cpu" in caplog.text
    assert load_model(str(target_dir)).dtype is torch.bfloat16  # None means auto


def test_an_explicit_dtype_is_never_overridden(target_dir, chooser):
    assert load_model(str(target_dir), dtype="float32").dtype is torch.float32
    assert load_model(str(target_dir), dtype=torch.float32).dtype is torch.float32
    assert load_model(str(target_dir), dtype="bf16").dtype is torch.bfloat16
    assert chooser == []


def test_load_model_auto_honours_the_pin(target_dir, chooser, monkeypatch, caplog):
    monkeypatch.setenv(dtype_choice.PIN_ENV, "float32")
    with caplog.at_level(logging.INFO, logger="specdec.engine.models"):
        assert load_model(str(target_dir), dtype="auto").dtype is torch.float32
    assert chooser == [] and "pinned by SPECDEC_DTYPE_AUTO" in caplog.text


def test_load_model_auto_without_sizes_is_float32(target_dir, chooser, monkeypatch):
    """A config without hidden_size / intermediate_size gives nothing to measure by: float32."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    real, asked = AutoConfig.from_pretrained, []

    def first_without_sizes(*args, **kwargs):  # the first read is load_model's own, for the sizes
        asked.append(args)
        if len(asked) == 1:
            return SimpleNamespace(get_text_config=lambda: SimpleNamespace(hidden_size=64))
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", first_without_sizes)
    assert load_model(str(target_dir), dtype="auto").dtype is torch.float32 and chooser == [] and asked
