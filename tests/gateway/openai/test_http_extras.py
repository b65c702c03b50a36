"""What users' tools expect beyond plain sampling, through the official ``openai`` client and raw HTTP:
penalties and biases served with speculation on (greedy = the target alone with the same penalties,
token by token), /tokenize and /detokenize, max_model_len in /v1/models, best_of,
unsupported parameters and bodies that are not JSON (400s in OpenAI's error format).
"""

from __future__ import annotations

import grpc
import openai
import pytest

from specdec import SamplingParams
from specdec.v1 import common_pb2, generation_service_pb2 as gen_pb, generation_service_pb2_grpc
from tests.gateway.openai.http_helpers import (HOST, KEY, PROMPTS, Recorder, assert_error_body, check_usage, raw_client)
from tests.specdec.test_penalties import reference_greedy

N = 20
# as tests/specdec/test_penalties.GREEDY: repeats encouraged, then pushed back as counts grow
PENALTIES = {"presence_penalty": -1.0, "frequency_penalty": 0.5, "logit_bias": {"30459": -100, "1000": 2}}
EXTRA = {"repetition_penalty": 0.8, "min_tokens": 4, "ignore_eos": True}
REF_PARAMS = SamplingParams(temperature=0, presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=0.8,
                            logit_bias={30459: -100.0, 1000: 2.0}, min_tokens=4, ignore_eos=True)


def _recorded(http_stack, call):
    with Recorder(http_stack.gateway.backend) as rec:
        result = call()
        if hasattr(result, "__next__"):
            result = list(result)
    return result, rec.seqs


# -- penalties and biases ------------------------------------------------------------------------------


def test_greedy_penalties_equal_the_target_alone(http_stack, client, model, tokenizer, target_model):
    prompt_ids = tokenizer(PROMPTS[0]).input_ids
    expected = reference_greedy(target_model, prompt_ids, REF_PARAMS, N)
    out, (seq,) = _recorded(http_stack, lambda: client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=N, temperature=0, extra_body=EXTRA, **PENALTIES))
    sd = check_usage(out.usage, completion_tokens=N)
    assert sd["num_accepted_tokens"] >= 4, "multi-token blocks must be exercised"
    assert seq.output_token_ids == expected
    plain = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=N, temperature=0)
    assert plain.choices[0].text != out.choices[0].text, "the penalties must change the output"

    chunks, (seq,) = _recorded(http_stack, lambda: client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=N, temperature=0, stream=True, extra_body=EXTRA, **PENALTIES))
    assert seq.output_token_ids == expected
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text


def test_chat_penalties_equal_the_target_alone(http_stack, client, model, target_model):
    messages = [{"role": "user", "content": "Say something."}]
    for stream in (False, True):
        _, (seq,) = _recorded(http_stack, lambda: client.chat.completions.create(
            model=model, messages=messages, max_tokens=N, temperature=0, stream=stream, extra_body=EXTRA,
            **PENALTIES))
        assert seq.output_token_ids == reference_greedy(target_model, seq.prompt_token_ids, REF_PARAMS, N)


def test_grpc_penalties_equal_the_target_alone(http_stack, tokenizer, target_model):
    prompt_ids = tokenizer(PROMPTS[1]).input_ids
    penalties = common_pb2.Penalties(presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=0.8,
                                     logit_bias={30459: -100, 1000: 2}, min_tokens=4)
    request = gen_pb.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=N, ignore_eos=True,
                                     sampling_params=common_pb2.SamplingParams(temperature=0, penalties=penalties))
    with grpc.insecure_channel(f"{HOST}:{http_stack.gateway.port}") as channel:
        stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
        responses = list(stub.Generate(request, timeout=30, metadata=[("authorization", f"Bearer {KEY}")]))
    ids = [t for r in responses for t in r.token_ids]
    # float32 on the wire: the reference takes the same rounded values
    assert ids == reference_greedy(target_model, prompt_ids, REF_PARAMS, N)


def test_min_tokens_holds_a_stop_token_back(http_stack, client, model):
    _, (seq,) = _recorded(http_stack, lambda: client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8,
                                                                        temperature=0))
    stop_id = seq.output_token_ids[1]  # the second greedy token
    for stream in (False, True):
        stopped = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=stream,
                                            extra_body={"stop_token_ids": [stop_id]}, stream_options={
                                                "include_usage": True} if stream else None)
        stopped = stopped if not stream else [c for c in stopped if c.usage][0]
        assert stopped.usage.completion_tokens == 2
        held = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                         extra_body={"stop_token_ids": [stop_id], "min_tokens": 5})
        assert held.usage.completion_tokens >= 5


# -- tokenize, models ------------------------------------------------------------------------------------


def test_tokenize_and_detokenize(raw, model, tokenizer, http_stack):
    r = raw.post("/tokenize", json={"model": model, "prompt": PROMPTS[1]})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tokenizer(PROMPTS[1]).input_ids
    assert body == {"count": len(ids), "max_model_len": http_stack.gateway.backend.max_model_len, "tokens": ids,
                    "token_strs": None}
    strs = raw.post("/tokenize", json={"prompt": PROMPTS[1], "return_token_strs": True}).json()["token_strs"]
    assert strs == tokenizer.convert_ids_to_tokens(ids)
    chat = raw.post("/tokenize", json={"model": model, "messages": [{"role": "user", "content": "hi"}]}).json()
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                             tokenize=True)
    assert chat["tokens"] == (expected if isinstance(expected, list) else list(expected["input_ids"]))
    assert raw.post("/detokenize", json={"model": model, "tokens": ids}).json() == {"prompt": PROMPTS[1]}
    assert_error_body(raw.post("/detokenize", json={"tokens": [10**9]}), 400, param="tokens")
    assert_error_body(raw.post("/tokenize", json={"model": "other", "prompt": "x"}), 404)
    assert_error_body(raw_client(http_stack, api_key=None).post("/tokenize", json={"prompt": "x"}), 401)


def test_models_report_max_model_len(client, http_stack):
    (m,) = client.models.list().data
    assert m.model_extra["max_model_len"] == http_stack.gateway.backend.max_model_len


# -- what is refused ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields", [
    {"best_of": 3}, {"suffix": "end"}, {"extra_body": {"logits_processors": ["x"]}},
    {"extra_body": {"bad_words": ["x"]}}, {"extra_body": {"use_beam_search": True}},
], ids=["best_of", "suffix", "logits_processors", "bad_words", "use_beam_search"])
def test_unsupported_parameter_is_400_naming_it(client, model, fields):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=2, **fields)
    name = next(iter(fields.get("extra_body", fields)))
    err = assert_error_body(info.value.response, 400, param=name)
    assert name in err["message"] and "not supported" in err["message"]


def test_body_that_is_not_json_is_400_saying_so(raw):
    r = raw.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": ',
                 headers={"content-type": "application/json"})
    err = assert_error_body(r, 400)
    assert "not valid JSON" in err["message"] and err["param"] is None
    r = raw.post("/v1/completions", data={"prompt": "hi", "max_tokens": "2"})  # form-encoded (curl -d's default)
    err = assert_error_body(r, 400)
    assert "application/json" in err["message"] and "x-www-form-urlencoded" in err["message"]
    err = assert_error_body(raw.post("/v1/chat/completions", json=["not", "an", "object"]), 400)
    assert "JSON object" in err["message"]


def test_grpc_logit_bias_outside_the_vocabulary_is_invalid_argument(http_stack, tokenizer):
    sampling = common_pb2.SamplingParams(temperature=0, penalties=common_pb2.Penalties(logit_bias={10**6: 1.0}))
    request = gen_pb.GenerateRequest(prompt="hi", max_tokens=2, sampling_params=sampling)
    with grpc.insecure_channel(f"{HOST}:{http_stack.gateway.port}") as channel:
        stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=30, metadata=[("authorization", f"Bearer {KEY}")]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in info.value.details()
