"""Structured outputs on real weights: the shipped pair (SmolLM2-135M + the embedded draft, suffix hybrid) and a
TLI pair (Gemma-3-270M target, SmolLM2-135M draft) under a JSON schema and a regex: greedy output token-identical
to constrained target-only decoding, and what a real model writes under the schema parses and validates."""

from __future__ import annotations

import json
import re

import pytest

from specdec import LLM, SamplingParams
from specdec.config import default_speculative_config
from specdec.structured import StructuredOutputsParams
from tests.specdec.tli.tiny_tli import DRAFT_NAME, TARGET_NAME, require_packages

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cached_model_loading")]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                                           "city": {"type": "string", "maxLength": 40}},
          "required": ["name", "age", "city"], "additionalProperties": False}
TEXT = "Extract the person as JSON with the keys name, age and city.\n\nAda Lovelace, 36, lives in London."
REGEX = r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]"


def _prompt(llm: LLM, text: str) -> dict:
    if not llm.target.tokenizer.chat_template:  # (the GGUF Gemma ships none): the text as a prompt
        return {"prompt_token_ids": list(llm.target.tokenizer(text + "\n").input_ids)}
    ids = llm.target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=True)
    return {"prompt_token_ids": list(ids["input_ids"] if hasattr(ids, "keys") else ids)}


@pytest.mark.parametrize("target, spec", [
    ("smollm2-135m", "shipped"),
    (TARGET_NAME, {"method": "draft_model", "model": DRAFT_NAME, "num_speculative_tokens": 4,
                   "use_heterogeneous_vocab": True}),
], ids=["shipped-pair", "tli-gemma-smollm2"])
def test_real_pair_under_a_schema_equals_constrained_target_alone(target, spec):
    require_packages(*{target, DRAFT_NAME})
    alone = LLM(target, dtype="float32")
    llm = LLM(target, dtype="float32", speculative_config=default_speculative_config() if spec == "shipped" else spec)
    cases = [(TEXT, StructuredOutputsParams(json=SCHEMA)),
             ("When did the Apollo 11 landing happen? Answer with the date only.", StructuredOutputsParams(regex=REGEX))]
    for text, so in cases:
        params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=so)
        want = alone.generate(_prompt(alone, text), params)[0].outputs[0]
        got = llm.generate(_prompt(llm, text), params)[0]
        assert got.outputs[0].token_ids == want.token_ids, (got.outputs[0].text, want.text)
        assert got.outputs[0].finish_reason == "stop", got.outputs[0].text
        if so.json is not None:
            value = json.loads(got.outputs[0].text)
            assert set(value) == {"name", "age", "city"} and isinstance(value["age"], int)
        else:
            assert re.fullmatch(REGEX, got.outputs[0].text)
        assert got.spec_decode_stats.num_accepted_tokens > 0
