"""Token-Level Intersection on the real heterogeneous pair: Gemma-3-270M (target, SentencePiece 262,144)
drafted by SmolLM2-135M (byte-level BPE 49,152).

* greedy TLI speculation is token-identical to the target alone (slow: real weights);
* without ``use_heterogeneous_vocab`` the pair is refused (slow: the check runs after loading);
* the draft's incremental re-tokenization of the committed target ids never alters the committed text
  (fast: real tokenizers only, no weights);
* histories the draft cannot read -- no text at all (only special tokens), or more draft tokens than the
  draft's context holds -- still decode exactly like the target alone (fast: tiny random models over the
  real tokenizers).
"""

from __future__ import annotations

import random

import pytest

from specdec import LLM, SamplingParams
from specdec.errors import ConfigError
from specdec.tli import analyze_tokenizer
from specdec.tli.adapter import TLIAdapter
from specdec.drafting_state import DraftingState
from tests.specdec.tli.tiny_tli import DRAFT_NAME, TARGET_NAME, llm_over, real_tokenizers, require_packages, tiny_llama

PROMPTS = [
    "The history of the Roman Empire is",  # prose
    "def fibonacci(n):\n    ",  # code
    "Café crème — 東京 🍣",  # accents, an em dash, CJK and an emoji
]
MAX_TOKENS = 24


def spec_config(k: int, method: str = "greedy", **extra) -> dict:
    return {"method": "draft_model", "model": DRAFT_NAME, "num_speculative_tokens": k,
            "draft_sample_method": method, **extra}


# --------------------------------------------------------------------------------------------------
# greedy losslessness on the real pair (slow)


@pytest.fixture(scope="module")
def target_only(cached_model_loading, hf_greedy):
    """{prompt: (prompt ids, 24 greedy token ids)} of Gemma-3-270M alone, float32 -- specdec's
    target-only decoding, checked against Hugging Face ``generate`` on the same weights."""
    require_packages(TARGET_NAME, DRAFT_NAME)
    llm = LLM(TARGET_NAME, dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    refs = {}
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.outputs[0].token_ids) == MAX_TOKENS
        assert out.outputs[0].token_ids == hf_greedy(llm.target.model, out.prompt_token_ids, MAX_TOKENS), prompt
        refs[prompt] = (out.prompt_token_ids, out.outputs[0].token_ids)
    return refs


# (k, draft_sample_method, sampling): temperature 0 for both methods; probabilistic drafting at temperature 0
# takes the greedy path (the draft samples only for non-greedy requests), so top_k=1 sampling -- also
# deterministic, and equal to greedy decoding -- is added to run q (in target ids) through rejection sampling.
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
TOP1 = SamplingParams(temperature=1.0, top_k=1, seed=0, max_tokens=MAX_TOKENS, ignore_eos=True)
CASES = [
    pytest.param(2, "greedy", GREEDY, id="k2-greedy"),
    pytest.param(2, "greedy-intersection", GREEDY, id="k2-greedy-intersection"),
    pytest.param(4, "greedy", GREEDY, id="k4-greedy"),
    # a probabilistic-drafting config serving a greedy request (the draft then drafts greedily): once
    pytest.param(2, "probabilistic", GREEDY, id="k2-probabilistic"),
    pytest.param(3, "probabilistic", TOP1, id="k3-probabilistic-top_k1"),
]
# Measured on this pair (float32, CPU): greedy acceptance 0.20-0.28 on the English prompts, ~0.01 on the
# CJK/emoji one (Gemma answers in Korean, SmolLM2 is English-centred). Thresholds leave a margin.
MIN_ACCEPTANCE_ENGLISH = 0.15
MIN_ACCEPTANCE_ALL = 0.08


@pytest.mark.slow
@pytest.mark.parametrize("k, method, params", CASES)
def test_tli_greedy_equals_target_alone(target_only, k, method, params):
    """Greedy drafting proposes the drafted text in target ids (the default, tli_proposals="text") or
    intersection tokens only ("greedy-intersection"); both are token-identical to the target alone."""
    extra = {"use_heterogeneous_vocab": True}
    if method == "greedy-intersection":
        method, extra["tli_proposals"] = "greedy", "intersection"
    llm = LLM(TARGET_NAME, speculative_config=spec_config(k, method, **extra), dtype="float32")
    assert llm._draft_worker.tli.proposals == extra.get("tli_proposals", "text")
    assert isinstance(llm._draft_worker.tli, TLIAdapter)
    assert llm.max_model_len == 32768  # a TLI draft does not cap the target's context
    outs = llm.generate(PROMPTS, params)
    english = []
    for prompt, out in zip(PROMPTS, outs):
        ids, ref = target_only[prompt]
        assert out.prompt_token_ids == ids
        got = out.outputs[0].token_ids
        assert got == ref, (
            f"k={k} {method} prompt={prompt!r}: TLI output differs from the target alone at position "
            f"{next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)}:\n"
            f"  TLI   : {out.outputs[0].text!r}\n  target: {llm.get_tokenizer().decode(ref)!r}")
        assert out.outputs[0].finish_reason == "length"
        stats = out.spec_decode_stats
        # k draft tokens' text can make up to 2k target tokens (text proposals)
        assert stats.num_draft_tokens <= (k if "tli_proposals" in extra else 2 * k) * stats.num_drafts
        assert stats.num_accepted_tokens + stats.num_target_passes >= MAX_TOKENS
        if prompt != PROMPTS[2]:
            english.append(stats)
    total = outs[0].spec_decode_stats
    for out in outs[1:]:
        total.merge(out.spec_decode_stats)
    eng = english[0]
    eng.merge(english[1])
    summary = f"k={k} {method}: all {total.as_dict()}, english acceptance {eng.acceptance_rate:.3f}"
    print(summary)
    assert total.acceptance_rate > MIN_ACCEPTANCE_ALL, summary
    assert eng.acceptance_rate > MIN_ACCEPTANCE_ENGLISH, summary
    assert total.mean_acceptance_length > 1.0 and eng.mean_acceptance_length > 1.15, summary
    assert total.num_target_passes < len(PROMPTS) * MAX_TOKENS, "speculation saved no target pass"


@pytest.mark.slow
def test_pair_refused_without_use_heterogeneous_vocab(cached_model_loading):
    require_packages(TARGET_NAME, DRAFT_NAME)
    with pytest.raises(ConfigError, match="use_heterogeneous_vocab") as info:
        LLM(TARGET_NAME, speculative_config=spec_config(2), dtype="float32")
    assert DRAFT_NAME in str(info.value) and TARGET_NAME in str(info.value)
    with pytest.raises(ConfigError, match="use_heterogeneous_vocab"):
        LLM(TARGET_NAME, speculative_config=spec_config(2, use_heterogeneous_vocab=False), dtype="float32")


# --------------------------------------------------------------------------------------------------
# incremental re-tokenization of the committed text (real tokenizers, no weights)

TRICKY_TEXTS = [
    "Hello,   world!\t\tTabs\n\n\n  and    spaces   \n    trailing    \n\n\n\n  ",
    "Emoji: 👩‍👩‍👧‍👦 family 🏳️‍🌈 flag 👍🏽 🇫🇷🙂🙂🙂 🍣🍣 — done",
    "中文文本：你好，世界。日本語のテキスト、한국어 텍스트. Gothic 𐌰𐌱𐌲, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 nbsp\u00a0\u00a0x\u3000y",
    "def f(x):\n    if x  >= 10:\n\treturn {'a': [1, 2,  3]}  # comment\r\n"
    "    for i in range(10):\n        print(f\"{i:>4}\")\n\n\n",
    "Café crème — 東京 🍣, naïve résumé e\u0301 ﬁ Ω, literal <|im_start|> and ▁ and <0x41>",
]


@pytest.fixture(scope="module")
def adapter():
    target_tok, draft_tok = real_tokenizers()
    return TLIAdapter(draft_tok, target_tok, len(target_tok))


def _check_step(adapter, target_ids: list[int], draft_ids: list[int]) -> None:
    t_tok, d_tok = adapter.target_tokenizer, adapter.draft_tokenizer
    t_bytes = b"".join(analyze_tokenizer(t_tok).bytes[i] or b"" for i in target_ids)
    d_bytes = b"".join(analyze_tokenizer(d_tok).bytes[i] for i in draft_ids)
    assert d_bytes == t_bytes, f"draft ids stand for {d_bytes[-40:]!r}, the target's text ends {t_bytes[-40:]!r}"
    try:
        t_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return  # the target stopped inside a character: the decoders' U+FFFD counts differ; bytes compared above
    target_text = t_tok.decode(target_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    draft_text = d_tok.decode(draft_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert draft_text == target_text


@pytest.mark.parametrize("text_index", range(len(TRICKY_TEXTS)))
def test_draft_history_follows_target_ids_in_chunks(adapter, text_index):
    """Target ids arrive a few at a time (as rounds commit them); after every step the draft ids decode to
    exactly the committed text, and the ids the draft had before the stable point are kept."""
    text = TRICKY_TEXTS[text_index]
    t_tok, d_tok = adapter.target_tokenizer, adapter.draft_tokenizer
    target_ids = list(t_tok(text).input_ids)  # with Gemma's <bos>: special, it adds no text
    assert target_ids[0] == t_tok.bos_token_id
    for seed in range(3):
        rng = random.Random(seed)
        state = DraftingState()
        before: list[int] = []
        pos = 0
        while pos < len(target_ids):
            pos = min(len(target_ids), pos + rng.randint(1, 4))
            draft_ids = adapter.draft_history(state, target_ids[:pos])
            _check_step(adapter, target_ids[:pos], draft_ids)
            stable = state.retokenized.context.last_stable
            assert draft_ids[:stable] == before[:stable], "ids before the stable point changed"
            assert not set(draft_ids) & analyze_tokenizer(d_tok).special_ids, "a draft special token stands for text"
            before = list(draft_ids)  # (the next call changes the list it returned, in place)
        decoded = t_tok.decode(target_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert d_tok.decode(draft_ids, clean_up_tokenization_spaces=False) == decoded
        if "<|" not in text:  # the final ids are the draft tokenizer's own tokenization of the text
            assert draft_ids == d_tok.backend_tokenizer.encode(decoded, add_special_tokens=False).ids


def test_draft_history_restarts_when_the_history_is_rewritten(adapter):
    """A history that is not an extension of the last one (a rolled-back or different sequence under the
    same state) re-tokenizes from scratch and is still exact."""
    t_tok = adapter.target_tokenizer
    a = list(t_tok("Café crème — 東京 🍣 and   more").input_ids)
    b = list(t_tok("Café crème — 大阪 🍜 or so").input_ids)
    state = DraftingState()
    for ids in (a, a[: len(a) // 2], b, b + a[1:], a[:3]):
        _check_step(adapter, ids, adapter.draft_history(state, ids))


@pytest.mark.heavy
@pytest.mark.parametrize("seed", range(3))
def test_draft_history_kept_in_place_equals_a_fresh_one(adapter, seed):
    """Given one TokenHistory that grows and loses a tail now and then (as a service's or a lookahead's),
    draft_history compares only what changed and changes its own lists in place; every step returns the
    ids a fresh state gets from the same ids as a plain list."""
    from specdec.history import TokenHistory

    rng = random.Random(seed)
    t_tok = adapter.target_tokenizer
    target_ids = [i for text in TRICKY_TEXTS for i in t_tok(text).input_ids]
    state = DraftingState()
    history = TokenHistory(target_ids[:3])
    first = adapter.draft_history(state, history)
    lists = (first, state.held_target_ids)
    pos = 3
    while pos < len(target_ids):
        if rng.random() < 0.3:  # a tail lost (drafts), then committed ids again
            history.truncate(max(1, len(history) - rng.randint(1, 5)))
            history += [rng.randrange(1000, 2000) for _ in range(rng.randint(0, 3))]
            got = adapter.draft_history(state, history)
            assert got == adapter.draft_history(DraftingState(), list(history))
            history.truncate(max(1, pos - rng.randint(0, 3)))
        history += target_ids[len(history):pos]
        got = adapter.draft_history(state, history)
        assert got == adapter.draft_history(DraftingState(), list(history)), pos
        _check_step(adapter, list(history), got)
        assert got is lists[0] and state.held_target_ids is lists[1]  # changed in place
        pos += rng.randint(1, 6)


@pytest.mark.parametrize("text_index", range(len(TRICKY_TEXTS)))
def test_text_proposals_are_the_drafted_text_in_target_ids(adapter, text_index):
    """Greedy drafts converted through their text (tli_proposals="text"): the target ids stand for exactly the
    drafted bytes, up to the limit; a trailing incomplete character is left out; a special token ends the text."""
    text = TRICKY_TEXTS[text_index]
    t_tok, d_tok = adapter.target_tokenizer, adapter.draft_tokenizer
    t_table, d_table = analyze_tokenizer(t_tok).bytes, analyze_tokenizer(d_tok).bytes
    draft_ids = d_tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
    got = adapter.text_to_target(draft_ids, 1000)
    specials = [j for j, i in enumerate(draft_ids) if d_table[i] is None]  # e.g. a literal <|im_start|>
    drafted = b"".join(d_table[i] for i in draft_ids[: specials[0] if specials else None])
    assert drafted == text.encode() if not specials else text.encode().startswith(drafted)
    assert b"".join(t_table[i] for i in got) == drafted
    if "<|" not in text and "<0x" not in text:  # the target tokenizer's own tokenization of the text
        assert got == t_tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
    assert adapter.text_to_target(draft_ids, 3) == got[:3]
    assert adapter.text_to_target(draft_ids, 0) == []
    # Cut the draft ids inside a multi-byte character: only whole characters are proposed.
    for n in range(1, len(draft_ids)):
        data = b"".join(d_table[i] for i in draft_ids[:n])
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            part = adapter.text_to_target(draft_ids[:n], 1000)
            whole = b"".join(t_table[i] for i in part)
            assert data.startswith(whole) and len(data) - len(whole) < 4
            whole.decode("utf-8")
            break
    eos = d_tok.eos_token_id
    assert adapter.text_to_target(draft_ids[:2] + [eos] + draft_ids[2:], 1000) == adapter.text_to_target(draft_ids[:2], 1000)


# --------------------------------------------------------------------------------------------------
# histories a TLI draft cannot read (tiny random models over the real tokenizers)

DRAFT_MAX_POS = 64  # the tiny draft's context; the tiny target's is 512


@pytest.fixture(scope="module")
def tiny_pair():
    """(TLI LLM with k=3, target-only LLM, target tokenizer) over tiny random models; the draft's context
    (64 positions) is much shorter than the target's (512), as SmolLM2's 8192 is shorter than Gemma-3's 32768."""
    target_tok, draft_tok = real_tokenizers()
    target = tiny_llama(len(target_tok), seed=0, bos=target_tok.bos_token_id, eos=target_tok.eos_token_id)
    draft = tiny_llama(len(draft_tok), seed=1, bos=draft_tok.bos_token_id, eos=draft_tok.eos_token_id,
                       max_pos=DRAFT_MAX_POS)
    return llm_over(target, target_tok, draft, draft_tok, k=3), llm_over(target, target_tok), target_tok


def _greedy_ids(llm, prompt, max_tokens: int = 6) -> list[int]:
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    return out.outputs[0].token_ids


@pytest.mark.parametrize("prompt", [
    pytest.param("", id="empty-string"),  # Gemma encodes "" as [<bos>]
    pytest.param({"prompt_token_ids": [2]}, id="bos-only"),
    pytest.param({"prompt_token_ids": [2, 105]}, id="bos-start_of_turn"),  # a chat turn opening: no text yet
])
def test_prompt_without_text_decodes_like_target_alone(tiny_pair, prompt):
    """BUG: the target accepts a prompt of special tokens only (e.g. "" -> [<bos>]), but its text is empty, so
    the TLI draft's history is [] (SmolLM2 adds no BOS); ModelRunner.sync([]) returns [] and the draft's forward
    of zero tokens crashes (RuntimeError inside transformers). The draft should propose nothing until there is
    text, and the request decode like the target alone."""
    tli_llm, target_llm, _ = tiny_pair
    assert tli_llm._draft_worker.tli.draft_history(DraftingState(), [2]) == []
    assert _greedy_ids(tli_llm, prompt) == _greedy_ids(target_llm, prompt)


def test_history_longer_than_the_drafts_context_decodes_like_target_alone(tiny_pair):
    """BUG: with TLI the LLM's max_model_len is the target's alone (the draft "counts its own tokens against its
    own limit"), but a history whose draft re-tokenization exceeds the draft's context fails the whole request
    with InvalidRequestError('sequence of N tokens exceeds max_model_len=64') from the draft's ModelRunner.
    CJK text is ~1 Gemma token per word and ~3 SmolLM2 byte tokens per character, so it happens well inside the
    target's limit. The draft should stop drafting (or draft fewer tokens) once it is full."""
    tli_llm, target_llm, target_tok = tiny_pair
    prompt = "東京 大阪 京都 " * 12
    ids = target_tok(prompt).input_ids
    draft_len = len(tli_llm._draft_worker.tli.draft_history(DraftingState(), ids))
    assert len(ids) + 6 < tli_llm.max_model_len and draft_len > DRAFT_MAX_POS, (len(ids), draft_len)
    assert _greedy_ids(tli_llm, prompt) == _greedy_ids(target_llm, prompt)


def test_history_near_the_drafts_context_decodes_like_target_alone(tiny_pair):
    """Control for the test above: a history that fits the draft's context (with room for its k - 1 fed drafts)
    decodes like the target alone."""
    tli_llm, target_llm, target_tok = tiny_pair
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    draft_len = len(tli_llm._draft_worker.tli.draft_history(DraftingState(), target_tok(prompt).input_ids))
    assert draft_len + 2 + 6 <= DRAFT_MAX_POS, draft_len
    assert _greedy_ids(tli_llm, prompt) == _greedy_ids(target_llm, prompt)


@pytest.mark.slow
def test_tli_suffix_hybrid_greedy_equals_target_alone(target_only):
    """Suffix decoding in front of a TLI draft: the trees hold the target's ids (the histories it is given), so
    its drafts need no mapping; the model drafts through TLI where suffix has no match. Token-identical."""
    spec = {"method": "suffix", "model": DRAFT_NAME, "num_speculative_tokens": 8, "use_heterogeneous_vocab": True,
            "draft_model_num_speculative_tokens": 2}
    llm = LLM(TARGET_NAME, speculative_config=spec, dtype="float32")
    assert isinstance(llm._draft_worker.tli, TLIAdapter)
    for _ in range(2):  # the second pass drafts from the first one's outputs (the global tree)
        outs = llm.generate(PROMPTS, GREEDY)
        for prompt, out in zip(PROMPTS, outs):
            assert out.outputs[0].token_ids == target_only[prompt][1], prompt
    assert sum(o.spec_decode_stats.num_accepted_tokens for o in outs) >= MAX_TOKENS * len(PROMPTS) // 2


def test_tli_trees_over_the_intersection_decode_like_target_alone(tiny_pair):
    """tli_proposals "intersection" with speculative_token_tree "dynamic": the draft grows its trees over the
    vocabularies' intersection, each node goes to the target as its target id, and the output is the target
    alone's. (Text proposals retokenize a path: chains only, refused with trees.)"""
    _, target_llm, target_tok = tiny_pair
    _, draft_tok = real_tokenizers()
    target = tiny_llama(len(target_tok), seed=0, bos=target_tok.bos_token_id, eos=target_tok.eos_token_id)
    draft = tiny_llama(len(draft_tok), seed=1, bos=draft_tok.bos_token_id, eos=draft_tok.eos_token_id,
                       max_pos=DRAFT_MAX_POS)
    llm = llm_over(target, target_tok, draft, draft_tok, k=3, tli_proposals="intersection",
                   speculative_token_tree="dynamic", speculative_eagle_topk=3, speculative_num_draft_tokens=8)
    worker = llm._target_worker
    seen = []
    original = worker.verify_batch

    def recording(calls):
        seen.extend(c.proposal for c in calls)
        return original(calls)

    worker.verify_batch = recording
    tli = llm._draft_worker.tli
    for prompt in ("The quick brown fox", "def fibonacci(n):\n    "):
        assert _greedy_ids(llm, prompt, 8) == _greedy_ids(target_llm, prompt, 8)
    trees = [p for p in seen if p.is_tree]
    assert trees and all(len(p.draft_token_ids) <= 8 for p in trees)
    for p in trees:  # every node an intersection token, in target ids
        assert all(tli.to_target(tli.to_draft(t)) == t for t in p.draft_token_ids)
    with pytest.raises(ConfigError, match="tli_proposals"):
        llm_over(target, target_tok, draft, draft_tok, k=3, speculative_token_tree="dynamic")
