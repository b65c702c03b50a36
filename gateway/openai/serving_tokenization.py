"""POST /tokenize and /detokenize (vLLM's ``OpenAIServingTokenization``): the served target tokenizer,
with vLLM's request and response shapes."""

from __future__ import annotations

from typing import Any


from gateway.openai.protocol import ChatMessage, RequestBody
from gateway.openai.serving_chat import OpenAIServingChat
from specdec.errors import InvalidRequestError, ModelNotFoundError


class TokenizeRequest(RequestBody):
    """A ``prompt`` (completion form) or ``messages`` (chat form, through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class OpenAIServingTokenization(OpenAIServingChat):  # the chat template as /v1/chat/completions applies it
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(f"the model {model!r} does not exist; this server serves {self.model_name!r}")

    def tokenize(self, body: TokenizeRequest) -> dict:
        """``{"count", "max_model_len", "tokens", "token_strs"}``."""
        self._check_model(body.model)
        tokenizer = self.gateway.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give either prompt or messages", param="prompt")
        if body.messages is not None:
            try:
                messages = [ChatMessage(**m) for m in body.messages]
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(f"messages: {exc}", param="messages") from None
            ids = self.chat_prompt(messages, add_generation_prompt=body.add_generation_prompt)
            if body.add_special_tokens:
                ids = list(tokenizer.build_inputs_with_special_tokens(ids))
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = list(tokenizer(body.prompt, add_special_tokens=add).input_ids)
        return {"count": len(ids), "max_model_len": self.gateway.max_model_len, "tokens": ids,
                "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        """``{"prompt": text}``."""
        self._check_model(body.model)
        vocab = self.gateway.target_info.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": self.gateway.tokenizer.decode(body.tokens)}
