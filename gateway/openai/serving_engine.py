"""What both endpoints share (vLLM's ``OpenAIServing``): the request checks, and one sequence per output."""

from __future__ import annotations

from gateway.generation import Gateway
from gateway.openai.protocol import OpenAIRequest
from specdec.errors import InvalidRequestError, ModelNotFoundError
from specdec.sampling import SamplingParams
from specdec.seeding import output_seed
from specdec.sequence import SequenceState


class OpenAIServing:
    def __init__(self, gateway: Gateway, model_name: str, request_timeout: float | None = None):
        self.gateway = gateway
        self.model_name = model_name  # the name served (and checked against the request's ``model``)
        self.request_timeout = request_timeout

    def check_request(self, body: OpenAIRequest) -> None:
        """Refuse, before any generation starts, what this server does not serve or support."""
        if body.model is not None and body.model != self.model_name:
            raise ModelNotFoundError(f"the model {body.model!r} does not exist; this server serves {self.model_name!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                raise InvalidRequestError(f"{name} is not supported (only 0)", param=name)
        self.gateway.resolve_k(body.num_speculative_tokens)  # a bad k is a 400 before any stream starts
        if body.logprobs not in (None, False, 0):
            raise InvalidRequestError("logprobs are not supported", param="logprobs")

    def new_sequence(self, ids: list[int], params: SamplingParams, index: int) -> SequenceState:
        """Output ``index`` of a request; with n > 1 and a seed, each output gets its own seed."""
        if params.seed is not None and index:
            params = params.clone(seed=output_seed(params.seed, index))  # n > 1: distinct, reproducible samples
        seq = self.gateway.new_sequence(ids, params)
        seq.output_index = index
        return seq
