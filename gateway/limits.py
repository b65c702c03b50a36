"""The one table of request limits, checked the same way for HTTP (/v1/*) and gRPC (Generate).

| limit                         | value                          | param            |
|-------------------------------|--------------------------------|------------------|
| outputs per request           | ``--max-n`` (gRPC: always 1)   | n                |
| stop strings                  | ``MAX_STOP_SEQUENCES``         | stop             |
| characters of a stop string   | ``MAX_STOP_LENGTH``            | stop             |
| stop token ids                | ``MAX_STOP_TOKEN_IDS``         | stop_token_ids   |
| logit_bias entries            | ``MAX_LOGIT_BIAS``             | logit_bias       |
| request size                  | ``--max-request-body-bytes``   | (HTTP 413; gRPC RESOURCE_EXHAUSTED) |
| prompt + max_tokens           | max_model_len, the KV cache    | prompt, max_tokens (``Gateway.new_sequence``) |

A request past a limit is an ``InvalidRequestError`` naming the param (HTTP 400, gRPC INVALID_ARGUMENT),
refused before its prompt is tokenized.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from specdec.errors import InvalidRequestError

MAX_STOP_SEQUENCES = 16  # OpenAI allows 4; vLLM sets no limit
MAX_STOP_LENGTH = 1024  # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries (each one is applied to every position the target scores)


def check_request_limits(*, n: int = 1, max_n: int, stop: str | Sequence[str] | None = None,
                         stop_token_ids: Collection[int] | None = None, logit_bias: Collection | None = None) -> None:
    """Refuse (400 / INVALID_ARGUMENT, naming the param) a request past one of the table's limits."""
    if n > max_n:
        raise InvalidRequestError(f"n={n} is above this server's limit of {max_n} outputs per request (--max-n)",
                                  param="n")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise InvalidRequestError(f"stop takes at most {MAX_STOP_SEQUENCES} strings of at most {MAX_STOP_LENGTH} "
                                  f"characters each, got {len(stops)} (longest {max(map(len, stops))})", param="stop")
    if stop_token_ids is not None and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} token ids, got "
                                  f"{len(stop_token_ids)}", param="stop_token_ids")
    if logit_bias is not None and len(logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(logit_bias)}",
                                  param="logit_bias")
