"""The Responses API's store, served (``specdec serve`` with two API keys and a store of 4 entries): one key's
responses are a 404 to the other, the bound holds under many requests (the gauge on /metrics says so), and
``truncation: "auto"`` drops the oldest turns of a conversation longer than the context."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.openai.http_helpers import KEY, assert_error_body, openai_client, raw_client, serve

OTHER = "sk-specdec-other-key"
MAX_ENTRIES = 4


@pytest.fixture(scope="module")
def keyed_stack(target_dir, good_draft_dir):
    stack = serve(target_dir, good_draft_dir, api_key=[KEY, OTHER], responses_store_max_entries=MAX_ENTRIES)
    try:
        yield stack
    finally:
        stack.stop(0)


def test_one_keys_responses_are_not_anothers(keyed_stack, target_dir):
    model = str(target_dir)
    with openai_client(keyed_stack) as mine, openai_client(keyed_stack, api_key=OTHER) as theirs:
        r = mine.responses.create(model=model, input="secret plans", max_output_tokens=3, temperature=0)
        for call in (lambda: theirs.responses.retrieve(r.id), lambda: theirs.responses.delete(r.id),
                     lambda: theirs.responses.create(model=model, previous_response_id=r.id, input="more",
                                                     max_output_tokens=2)):
            with pytest.raises(openai.NotFoundError):
                call()
        assert mine.responses.retrieve(r.id).output_text == r.output_text
        assert mine.responses.create(model=model, previous_response_id=r.id, input="more",
                                     max_output_tokens=2).previous_response_id == r.id


def test_the_store_stays_bounded_under_many_requests(keyed_stack, target_dir):
    model = str(target_dir)
    with openai_client(keyed_stack) as client, raw_client(keyed_stack) as raw:
        ids = [client.responses.create(model=model, input=f"note {i}", max_output_tokens=1).id for i in range(12)]
        for rid in ids[:-MAX_ENTRIES]:
            assert_error_body(raw.get(f"/v1/responses/{rid}"), 404, param="response_id")
        for rid in ids[-MAX_ENTRIES:]:
            assert raw.get(f"/v1/responses/{rid}").json()["id"] == rid
        metrics = raw.get("/metrics").text
    stored = [line for line in metrics.splitlines()  # (other stacks of this test process have their own series)
              if line.startswith("specdec_responses_stored{") and f'model_name="{model}"' in line]
    assert stored and float(stored[0].split()[-1]) == MAX_ENTRIES, stored
    assert 'specdec_responses_evicted_total{' in metrics and 'reason="entries"' in metrics


def test_truncation_auto_drops_the_oldest_turns(keyed_stack, target_dir):
    model = str(target_dir)
    turns = [{"role": "user", "content": f"Turn {i}: " + "words and more words " * 6} for i in range(20)]
    with openai_client(keyed_stack) as client, raw_client(keyed_stack) as raw:
        too_long = raw.post("/v1/responses", json={"model": model, "input": turns, "max_output_tokens": 4})
        assert_error_body(too_long, 400, param="input")
        r = client.responses.create(model=model, input=turns, max_output_tokens=4, truncation="auto", temperature=0)
        assert r.truncation == "auto" and r.usage.input_tokens + 4 <= 256  # the stack's max_model_len
        last = client.responses.create(model=model, input=turns[-1:], max_output_tokens=4, temperature=0)
        assert last.usage.input_tokens < r.usage.input_tokens  # more than the last turn was kept
        stored = client.responses.input_items.list(r.id).data  # the input as sent, all of it
        assert len(stored) == len(turns) and stored[0].content[0].text == turns[-1]["content"]
