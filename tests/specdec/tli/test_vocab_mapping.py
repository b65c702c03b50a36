"""Token-Level Intersection vocabulary mapping on real tokenizers (see conftest.py for where they come from)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from specdec.errors import ConfigError
from specdec.model_files import tokenizer_fingerprint
from specdec.tli import (
    VocabMapping,
    analyze_tokenizer,
    check_useful,
    load_or_build_mapping,
    mapping_cache_path,
    special_token_ids,
    token_bytes,
)

# (draft fixture, target fixture, overlap with only the space marker normalised, overlap by bytes).
# Byte-level x byte-level pairs: both alphabets are GPT-2's, so the two figures coincide.
KNOWN = [
    pytest.param("gpt2_tok", "llama3_tok", 43_209, 43_209, id="gpt2-x-llama3"),
    pytest.param("qwen_tok", "llama3_tok", 109_566, 109_566, id="qwen2-x-llama3"),
    pytest.param("mistral_tok", "llama3_tok", 24_822, 29_110, id="mistral_v1-x-llama3"),
    pytest.param("gemma_tok", "smollm2_tok", 45_568, 46_138, id="gemma3-x-smollm2"),
]
# Gemma x SmolLM2 comes out at 46,145 = 46,138 + 7: Gemma's *added, non-special* whitespace tokens
# "\n\n", "\n\n\n", "\n\n\n\n", "\t\t", "\t\t\t", "\t\t\t\t" and "\t"*8 are real text tokens (Gemma emits
# "\n\n" all the time) and SmolLM2 has the same byte strings; the reference figure left added tokens out
# (its "\n" and "\t" still matched through the byte pieces <0x0A>/<0x09>, hence 9 - 2 = 7).
TOLERANCE = 16

ALL_TOKENIZERS = ["smollm2_tok", "gemma_tok", "gpt2_tok", "llama3_tok", "qwen_tok", "mistral_tok"]
SIZES = {
    "smollm2_tok": 49_152,
    "gemma_tok": 262_144,
    "gpt2_tok": 50_257,
    "llama3_tok": 128_256,
    "qwen_tok": 151_851,
    "mistral_tok": 32_000,
}


def marker_only_overlap(a, b) -> int:
    """Token strings equal once ``▁``/``Ġ`` are read as a space (no other normalisation), specials excluded."""

    def strings(tok):
        specials = special_token_ids(tok)
        vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
        return {s.replace("\u2581", " ").replace("\u0120", " ") for s, i in vocab.items() if i not in specials}

    return len(strings(a) & strings(b))


_COMPLETIONS = [
    (p, s)
    for p in (b"", b"\xc2", b"\xe1", b"\xe1\x80", b"\xf1", b"\xf1\x80", b"\xf1\x80\x80")
    for s in (b"", b"\x80", b"\x80\x80", b"\x80\x80\x80")
]


def _complete(b: bytes) -> tuple[bytes, bytes] | None:
    """Bytes to put around a partial UTF-8 token so the whole decodes strictly (None: impossible)."""
    for p, s in _COMPLETIONS:
        try:
            (p + b + s).decode("utf-8")
            return p, s
        except UnicodeDecodeError:
            pass
    return None


def decoder_disagreements(tok, ids: list[int]) -> tuple[list[int], int]:
    """Check token_bytes against the tokenizer's own decoder for every id in ``ids``.

    Each token is decoded behind an anchor token ``a`` (SentencePiece decoders strip the first leading
    space) and, when its bytes are partial UTF-8, between single-byte tokens that complete the character.
    Returns (ids whose decoded text differs, number of ids that cannot be completed to valid UTF-8).
    """
    table = analyze_tokenizer(tok).bytes
    rev = analyze_tokenizer(tok).canonical()
    anchor = rev[b"a"]
    seqs, want, checked, impossible = [], [], [], 0
    for i in ids:
        b = table[i]
        assert b is not None
        comp = _complete(b)
        if comp is None or any(bytes([x]) not in rev for x in comp[0] + comp[1]):
            impossible += 1
            continue
        p, s = comp
        seqs.append([anchor] + [rev[bytes([x])] for x in p] + [i] + [rev[bytes([x])] for x in s])
        want.append("a" + (p + b + s).decode("utf-8"))
        checked.append(i)
    got = tok.backend_tokenizer.decode_batch(seqs, skip_special_tokens=False)
    return [i for i, g, w in zip(checked, got, want) if g != w], impossible


# --------------------------------------------------------------------------------------------------
# token_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_token_bytes_table(request, name):
    tok = request.getfixturevalue(name)
    t0 = time.perf_counter()
    table = analyze_tokenizer(tok)
    elapsed = time.perf_counter() - t0
    expected_convention = "sentencepiece" if name in ("gemma_tok", "mistral_tok") else "byte_level"
    assert table.convention == expected_convention
    assert table.byte_fallback == (expected_convention == "sentencepiece")
    assert table.adds_prefix_space == (name == "mistral_tok")
    tb = token_bytes(tok)
    assert len(tb) == SIZES[name] == len(tok)
    # the 256 single bytes are all representable by the byte-level and byte-fallback vocabularies
    singles = {b for b in tb if b is not None and len(b) == 1}
    assert len(singles) >= 200
    # special tokens are never given bytes
    for i in special_token_ids(tok) | set(tok.all_special_ids):
        assert tb[i] is None, (i, tok.convert_ids_to_tokens(i))
    # every token with bytes decodes to them through the tokenizer's own decoder
    ids = [i for i, b in enumerate(tb) if b is not None]
    bad, impossible = decoder_disagreements(tok, ids)
    assert bad == [], [(i, tok.convert_ids_to_tokens(i), tb[i]) for i in bad[:10]]
    assert impossible <= 64  # bytes like 0xFF / 0xC0 never occur in valid UTF-8
    logging.getLogger(__name__).info("%s: token table in %.2fs", name, elapsed)


# One test per tokenizer family, so the shipped pair's checks never skip for an unrelated package.
@pytest.mark.slow
def test_token_bytes_examples_shipped_pair(smollm2_tok, gemma_tok):
    s = token_bytes(smollm2_tok)
    v = smollm2_tok.get_vocab()
    assert s[v["Ġthe"]] == b" the"
    assert s[v["Ċ"]] == b"\n"
    assert s[v["ĠĠ"]] == b"  "
    assert s[v["<|im_start|>"]] is None and s[v["<|endoftext|>"]] is None

    g = token_bytes(gemma_tok)
    gv = gemma_tok.get_vocab()
    assert g[gv["▁the"]] == b" the"
    assert g[gv["<0x0A>"]] == b"\n" and g[gv["<0xE2>"]] == b"\xe2"
    assert g[gv["\n\n"]] == b"\n\n"  # added, non-special: real text
    assert g[gv["<table>"]] == b"<table>" and g[gv["<s>"]] == b"<s>"  # HTML added tokens are text
    for marker in ("<bos>", "<eos>", "<pad>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                   "[multimodal]", "<unused0>"):
        assert g[gv[marker]] is None, marker


@pytest.mark.slow
def test_token_bytes_examples_mistral(mistral_tok):
    m = token_bytes(mistral_tok)
    mv = mistral_tok.get_vocab()
    assert m[mv["▁▁▁▁"]] == b"    "
    assert m[mv["<0x61>"]] == b"a" == m[mv["a"]]
    assert m[mv["<s>"]] is None and m[mv["</s>"]] is None and m[mv["<unk>"]] is None


# --------------------------------------------------------------------------------------------------
# The mapping


@pytest.mark.slow
@pytest.mark.parametrize("draft_name, target_name, marker_figure, bytes_figure", KNOWN)
def test_intersection_sizes_and_pairs(request, draft_name, target_name, marker_figure, bytes_figure):
    draft = request.getfixturevalue(draft_name)
    target = request.getfixturevalue(target_name)
    t0 = time.perf_counter()
    m = VocabMapping.build(draft, target)
    build_s = time.perf_counter() - t0
    logging.getLogger(__name__).info("%s x %s: %s (built in %.2fs)", draft_name, target_name, m.summary(), build_s)

    assert m.draft_vocab_size == SIZES[draft_name] and m.target_vocab_size == SIZES[target_name]
    assert m.draft_fingerprint == tokenizer_fingerprint(draft)
    assert m.target_fingerprint == tokenizer_fingerprint(target)
    assert abs(m.intersection_size - bytes_figure) <= TOLERANCE, m.intersection_size
    assert m.intersection_size >= marker_figure
    assert m.intersection_size >= marker_only_overlap(draft, target)
    assert m.draft_share == pytest.approx(m.intersection_size / SIZES[draft_name])
    assert m.target_share == pytest.approx(m.intersection_size / SIZES[target_name])

    # one-to-one between canonical tokens
    d2t, t2d = m.draft_to_target, m.target_to_draft
    assert d2t.dtype == torch.long and t2d.dtype == torch.long
    d_ids = torch.nonzero(d2t >= 0).squeeze(1)
    t_ids = d2t[d_ids]
    assert int((d2t >= 0).sum()) == int((t2d >= 0).sum()) == m.intersection_size
    assert torch.equal(t2d[t_ids], d_ids)
    assert t_ids.unique().numel() == t_ids.numel()

    # every mapped pair stands for the same bytes: by the byte tables ...
    db, tb = token_bytes(draft), token_bytes(target)
    pairs = list(zip(d_ids.tolist(), t_ids.tolist()))
    assert all(db[d] == tb[t] is not None for d, t in pairs)
    # ... and by each tokenizer's own decoder, over ALL mapped pairs
    bad_d, imp_d = decoder_disagreements(draft, [d for d, _ in pairs])
    bad_t, imp_t = decoder_disagreements(target, [t for _, t in pairs])
    assert bad_d == [] and bad_t == []
    assert imp_d == imp_t <= 64

    # special tokens are never mapped
    for i in special_token_ids(draft) | set(draft.all_special_ids):
        assert d2t[i] == -1
    for i in special_token_ids(target) | set(target.all_special_ids):
        assert t2d[i] == -1

    # deterministic
    assert VocabMapping.build(draft, target) == m


@pytest.mark.slow
def test_canonical_duplicates(mistral_tok, llama3_tok):
    """Tokens with equal bytes: the ordinary piece wins over the added token over the byte piece."""
    m = VocabMapping.build(mistral_tok, llama3_tok)
    mv, lv = mistral_tok.get_vocab(), llama3_tok.get_vocab()
    assert m.draft_to_target[mv["a"]] == lv["a"]
    assert m.draft_to_target[mv["<0x61>"]] == -1  # same bytes as "a": not canonical
    assert m.draft_to_target[mv["<0x0A>"]] == lv["Ċ"]  # "\n" exists only as a byte piece in Mistral
    assert m.target_to_draft[lv["Ċ"]] == mv["<0x0A>"]


@pytest.mark.slow
def test_canonical_duplicates_shipped_pair(gemma_tok, smollm2_tok):
    """Gemma's added "\\n" token beats its byte piece <0x0A>."""
    g = VocabMapping.build(gemma_tok, smollm2_tok)
    gv, sv = gemma_tok.get_vocab(), smollm2_tok.get_vocab()
    assert g.draft_to_target[gv["\n"]] == sv["Ċ"]  # Gemma's added "\n" beats <0x0A>
    assert g.draft_to_target[gv["<0x0A>"]] == -1
    assert g.draft_to_target[gv["\n\n"]] == sv["ĊĊ"]


@pytest.mark.slow
def test_logit_helpers_on_real_pair(gemma_tok, smollm2_tok):
    m = VocabMapping.build(smollm2_tok, gemma_tok)
    torch.manual_seed(0)
    # SmolLM2's lm_head is exactly its vocabulary; pretend it is padded to 49,216 to test the overhang
    logits = torch.randn(2, 3, 49_216)
    r = m.restrict_draft_logits(logits)
    assert r.shape == logits.shape
    assert torch.isinf(r[..., 49_152:]).all()
    mask = m.draft_mask
    assert torch.equal(r[..., :49_152][..., mask], logits[..., :49_152][..., mask])
    assert torch.isinf(r[..., :49_152][..., ~mask]).all()

    q = torch.softmax(m.draft_logits_to_target(logits, target_vocab_size=262_208), dim=-1)
    assert q.shape == (2, 3, 262_208)
    p_draft = torch.softmax(r, dim=-1)
    d_ids = torch.nonzero(m.draft_to_target >= 0).squeeze(1)
    assert torch.allclose(q[..., m.draft_to_target[d_ids]], p_draft[..., d_ids], atol=1e-6)
    assert torch.allclose(q.sum(-1), torch.ones(2, 3))

    best = m.draft_logits_to_target_ids(logits)
    assert torch.equal(best, m.draft_to_target[r.argmax(-1)])
    ids = smollm2_tok.encode(" the cat", add_special_tokens=False)
    tgt = m.draft_ids_to_target(ids)
    assert gemma_tok.decode(tgt.tolist()) == " the cat"
    assert torch.equal(m.target_ids_to_draft(tgt), torch.tensor(ids))
    with pytest.raises(ValueError, match="not in the TLI vocabulary intersection"):
        m.draft_ids_to_target([smollm2_tok.convert_tokens_to_ids("<|im_start|>")])
    assert m.draft_ids_to_target([0, 10**7], strict=False).tolist() == [-1, -1]


def test_logit_helpers_synthetic():
    d2t = torch.tensor([-1, 2, 0, -1])
    t2d = torch.tensor([2, -1, 1])
    m = VocabMapping(d2t, t2d, 2, 4, 3, "d" * 32, "t" * 32)
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert m.restrict_draft_logits(logits).tolist() == [[float("-inf"), 2.0, 3.0, float("-inf")]]
    assert m.draft_logits_to_target(logits).tolist() == [[3.0, float("-inf"), 2.0]]
    assert m.draft_logits_to_target(logits, target_vocab_size=5).shape == (1, 5)
    with pytest.raises(ValueError):
        m.draft_logits_to_target(logits, target_vocab_size=2)
    assert m.draft_logits_to_target_ids(logits).tolist() == [0]
    assert m.draft_ids_to_target(torch.tensor([[1, 2]])).tolist() == [[2, 0]]
    assert m.target_ids_to_draft([0, 2]).tolist() == [2, 1]
    assert m.draft_share == 0.5 and m.target_share == pytest.approx(2 / 3)
    assert "2 tokens" in m.summary()


# --------------------------------------------------------------------------------------------------
# Disk cache


@pytest.mark.slow
def test_cache_round_trip(gemma_tok, smollm2_tok, tmp_path, caplog):
    cache = tmp_path / "tli"
    # forget the per-tokenizer memo so the first call really builds
    for tok in (gemma_tok, smollm2_tok):
        tok.__dict__.pop("_specdec_tli_table", None)
    path = mapping_cache_path(gemma_tok, smollm2_tok, cache)
    assert not path.exists()
    with caplog.at_level(logging.INFO, logger="specdec.tli.vocab_mapping"):
        t0 = time.perf_counter()
        first = load_or_build_mapping(gemma_tok, smollm2_tok, cache_dir=cache)
        build_s = time.perf_counter() - t0
        assert path.exists()
        t0 = time.perf_counter()
        second = load_or_build_mapping(gemma_tok, smollm2_tok, cache_dir=cache)
        load_s = time.perf_counter() - t0
    assert second == first
    assert second is not first
    msgs = [r.getMessage() for r in caplog.records]
    assert any("46,1" in s and "17.6% of the draft" in s and "93.9% of the target" in s and "built" in s for s in msgs)
    assert any("loaded from" in s for s in msgs)
    logging.getLogger(__name__).info("cache: build %.2fs, load %.3fs", build_s, load_s)

    # the reverse direction is a different file
    assert mapping_cache_path(smollm2_tok, gemma_tok, cache) != path

    # a corrupt file is rebuilt, not trusted
    path.write_bytes(b"not a torch file")
    with caplog.at_level(logging.WARNING, logger="specdec.tli.vocab_mapping"):
        third = load_or_build_mapping(gemma_tok, smollm2_tok, cache_dir=cache)
    assert third == first
    assert any("ignoring TLI mapping cache" in r.getMessage() for r in caplog.records)
    assert VocabMapping.load(path) == first


@pytest.mark.slow
def test_cache_default_location(tmp_cache, gpt2_tok, llama3_tok):
    m = load_or_build_mapping(gpt2_tok, llama3_tok)
    files = list((tmp_cache / "tli").glob("*.pt"))
    assert len(files) == 1
    assert tokenizer_fingerprint(gpt2_tok)[:16] in files[0].name
    assert tokenizer_fingerprint(llama3_tok)[:16] in files[0].name
    assert VocabMapping.load(files[0]) == m


def test_save_load_synthetic(tmp_path):
    m = VocabMapping(torch.tensor([-1, 1]), torch.tensor([-1, 1, -1]), 1, 2, 3, "a" * 32, "b" * 32)
    m.save(tmp_path / "m.pt")
    assert VocabMapping.load(tmp_path / "m.pt") == m
    assert not list(tmp_path.glob(".tmp-*"))


# --------------------------------------------------------------------------------------------------
# check_useful


def test_check_useful_refuses_tiny_intersection():
    m = VocabMapping(torch.full((50_000,), -1), torch.full((120_000,), -1), 0, 50_000, 120_000, "d" * 32, "t" * 32)
    m.draft_to_target[:300] = torch.arange(300)
    m.target_to_draft[:300] = torch.arange(300)
    m.intersection_size = 300
    with pytest.raises(ConfigError) as exc:
        check_useful(m)
    msg = str(exc.value)
    assert "300 tokens in common" in msg and "50,000-token draft" in msg and "120,000-token target" in msg
    assert "0.60% of the draft vocabulary" in msg and "0.25% of the target vocabulary" in msg
    assert "min_share" in msg


@pytest.mark.slow
def test_check_useful_on_real_tokenizers(smollm2_tok, gemma_tok):
    """A toy byte-level BPE (256 bytes + 5 merges) shares little more than the bytes with SmolLM2: refused."""
    from tests.specdec.tli.conftest import build_toy_byte_level_tokenizer

    toy = build_toy_byte_level_tokenizer([("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")])
    vocab = toy.get_vocab()
    assert analyze_tokenizer(toy).convention == "byte_level"
    m = VocabMapping.build(toy, smollm2_tok)
    assert 200 <= m.intersection_size <= len(vocab)  # SmolLM2 lacks single bytes that never occur in UTF-8
    with pytest.raises(ConfigError, match="too few tokens for Token-Level Intersection"):
        check_useful(m)
    # Gemma -> SmolLM2 is fine (17.6% of Gemma's vocabulary, 93.9% of SmolLM2's)
    assert check_useful(VocabMapping.build(gemma_tok, smollm2_tok)) is not None


def test_token_bytes_toy_tokenizers(toy_tok):
    """Fast checks on in-memory tokenizers: byte-level, and a WordPiece one (no marker convention: the
    decoder defines the bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tb = token_bytes(toy_tok)
    v = toy_tok.get_vocab()
    assert tb[v["Ġthe"]] == b" the" and tb[v["ĊĊ"]] == b"\n\n" and tb[v["<|endoftext|>"]] is None
    assert analyze_tokenizer(toy_tok).convention == "byte_level"

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "a": 3, "b": 4, "hello": 5, "##lo": 6, "world": 7, "he": 8}
    wp = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    wp.decoder = decoders.WordPiece()
    bert = PreTrainedTokenizerFast(tokenizer_object=wp, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")
    table = analyze_tokenizer(bert)
    assert table.convention == "decode"
    assert table.bytes[5] == b" hello" and table.bytes[6] == b"lo"
    assert table.bytes[0] is table.bytes[1] is table.bytes[2] is None
    m = VocabMapping.build(bert, toy_tok)
    assert m.draft_to_target[3] == v["Ġa"]  # " a" (word start) exists in the toy byte-level vocabulary
    assert m.draft_to_target[6] == -1  # "lo" is not a toy token
