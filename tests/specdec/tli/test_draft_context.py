"""Incremental re-tokenization of the committed text for the draft (DraftContext)."""

from __future__ import annotations

import logging
import random
import time

import pytest

from specdec.tli import DraftContext, analyze_tokenizer, encode_exact, special_token_ids, token_bytes

TRICKY = (
    "Hello,   world!\t\tTabs\n\n\n  and    spaces   \n"
    "Emoji: 👩‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 thumbs, 🇫🇷 flag, 🙂🙂🙂\n"
    "中文文本：你好，世界。日本語のテキスト、한국어 텍스트.\n"
    "def f(x):\n    if x  >= 10:\n\treturn {'a': [1, 2,  3]}  # comment\r\n"
    "    for i in range(10):\n        print(f\"{i:>4}\")\n\n\n\n"
    "Accents: café, naïve, résumé, Ångström, e\u0301 (combining), ﬁ ligature, Ω\n"
    "    trailing spaces    \n\n \u00a0nbsp\u3000ideographic space  \t \n"
)
LITERAL_SPECIALS = "chat: <|im_start|>user\n<start_of_turn>model <bos> ▁ literal marker <|endoftext|>\n"

DRAFTS = ["smollm2_tok", "gemma_tok"]


def _bytes_of(tok, ids) -> bytes:
    table = analyze_tokenizer(tok).bytes  # token_bytes() returns a fresh copy: too slow per update
    return b"".join(table[i] for i in ids)


def feed_in_chunks(tok, text: str, seed: int, max_chunk: int = 7, prefix_ids=()):
    """Feed ``text`` in random chunks, checking the invariants after every update."""
    rng = random.Random(seed)
    ctx = DraftContext(tok, prefix_ids=prefix_ids)
    pos, refed, updates = 0, 0, 0
    while pos < len(text):
        k = rng.randint(1, max_chunk)
        chunk, pos = text[pos : pos + k], pos + k
        before = ctx.ids
        stable = ctx.extend(chunk)
        after = ctx.ids
        committed = text[:pos]
        # the draft ids stand for exactly the committed text ...
        assert _bytes_of(tok, after[len(prefix_ids) :]) == committed.encode("utf-8")
        assert ctx.text == committed
        # ... which the tokenizer's decoder gives back, whitespace and all
        text_ids = after[len(prefix_ids) :]
        assert tok.decode(text_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == committed
        # the stable prefix really did not change
        assert len(prefix_ids) <= stable <= min(len(before), len(after))
        assert after[:stable] == before[:stable]
        assert after[: len(prefix_ids)] == list(prefix_ids)
        refed += len(after) - stable
        updates += 1
    return ctx, refed, updates


@pytest.mark.slow
@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("seed", range(6))
def test_random_chunks_round_trip(request, draft, seed):
    tok = request.getfixturevalue(draft)
    t0 = time.perf_counter()
    ctx, refed, updates = feed_in_chunks(tok, TRICKY, seed, max_chunk=1 + seed * 2)
    elapsed = time.perf_counter() - t0
    full = tok.backend_tokenizer.encode(TRICKY, add_special_tokens=False).ids
    # re-tokenizing the tail gives the same ids as tokenizing everything at once (on this text)
    assert ctx.ids == full
    assert ctx.fallbacks == 0
    # the KV cache survives: per update only the window and the new text are fed again
    assert refed / updates <= ctx.window_tokens + 4
    logging.getLogger(__name__).info(
        "%s seed %d: %d updates, %.0f us/update, %.1f ids re-fed/update", draft, seed, updates,
        elapsed / updates * 1e6, refed / updates,
    )


@pytest.mark.slow
@pytest.mark.parametrize("draft", DRAFTS)
def test_literal_special_strings_stay_text(request, draft):
    tok = request.getfixturevalue(draft)
    text = TRICKY + LITERAL_SPECIALS + TRICKY
    for seed in range(3):
        ctx, _, _ = feed_in_chunks(tok, text, seed, prefix_ids=[tok.bos_token_id or 0])
        specials = special_token_ids(tok)
        assert not specials & set(ctx.text_ids)
        assert ctx.ids[0] == (tok.bos_token_id or 0)


@pytest.mark.slow
@pytest.mark.parametrize("draft", DRAFTS + ["mistral_tok"])
def test_bytes_split_inside_characters(request, draft):
    """Bytes arriving mid-character (a target token ending inside a UTF-8 sequence) are held as byte
    tokens and re-tokenized properly once the character is complete."""
    tok = request.getfixturevalue(draft)
    data = TRICKY.encode("utf-8")
    rng = random.Random(1)
    ctx = DraftContext(tok)
    pos = 0
    while pos < len(data):
        k = rng.randint(1, 5)
        before = ctx.ids
        stable = ctx.extend_bytes(data[pos : pos + k])
        pos += k
        assert _bytes_of(tok, ctx.ids) == data[:pos]
        assert ctx.ids[:stable] == before[:stable]
    assert ctx.committed_bytes == data
    if draft != "mistral_tok":  # Mistral's encode adds a dummy-prefix space, so its canonical ids differ at the start
        assert ctx.ids == tok.backend_tokenizer.encode(TRICKY, add_special_tokens=False).ids
    assert tok.decode(ctx.ids, clean_up_tokenization_spaces=False).lstrip(" ") == TRICKY.lstrip(" ")


@pytest.mark.slow
@pytest.mark.parametrize("draft, target", [("gemma_tok", "smollm2_tok"), ("smollm2_tok", "gemma_tok")])
def test_follow_target_token_ids(request, draft, target):
    """The target commits its own token ids one at a time; the draft context follows them exactly."""
    d_tok, t_tok = request.getfixturevalue(draft), request.getfixturevalue(target)
    t_ids = t_tok.backend_tokenizer.encode(TRICKY, add_special_tokens=False).ids
    ctx = DraftContext(d_tok, target_tokenizer=t_tok)
    t_table = token_bytes(t_tok)
    committed = b""
    for tid in t_ids + [t_tok.eos_token_id]:  # eos (special) adds no text
        before = ctx.ids
        stable = ctx.extend_target_ids([tid])
        committed += t_table[tid] or b""
        assert ctx.committed_bytes == committed
        assert _bytes_of(d_tok, ctx.ids) == committed
        assert ctx.ids[:stable] == before[:stable]
    assert ctx.text == TRICKY
    assert ctx.ids == d_tok.backend_tokenizer.encode(TRICKY, add_special_tokens=False).ids
    with pytest.raises(ValueError):
        ctx.extend_target_ids([t_tok.eos_token_id], skip_special=False)


@pytest.mark.slow
@pytest.mark.parametrize("draft", DRAFTS)
def test_set_text_and_reset(request, draft):
    tok = request.getfixturevalue(draft)
    ctx = DraftContext(tok, text=TRICKY)
    n = len(ctx)
    assert ctx.extend("") == n
    # rewriting the end (e.g. after a rollback) keeps ids before the change
    cut = len(TRICKY) - 40
    before = ctx.ids
    stable = ctx.set_text(TRICKY[:cut] + "something else entirely")
    assert ctx.ids[:stable] == before[:stable]
    assert stable >= len(encode_exact(tok, TRICKY[: cut - 40]))
    assert tok.decode(ctx.ids, clean_up_tokenization_spaces=False) == TRICKY[:cut] + "something else entirely"
    assert ctx.reset() == 0 and ctx.ids == [] and ctx.text == ""
    assert ctx.reset("abc") == 0 and tok.decode(ctx.ids) == "abc"


@pytest.mark.slow
def test_encode_exact_dummy_prefix(mistral_tok):
    """Mistral's encode puts a space in front of the text; encode_exact does not."""
    for text in ["Hello world", " leading space", "  two", "\nnewline", "oji", "中文", "🙂 x"]:
        ids = encode_exact(mistral_tok, text)
        assert _bytes_of(mistral_tok, ids) == text.encode("utf-8"), text
    ctx, _, _ = feed_in_chunks_bytes_only(mistral_tok, TRICKY)
    assert _bytes_of(mistral_tok, ctx.ids) == TRICKY.encode("utf-8")


def feed_in_chunks_bytes_only(tok, text, seed=0):
    rng = random.Random(seed)
    ctx = DraftContext(tok)
    pos = 0
    while pos < len(text):
        k = rng.randint(1, 6)
        before = ctx.ids
        stable = ctx.extend(text[pos : pos + k])
        pos += k
        assert _bytes_of(tok, ctx.ids) == text[:pos].encode("utf-8")
        assert ctx.ids[:stable] == before[:stable]
    return ctx, None, None


def test_toy_tokenizer_round_trip(toy_tok):
    """Fast (no pip package): random chunks, bytes split mid-character, literal special strings."""
    assert analyze_tokenizer(toy_tok).convention == "byte_level"
    text = TRICKY + "<|endoftext|> the end"
    for seed in range(3):
        ctx, refed, updates = feed_in_chunks(toy_tok, text, seed)
        assert toy_tok.eos_token_id not in ctx.ids
        assert refed / updates <= ctx.window_tokens + 4
    with pytest.raises(ValueError):
        DraftContext(toy_tok, window_tokens=0)
    # ids_from(stable): what to feed after rolling the KV cache back
    ctx = DraftContext(toy_tok, prefix_ids=[toy_tok.eos_token_id], text="the cat")
    stable = ctx.extend("hedral in the hat")
    assert ctx.ids_from(stable) == ctx.ids[stable:]
    assert ctx.ids_from(0) == ctx.ids
    assert ctx.last_stable == stable
