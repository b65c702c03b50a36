"""The default corpus: text that ships with the Python interpreter."""

from __future__ import annotations

from specdec.distill.corpus import default_corpus


def test_default_corpus_mixes_prose_and_code():
    docs, desc = default_corpus()
    kinds = {d.kind for d in docs}
    assert kinds == {"prose", "code"}
    assert any(d.name.startswith("pydoc_data/topics.py") for d in docs)
    assert "standard library" in desc
