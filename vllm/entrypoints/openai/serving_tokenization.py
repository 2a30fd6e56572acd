"""``POST /tokenize`` and ``POST /detokenize``, as vLLM's.

``/tokenize`` takes either ``prompt`` (text, special tokens added as the
tokenizer does unless ``add_special_tokens`` is false) or ``messages``
(rendered with the chat template, as a chat request would be) and returns
the ids with ``max_model_len``; ``/detokenize`` turns ids back into text.
"""

from __future__ import annotations

from vllm.entrypoints.openai.errors import OpenAIError
from vllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from vllm.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.models.check(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("prompt: give either prompt or messages", param="prompt")
        if request.messages is not None:
            ids = self.chat_prompt_ids(request.messages, request)
        else:
            assert request.prompt is not None
            ids = self.text_prompt_ids(request.prompt, request.add_special_tokens)
        return TokenizeResponse(
            count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.models.check(request.model)
        tokenizer = self.require_tokenizer("tokens")
        vocab = len(tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(
                f"tokens: ids must be in [0, {vocab}), got {bad[:5]}", param="tokens"
            )
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))
