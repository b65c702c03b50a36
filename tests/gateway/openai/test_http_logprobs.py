"""logprobs through the OpenAI API (and gRPC) with speculation on: the target's raw log-probabilities
of the emitted tokens, read from the verify pass, equal to a plain transformers forward of the target
in fp32 — never the draft's.

One module-scoped stack (tiny target + a draft that agrees often, k=3), driven by the official client.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from specdec.v1 import common_pb2, generation_service_pb2 as gen_pb, generation_service_pb2_grpc
from tests.gateway.openai.http_helpers import HOST, KEY, PROMPTS, Recorder, check_usage

N = 12
TOL = 2e-4  # float32 over the wire; batched vs single-row forward round differently


@pytest.fixture(scope="module")
def reference(target_model):
    """log_softmax of the target's logits at every position of ``ids`` (plain transformers, fp32):
    row j is the distribution of token j + 1."""
    @torch.inference_mode()
    def ref(ids: list[int]) -> torch.Tensor:
        logits = target_model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, -1)

    return ref


def _check_completion_logprobs(lp, prompt_ids, out_ids, ref, tokenizer, top_n, echo=False):
    """Every token's logprob and top logprobs equal the reference; offsets add up token texts."""
    ids = list(prompt_ids) + list(out_ids)
    table = ref(ids)
    positions = list(range(len(prompt_ids) if not echo else 0, len(ids)))
    assert len(lp.tokens) == len(positions) == len(lp.token_logprobs) == len(lp.text_offset)
    offset = 0
    for j, pos in enumerate(positions):
        text = tokenizer.decode([ids[pos]])
        assert lp.tokens[j] == text
        assert lp.text_offset[j] == offset
        offset += len(text)
        if pos == 0:  # the first prompt token has no logprob
            assert lp.token_logprobs[j] is None and lp.top_logprobs[j] is None
            continue
        row = table[pos - 1]
        assert lp.token_logprobs[j] == pytest.approx(float(row[ids[pos]]), abs=TOL)
        values, idx = row.topk(top_n)
        top = lp.top_logprobs[j]
        assert set(top) >= {tokenizer.decode([int(t)]) for t in idx} | {text}
        for t, v in zip(idx.tolist(), values.tolist()):
            assert top[tokenizer.decode([t])] == pytest.approx(v, abs=TOL)


def _run(http_stack, call):
    """``call()`` and the SequenceStates it made (their output_token_ids are the generated ids)."""
    with Recorder(http_stack.gateway.backend) as rec:
        result = call()
        if hasattr(result, "__next__"):
            result = list(result)
    return result, rec.seqs


def test_completion_logprobs_equal_the_target_forward(http_stack, client, model, tokenizer, reference):
    out, (seq,) = _run(http_stack, lambda: client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=N,
                                                                     temperature=0, logprobs=3))
    sd = check_usage(out.usage, completion_tokens=N)
    assert sd["num_accepted_tokens"] > 0, "no multi-token block: the k + 1 rows were not exercised"
    lp = out.choices[0].logprobs
    _check_completion_logprobs(lp, seq.prompt_token_ids, seq.output_token_ids, reference, tokenizer, 3)
    assert "".join(lp.tokens) == out.choices[0].text

    # streamed: the same entries, split over chunks, offsets running on
    chunks, _ = _run(http_stack, lambda: client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=N,
                                                                   temperature=0, logprobs=3, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(parts) > 1
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.text_offset for p in parts), []) == lp.text_offset
    assert sum((p.token_logprobs for p in parts), []) == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_sampled_logprobs_are_the_targets_raw_ones_not_the_drafts(http_stack, client, model, tokenizer, reference,
                                                                 good_draft_dir):
    """temperature and top_k change the sampling distribution, not the logprobs (raw, as vLLM's
    default); and the values are the target's: the draft's forward gives other numbers."""
    out, (seq,) = _run(http_stack, lambda: client.completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=N, temperature=0.7, seed=3, logprobs=2, extra_body={"top_k": 50}))
    lp = out.choices[0].logprobs
    _check_completion_logprobs(lp, seq.prompt_token_ids, seq.output_token_ids, reference, tokenizer, 2)
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(good_draft_dir, torch_dtype=torch.float32)
    ids = seq.prompt_token_ids + seq.output_token_ids
    with torch.inference_mode():
        draft_lp = torch.log_softmax(draft(torch.tensor([ids])).logits[0].float(), -1)
    n = len(seq.prompt_token_ids)
    draft_values = [float(draft_lp[n - 1 + j, t]) for j, t in enumerate(seq.output_token_ids)]
    assert max(abs(a - b) for a, b in zip(draft_values, lp.token_logprobs)) > 10 * TOL


def test_echo_scores_the_prompt(http_stack, client, model, tokenizer, reference):
    """echo + logprobs + max_tokens=0: the prompt's text and logprobs, the first token null (how
    evaluation harnesses compute log-likelihoods); max_tokens=1 adds the one generated token."""
    prompt_ids = tokenizer(PROMPTS[1]).input_ids
    out = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == tokenizer.decode(prompt_ids)
    assert choice.logprobs.token_logprobs[0] is None
    _check_completion_logprobs(choice.logprobs, prompt_ids, [], reference, tokenizer, 1, echo=True)

    out, (seq,) = _run(http_stack, lambda: client.completions.create(model=model, prompt=prompt_ids, max_tokens=1,
                                                                     echo=True, logprobs=2, temperature=0))
    _check_completion_logprobs(out.choices[0].logprobs, prompt_ids, seq.output_token_ids, reference, tokenizer, 2,
                               echo=True)

    chunks = list(client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=1,
                                            stream=True))
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in parts) == choice.text
    streamed = sum((p.logprobs.token_logprobs for p in parts if p.logprobs), [])
    assert streamed[0] is None and streamed[1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-6)
    assert sum((p.logprobs.tokens for p in parts if p.logprobs), []) == choice.logprobs.tokens


def test_prompt_logprobs_extension(client, model, tokenizer, reference):
    prompt_ids = tokenizer(PROMPTS[0]).input_ids
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(prompt_ids) and plp[0] is None
    table = reference(prompt_ids)
    for pos in range(1, len(prompt_ids)):
        entry = plp[pos][str(prompt_ids[pos])]
        assert entry["logprob"] == pytest.approx(float(table[pos - 1, prompt_ids[pos]]), abs=TOL)
        assert entry["decoded_token"] == tokenizer.decode([prompt_ids[pos]])
        top_ids = table[pos - 1].topk(2).indices.tolist()
        assert {str(t) for t in top_ids} <= set(plp[pos])
        assert plp[pos][str(top_ids[0])]["rank"] == 1


def test_chat_logprobs_and_top_logprobs(http_stack, client, model, tokenizer, reference):
    messages = [{"role": "user", "content": "Name a colour."}]
    out, (seq,) = _run(http_stack, lambda: client.chat.completions.create(
        model=model, messages=messages, max_tokens=N, temperature=0, logprobs=True, top_logprobs=2))
    content = out.choices[0].logprobs.content
    assert len(content) == len(seq.output_token_ids) == N
    table = reference(seq.prompt_token_ids + seq.output_token_ids)
    n = len(seq.prompt_token_ids)
    for j, (item, t) in enumerate(zip(content, seq.output_token_ids)):
        assert item.token == tokenizer.decode([t])
        assert item.bytes == list(item.token.encode())
        assert item.logprob == pytest.approx(float(table[n - 1 + j, t]), abs=TOL)
        values, idx = table[n - 1 + j].topk(2)
        assert [x.token for x in item.top_logprobs] == [tokenizer.decode([i]) for i in idx.tolist()]
        assert [x.logprob for x in item.top_logprobs] == pytest.approx(values.tolist(), abs=TOL)

    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=N, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.token for x in streamed] == [x.token for x in content]
    assert [x.logprob for x in streamed] == pytest.approx([x.logprob for x in content], abs=1e-6)

    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None  # only when asked

    # vLLM's prompt_logprobs, once per response (streamed: with the first chunk after the prompt was scored)
    scored = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                            extra_body={"prompt_logprobs": 0})
    plp = scored.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == n
    assert [list(p)[0] for p in plp[1:]] == [str(t) for t in seq.prompt_token_ids[1:]]
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                                 stream=True, extra_body={"prompt_logprobs": 0}))
    carried = [c.model_extra["prompt_logprobs"] for c in chunks if (c.model_extra or {}).get("prompt_logprobs")]
    assert carried == [plp]


def test_grpc_generate_returns_logprobs(http_stack, tokenizer, reference):
    channel = grpc.insecure_channel(f"{HOST}:{http_stack.gateway.port}")
    stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
    prompt_ids = tokenizer(PROMPTS[0]).input_ids
    request = gen_pb.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=N, logprobs=2, prompt_logprobs=1,
                                     sampling_params=common_pb2.SamplingParams(temperature=0))
    responses = list(stub.Generate(request, timeout=30, metadata=[("authorization", f"Bearer {KEY}")]))
    channel.close()
    ids = [t for r in responses for t in r.token_ids]
    lps = [lp for r in responses for lp in r.logprobs]
    assert len(lps) == len(ids) == N and [lp.token_id for lp in lps] == ids
    assert len(responses[0].prompt_logprobs) == len(prompt_ids) - 1
    assert all(not r.prompt_logprobs for r in responses[1:])
    table = reference(prompt_ids + ids)
    n = len(prompt_ids)
    for j, lp in enumerate(lps):
        assert lp.logprob == pytest.approx(float(table[n - 1 + j, ids[j]]), abs=TOL)
        assert list(lp.top_token_ids) == table[n - 1 + j].topk(2).indices.tolist()
    for pos, lp in enumerate(responses[0].prompt_logprobs, start=1):
        assert lp.token_id == prompt_ids[pos]
        assert lp.logprob == pytest.approx(float(table[pos - 1, prompt_ids[pos]]), abs=TOL)


def test_logprobs_cost_nothing_unless_asked(client, model, monkeypatch):
    """The target computes logprobs only for requests that ask (the field is unset on the wire otherwise)."""
    import specdec.engine.workers

    calls = []
    real = specdec.engine.workers.token_logprobs
    monkeypatch.setattr(specdec.engine.workers, "token_logprobs", lambda *a: calls.append(a[1]) or real(*a))
    client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6)
    assert not calls
    client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=1)
    assert sum(len(ids) for ids in calls) == 6
