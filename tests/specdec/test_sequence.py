"""IncrementalDetokenizer and SequenceState (stop conditions, budgets, streaming hold-back), on SmolLM2's real tokenizer."""

from __future__ import annotations

import random

import pytest

from specdec.sampling import SamplingParams
from specdec.sequence import IncrementalDetokenizer, SequenceState

TRICKY_TEXTS = [
    "Hello 👋🏽 world 🎉🇫🇷! 👨‍👩‍👧‍👦",
    "你好，世界。日本語のテキストと한국어",
    "multiple    spaces\tand\n\n\nnewlines   ",
    "def f(x):\n    return {'a': x ** 2}  # ok\n\tpass",
    " leading space and trailing ",
    "naïve café — “quotes” … 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√",
    "don't  ,  . ! ? ;; ,,",
]


def _run_detok(tokenizer, prompt_ids, ids):
    d = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [d.step(i) for i in ids]
    return deltas, d.flush()


@pytest.mark.parametrize("text", TRICKY_TEXTS)
@pytest.mark.parametrize("prompt", ["", "Prefix:", "A longer prompt with several tokens in it"])
def test_incremental_detokenizer_round_trips(tokenizer, text, prompt):
    ids = tokenizer(text).input_ids
    prompt_ids = tokenizer(prompt).input_ids
    deltas, tail = _run_detok(tokenizer, prompt_ids, ids)
    assert "".join(deltas) + tail == tokenizer.decode(ids) == text
    # a valid text is never cut inside a multi-byte character
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_holds_back_partial_characters(tokenizer):
    ids = tokenizer("🎉").input_ids
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    deltas, tail = _run_detok(tokenizer, [], ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🎉" and tail == ""
    # cut off in the middle: flush returns what is held back (a replacement character)
    deltas, tail = _run_detok(tokenizer, [], ids[:-1])
    assert "".join(deltas) == ""
    assert tail == tokenizer.decode(ids[:-1]) and "\ufffd" in tail


def test_incremental_detokenizer_random_ids(tokenizer):
    """Arbitrary id sequences (mixing byte tokens of emoji/CJK) still concatenate to decode(ids)."""
    rng = random.Random(0)
    pieces = tokenizer("👋🏽🎉你好한국어𝔘").input_ids
    for _ in range(60):
        ids = [rng.randrange(len(tokenizer)) if rng.random() < 0.6 else rng.choice(pieces) for _ in range(rng.randrange(1, 16))]
        deltas, tail = _run_detok(tokenizer, [rng.randrange(len(tokenizer))], ids)
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_incremental_detokenizer_skips_special_tokens(tokenizer):
    ids = tokenizer("Hi there").input_ids
    with_eos = ids[:1] + [tokenizer.eos_token_id] + ids[1:]
    deltas, tail = _run_detok(tokenizer, [], with_eos)
    assert "".join(deltas) + tail == "Hi there"


# --------------------------------------------------------------------------------------------------
# SequenceState

TEXT = "The answer is forty-two and then some more words"  # ' forty' '-' 'two' ' and' ...


def _seq(tokenizer, params, prompt="Q:", max_model_len=1000, eos=None):
    return SequenceState(
        prompt_token_ids=tokenizer(prompt).input_ids,
        params=params,
        tokenizer=tokenizer,
        eos_token_ids=frozenset({tokenizer.eos_token_id} if eos is None else eos),
        max_model_len=max_model_len,
    )


def _feed(seq, ids):
    """Append ids until the sequence finishes; return the deltas and the number appended."""
    deltas = []
    n = 0
    for t in ids:
        if seq.finished:
            break
        deltas.append(seq.append(t))
        n += 1
        # streaming never emits text that is later taken back
        assert seq.text.startswith("".join(deltas))
    return deltas, n


def test_plain_text_and_length(tokenizer):
    ids = tokenizer(TEXT).input_ids
    seq = _seq(tokenizer, SamplingParams(max_tokens=len(ids)))
    deltas, n = _feed(seq, ids)
    assert n == len(ids) and seq.finish_reason == "length" and seq.stop_reason is None
    assert seq.text == "".join(deltas) == TEXT
    assert seq.output_token_ids == ids and seq.token_ids == seq.prompt_token_ids + ids


def test_max_tokens_budget(tokenizer):
    ids = tokenizer(TEXT).input_ids
    seq = _seq(tokenizer, SamplingParams(max_tokens=3))
    assert seq.budget == 3
    _, n = _feed(seq, ids)
    assert n == 3 and seq.finish_reason == "length" and seq.budget == 0
    assert seq.text == tokenizer.decode(ids[:3])
    with pytest.raises(AssertionError):
        seq.append(ids[3])


def test_max_model_len_budget(tokenizer):
    ids = tokenizer(TEXT).input_ids
    prompt_len = len(tokenizer("Q:").input_ids)
    seq = _seq(tokenizer, SamplingParams(max_tokens=None), max_model_len=prompt_len + 4)
    assert seq.budget == 4
    _, n = _feed(seq, ids)
    assert n == 4 and seq.finish_reason == "length" and len(seq.token_ids) == prompt_len + 4
    # max_tokens and max_model_len: the smaller one wins
    seq = _seq(tokenizer, SamplingParams(max_tokens=10), max_model_len=prompt_len + 2)
    assert seq.budget == 2


def test_prompt_filling_max_model_len_finishes_immediately(tokenizer):
    prompt_len = len(tokenizer("Q:").input_ids)
    seq = _seq(tokenizer, SamplingParams(), max_model_len=prompt_len)
    assert seq.finished and seq.finish_reason == "length"


def test_eos_stops_and_is_not_in_text(tokenizer):
    ids = tokenizer(TEXT).input_ids
    eos = tokenizer.eos_token_id
    seq = _seq(tokenizer, SamplingParams(max_tokens=50))
    _, n = _feed(seq, ids[:4] + [eos] + ids[4:])
    assert n == 5 and seq.finish_reason == "stop" and seq.stop_reason is None
    assert seq.output_token_ids == ids[:4] + [eos]
    assert seq.text == tokenizer.decode(ids[:4])


def test_ignore_eos_continues(tokenizer):
    ids = tokenizer(TEXT).input_ids
    eos = tokenizer.eos_token_id
    stream = ids[:4] + [eos] + ids[4:]
    seq = _seq(tokenizer, SamplingParams(max_tokens=len(stream), ignore_eos=True))
    _, n = _feed(seq, stream)
    assert n == len(stream) and seq.finish_reason == "length"
    assert seq.text == TEXT  # the special token is skipped in the text


def test_custom_eos_set(tokenizer):
    ids = tokenizer(TEXT).input_ids
    seq = _seq(tokenizer, SamplingParams(max_tokens=50), eos={ids[3]})
    _, n = _feed(seq, ids)
    assert n == 4 and seq.finish_reason == "stop" and seq.stop_reason is None


def test_stop_token_ids(tokenizer):
    ids = tokenizer(TEXT).input_ids
    seq = _seq(tokenizer, SamplingParams(max_tokens=50, stop_token_ids=[ids[5], 99999]))
    _, n = _feed(seq, ids)
    assert n == 6 and seq.finish_reason == "stop" and seq.stop_reason == ids[5]
    assert seq.output_token_ids == ids[:6]
    assert seq.text == tokenizer.decode(ids[:5])


@pytest.mark.parametrize(
    "stop, expected_text, expected_tokens",
    [
        ("two and", "The answer is forty-", 7),  # spans 'two' + ' and': completes at token 7
        ("-tw", "The answer is forty", 6),  # spans '-' + 'two'
        ("answer", "The ", 2),  # a whole token
        ("y-t", "The answer is fort", 6),
        ("words", "The answer is forty-two and then some more ", 11),
    ],
)
def test_stop_string_spanning_tokens(tokenizer, stop, expected_text, expected_tokens):
    ids = tokenizer(TEXT).input_ids
    seq = _seq(tokenizer, SamplingParams(max_tokens=50, stop=[stop]))
    deltas, n = _feed(seq, ids)
    assert seq.finish_reason == "stop" and seq.stop_reason == stop
    assert seq.text == expected_text == "".join(deltas)
    assert n == expected_tokens and seq.output_token_ids == ids[:expected_tokens]


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer(TEXT).input_ids
    seq = _seq(tokenizer, SamplingParams(max_tokens=50, stop=["two and"], include_stop_str_in_output=True))
    deltas, _ = _feed(seq, ids)
    assert seq.text == "The answer is forty-two and" == "".join(deltas)
    assert seq.stop_reason == "two and"


def test_earliest_stop_string_wins(tokenizer):
    ids = tokenizer(TEXT).input_ids
    seq = _seq(tokenizer, SamplingParams(max_tokens=50, stop=["then some", "forty-two and"]))
    _feed(seq, ids)
    assert seq.stop_reason == "forty-two and" and seq.text == "The answer is "
    # both complete on the same token: the one that starts first wins
    seq = _seq(tokenizer, SamplingParams(max_tokens=50, stop=["two", "forty-two"]))
    _feed(seq, ids)
    assert seq.stop_reason == "forty-two" and seq.text == "The answer is "


def test_stop_string_in_prompt_is_ignored(tokenizer):
    ids = tokenizer(" more words").input_ids
    seq = _seq(tokenizer, SamplingParams(max_tokens=len(ids), stop=["answer"]), prompt=TEXT)
    _feed(seq, ids)
    assert seq.finish_reason == "length" and seq.text == " more words"


def test_streaming_holds_back_possible_stop_prefix(tokenizer):
    ids = tokenizer(TEXT).input_ids
    seq = _seq(tokenizer, SamplingParams(max_tokens=50, stop=["forty-seven"]))  # never completes
    deltas = []
    for t in ids:
        deltas.append(seq.append(t))
        # everything except the last len(stop) - 1 characters has been released
        assert "".join(deltas) == seq.text[: max(0, len(seq.text) - (len("forty-seven") - 1))]
    assert not seq.finished and seq.text == TEXT
    # at the end (length) the held-back tail is released
    seq2 = _seq(tokenizer, SamplingParams(max_tokens=len(ids), stop=["forty-seven"]))
    deltas2, _ = _feed(seq2, ids)
    assert seq2.finish_reason == "length" and "".join(deltas2) == seq2.text == TEXT


def test_stop_string_across_held_back_multibyte(tokenizer):
    text = "Cheers 🎉🎉 done"
    ids = tokenizer(text).input_ids
    seq = _seq(tokenizer, SamplingParams(max_tokens=50, stop=["🎉 d"]))
    deltas, _ = _feed(seq, ids)
    assert seq.text == "Cheers 🎉" == "".join(deltas)
    assert seq.stop_reason == "🎉 d"


def test_abort(tokenizer):
    seq = _seq(tokenizer, SamplingParams())
    seq.append(tokenizer("Hi").input_ids[0])
    seq.abort()
    assert seq.finish_reason == "abort"
    done = _seq(tokenizer, SamplingParams(max_tokens=1))
    done.append(5)
    done.abort()  # a finished sequence keeps its reason
    assert done.finish_reason == "length"
