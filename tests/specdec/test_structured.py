"""Structured outputs in the library: masks, the per-sequence constraint, and losslessness under a grammar
(greedy identity with constrained target-only decoding; the exact constrained distribution when sampling)."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.errors import InvalidRequestError
from specdec.proposal import Proposal
from specdec.structured import GrammarCompiler, StructuredOutputsParams
from specdec.token_mask import allowed_rows, apply_token_bitmask, from_bytes, num_words
from specdec.serving.wire import mask_to_bytes

pytestmark = pytest.mark.usefixtures("cached_model_loading")

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["colour", "count", "ok"], "additionalProperties": False}
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    return"]


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def test_bitmask_roundtrip_and_masking():
    vocab = 70
    allowed = torch.zeros(3, vocab, dtype=torch.bool)
    allowed[0, [0, 31, 32, 69]] = True
    allowed[1, :] = True
    allowed[2, 5] = True
    words = torch.zeros(3, num_words(vocab), dtype=torch.int64)
    for r in range(3):
        for t in allowed[r].nonzero().flatten().tolist():
            words[r, t // 32] |= 1 << (t % 32)
    bitmask = words.to(torch.int32) if words.max() < 2**31 else (words - (words >= 2**31) * 2**32).to(torch.int32)
    back = from_bytes(mask_to_bytes(bitmask), 3, vocab)
    assert torch.equal(allowed_rows(back, vocab), allowed)
    logits = torch.randn(3, vocab)
    masked = apply_token_bitmask(logits, back)
    assert torch.equal(torch.isfinite(masked), allowed) and torch.equal(masked[allowed], logits[allowed])
    with pytest.raises(InvalidRequestError, match="token_bitmask has 7 bytes"):
        from_bytes(b"\0" * 7, 3, vocab)
    with pytest.raises(InvalidRequestError, match="2 rows, expected 3"):
        apply_token_bitmask(logits, back[:2])


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "objekt"}), "JSON schema in structured_outputs.json cannot be compiled: Unsupported type"),
    (dict(regex="a(b"), "regular expression in structured_outputs.regex cannot be compiled: .*parenthesis"),
    (dict(grammar="root ::= foo"), "grammar .* cannot be compiled: .*Rule \"foo\" is not defined"),
    (dict(json="{not json"), "cannot be compiled: .*Failed to parse JSON"),
])
def test_compile_errors_name_the_problem(grammars, spec, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        grammars.compile(StructuredOutputsParams(**spec))
    assert info.value.param.startswith("structured_outputs.")


@pytest.mark.parametrize("spec, message", [
    (dict(), "exactly one of"), (dict(regex="a", choice=["a"]), "got regex, choice"),
    (dict(choice=[]), "non-empty list"), (dict(regex=" "), "non-empty string"), (dict(json=[1]), "JSON schema"),
])
def test_params_are_checked(spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        StructuredOutputsParams(**spec)


def test_lark_grammars_are_converted_and_bad_ones_named(grammars, tokenizer):
    from specdec.lark_grammar import lark_to_ebnf

    json_lark = """
?start: value
?value: dict | list | ESCAPED_STRING | SIGNED_NUMBER -> number | "true" | "false" | "null"
list : "[" [value ("," value)*] "]"
dict : "{" [pair ("," pair)*] "}"   // pairs
pair : ESCAPED_STRING ":" value
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
"""
    assert lark_to_ebnf(json_lark).splitlines()[0] == "root ::= start"
    c = grammars.constraint(StructuredOutputsParams(grammar=json_lark))
    for t in tokenizer.encode('{"a":[1,true,null],"b":{"c":-2.5e3}}', add_special_tokens=False):
        assert c.accept(t)
    for bad, words in [("start: x\n%ignore WS", "%ignore is not supported"), ("value: 'a'", "needs a 'start' rule"),
                       ("start: /(?=a)b/", "lookarounds")]:
        with pytest.raises(InvalidRequestError, match=words):
            grammars.compile(StructuredOutputsParams(grammar=bad))


def test_constrain_keeps_valid_drafts_cuts_after_the_first_invalid_and_rolls_back(grammars, tokenizer):
    c = grammars.constraint(StructuredOutputsParams(regex="(abc|abd)[0-9]+"))
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    good, bad = enc("abc12"), enc("x")
    out = c.constrain(Proposal(good + bad + enc("77")), limit=16, forced_limit=0)
    assert out.draft_token_ids == good + bad  # the forbidden one is kept (rejected for certain), the rest cut
    assert out.token_bitmask.shape == (len(good) + 2, num_words(len(tokenizer)))
    rows = allowed_rows(out.token_bitmask, len(tokenizer))
    for j, t in enumerate(good):
        assert rows[j, t]
    assert not rows[len(good), bad[0]]
    assert rows[-1].all()  # after a forbidden draft: never reached
    assert c.stats.num_invalid_drafts == 1
    # the matcher is where it was: the same proposal constrains the same way, and committing works
    again = c.constrain(Proposal(good), limit=16, forced_limit=0)
    assert torch.equal(again.token_bitmask[: len(good)], out.token_bitmask[: len(good)])
    for t in good:
        assert c.accept(t)
    final = c.constrain(Proposal([]), limit=0, forced_limit=0)
    assert final.draft_token_ids == [] and allowed_rows(final.token_bitmask, len(tokenizer))[0, tokenizer.eos_token_id]


def test_forced_text_is_proposed_unless_the_drafts_start_with_it(grammars, tokenizer):
    c = grammars.constraint(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    forced = c.forced_tokens(16)
    assert tokenizer.decode(forced) == '{"colour": "'  # the grammar leaves nothing else
    out = c.constrain(Proposal([5, 6]), limit=16, forced_limit=16)
    assert out.draft_token_ids == forced and out.draft_probs is None and c.stats.num_forced_tokens == len(forced)
    mine = Proposal(forced + tokenizer.encode("red", add_special_tokens=False))
    assert c.constrain(mine, limit=16, forced_limit=16).draft_token_ids == mine.draft_token_ids
    assert c.constrain(Proposal([5]), limit=16, forced_limit=0).draft_token_ids == [5]  # no drafting: nothing forced


def _check(spec: StructuredOutputsParams, text: str, finish: str) -> None:
    if finish != "stop":
        return
    if spec.grammar is not None:
        assert re.fullmatch(r"\((?:[a-zA-Z]+|[0-9]+)(?:,(?:[a-zA-Z]+|[0-9]+))*\)", text), text
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice
    else:
        value = json.loads(text)
        if spec.json is not None:
            assert set(value) == set(SCHEMA["properties"]) and value["colour"] in ("red", "green", "blue")


SPECS = [StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), StructuredOutputsParams(regex=r"[a-e]{2,6}-[0-9]{1,3}"),
         StructuredOutputsParams(choice=["alpha", "beta gamma", "delta"]), StructuredOutputsParams(json_object=True),
         StructuredOutputsParams(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [a-z]+ | [0-9]+'),
         StructuredOutputsParams(grammar='start: "(" item ("," item)* ")"\n?item: WORD | NUM  // Lark\n'
                                         'NUM: /\\d{1,3}/\n%import common.WORD')]


@pytest.mark.heavy
@pytest.mark.parametrize("method", ["draft_model", "suffix-hybrid"])
def test_greedy_output_equals_constrained_target_alone(target_dir, good_draft_dir, method):
    """Every kind of grammar, min_p and allowed_token_ids: token-identical to the target alone under the same
    constraints, and the finished texts follow their grammars."""
    alone = LLM(str(target_dir), dtype="float32")
    spec = ({"method": "draft_model", "model": str(good_draft_dir), "num_speculative_tokens": 4}
            if method == "draft_model" else
            {"method": "suffix", "model": str(good_draft_dir), "num_speculative_tokens": 15,
             "draft_model_num_speculative_tokens": 2})
    llm = LLM(str(target_dir), speculative_config=spec, dtype="float32")
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=s) for s in SPECS]
    params.append(SamplingParams(temperature=0, max_tokens=24, min_p=0.3, allowed_token_ids=list(range(200, 900))))
    for p in params:
        want = alone.generate(PROMPTS, p)
        got = llm.generate(PROMPTS, p)
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, p.structured_outputs
            if p.structured_outputs is not None:
                _check(p.structured_outputs, g.outputs[0].text, g.outputs[0].finish_reason)
            if p.allowed_token_ids:
                assert all(200 <= t < 900 for t in g.outputs[0].token_ids)


def _exact_outputs(target_dir, grammars, prompt_ids, spec, temperature):
    """Every token path the grammar allows to its end, with its probability under constrained target-only
    sampling (the target's processed distribution restricted to each position's allowed tokens)."""
    from specdec.engine.models import load_model
    from specdec.sampling import process_logits

    lm = load_model(str(target_dir), dtype="float32")
    params = SamplingParams(temperature=temperature)
    out: dict[tuple, float] = {}

    def walk(path: list[int], prob: float, constraint) -> None:
        row = constraint.constrain(Proposal([]), 0, 0).token_bitmask
        with torch.inference_mode():
            logits = lm.model(input_ids=torch.tensor([prompt_ids + path])).logits[0, -1:]
        p = process_logits(apply_token_bitmask(logits, row), params)[0]
        for t in p.nonzero().flatten().tolist():
            if t == lm.tokenizer.eos_token_id:
                out[tuple(path)] = out.get(tuple(path), 0.0) + prob * float(p[t])
                continue
            constraint.accept(t)
            walk(path + [t], prob * float(p[t]), constraint)
            constraint.matcher.rollback(1)

    walk([], 1.0, grammars.constraint(spec))
    return out


@pytest.mark.heavy
def test_sampled_outputs_follow_the_constrained_target_distribution(target_dir, good_draft_dir, grammars,
                                                                    chi2_pvalue):
    """Spec decoding (a probabilistic draft model) under a choice grammar: the full outputs' frequencies
    against the exact constrained target-only distribution (every tokenization of every choice); the same
    counts against the distribution at another temperature must fail (the test has power)."""
    spec = StructuredOutputsParams(choice=["cat", "dog", "cow", "bird", "ant"])
    llm = LLM(str(target_dir), dtype="float32", speculative_config={
        "method": "draft_model", "model": str(good_draft_dir), "num_speculative_tokens": 3,
        "draft_sample_method": "probabilistic"})
    prompt = list(llm.target.tokenizer("My favourite animal is the").input_ids)
    exact = _exact_outputs(target_dir, grammars, prompt, spec, 1.0)
    assert abs(sum(exact.values()) - 1.0) < 1e-4 and len(exact) > 5
    n = 300
    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        [SamplingParams(temperature=1.0, max_tokens=8, seed=s, structured_outputs=spec) for s in range(n)])
    counts = Counter(tuple(t for t in o.outputs[0].token_ids if t != llm.target.tokenizer.eos_token_id) for o in outs)
    assert all(o.outputs[0].text in spec.choice for o in outs)

    def pvalue(dist: dict) -> float:
        keys = sorted(dist, key=lambda k: -dist[k])
        big = [k for k in keys if dist[k] * n >= 5]
        observed = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
        return chi2_pvalue(observed, [dist[k] for k in big] + [1.0 - sum(dist[k] for k in big)])

    assert pvalue(exact) > 1e-3
    assert pvalue(_exact_outputs(target_dir, grammars, prompt, spec, 0.6)) < 1e-6
