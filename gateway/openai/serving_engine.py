"""What both endpoints share (vLLM's ``OpenAIServing``): the request checks, and one sequence per output."""

from __future__ import annotations

from gateway.generation import Gateway
from gateway.limits import check_request_limits
from gateway.openai.protocol import OpenAIRequest
from specdec.errors import InvalidRequestError, ModelNotFoundError
from specdec.sampling_params import SamplingParams
from specdec.seeding import output_seed
from specdec.sequence import SequenceState


# Parameters OpenAI or vLLM define that this server does not implement: set to anything but their
# "off" value, they are a 400 naming them (rather than silently ignored). Unknown names are ignored.
UNSUPPORTED = {
    "suffix": (None, ""), "audio": (None,), "prediction": (None,), "modalities": (None, ["text"]),
    "use_beam_search": (None, False), "logits_processors": (None,), "bad_words": (None, []),
    "truncate_prompt_tokens": (None,), "web_search_options": (None,), "guided_decoding_backend": (None, "xgrammar"),
}


class OpenAIServing:
    def __init__(self, gateway: Gateway, model_name: str, request_timeout: float | None = None):
        self.gateway = gateway
        self.model_name = model_name  # the name served (and checked against the request's ``model``)
        self.request_timeout = request_timeout

    def check_request(self, body: OpenAIRequest) -> None:
        """Refuse, before any generation starts, what this server does not serve or support."""
        if body.model is not None and body.model != self.model_name:
            raise ModelNotFoundError(f"the model {body.model!r} does not exist; this server serves {self.model_name!r}")
        body.token_logit_bias()  # keys that are not token ids: a 400 before any generation (the vocabulary: new_sequence)
        for name, off in UNSUPPORTED.items():
            if (body.model_extra or {}).get(name) not in off:
                raise InvalidRequestError(f"{name} is not supported by this server; leave it unset", param=name)
        self.gateway.resolve_k(body.num_speculative_tokens)  # a bad k is a 400 before any stream starts
        check_request_limits(n=body.n, max_n=self.gateway.config.max_n, stop=body.stop,
                             stop_token_ids=body.stop_token_ids, logit_bias=body.logit_bias)  # the one table
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequestError("best_of is not supported (only best_of equal to n, or unset)", param="best_of")
        if getattr(body, "top_logprobs", None) is not None and getattr(body, "logprobs", None) is False:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")

    def new_sequence(self, ids: list[int], params: SamplingParams, index: int, priority: int = 0) -> SequenceState:
        """Output ``index`` of a request; with n > 1 and a seed, each output gets its own seed."""
        if params.seed is not None and index:
            params = params.clone(seed=output_seed(params.seed, index))  # n > 1: distinct, reproducible samples
        seq = self.gateway.new_sequence(ids, params, priority=priority)
        seq.output_index = index
        return seq
