"""Penalties and logprobs on the wire: SamplingParams ↔ protobuf, TokenLogprob rows, and the services
refusing history-dependent penalties without knowing where the prompt ends."""

from __future__ import annotations

import pytest

from specdec.errors import InvalidRequestError
from specdec.proposal import TokenLogprob
from specdec.sampling import SamplingParams, penalty_context
from specdec.serving.wire import logprobs_from_proto, logprobs_to_proto, sampling_from_proto, sampling_to_proto


def test_penalties_round_trip():
    params = SamplingParams(temperature=0.5, presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.25,
                            logit_bias={3: -100.0, 7: 2.5}, min_tokens=3, stop_token_ids=[9], num_prompt_tokens=4)
    back = sampling_from_proto(sampling_to_proto(params))
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                 "stop_token_ids", "num_prompt_tokens"):
        assert getattr(back, name) == getattr(params, name), name
    assert back.max_tokens is None  # the services never count max_tokens


def test_no_penalties_leave_the_message_unset():
    msg = sampling_to_proto(SamplingParams(temperature=0.7, stop_token_ids=[5]))
    assert not msg.HasField("penalties")
    assert not sampling_from_proto(msg).has_penalties


def test_history_penalties_need_num_prompt_tokens():
    msg = sampling_to_proto(SamplingParams(frequency_penalty=0.5))  # num_prompt_tokens unset
    params = sampling_from_proto(msg)
    assert params.num_prompt_tokens is None
    with pytest.raises(InvalidRequestError) as info:
        penalty_context(params, [1, 2, 3], {0})
    assert info.value.param == "num_prompt_tokens"
    # a bias alone reads no history
    assert penalty_context(SamplingParams(logit_bias={1: 1.0}), [1, 2], {0}) is not None


def test_logprob_rows_round_trip():
    rows = [TokenLogprob(5, -0.25, [(5, -0.25), (9, -1.5)]), TokenLogprob(7, -3.0, [])]
    assert logprobs_from_proto(logprobs_to_proto(rows)) == rows
