"""What the endpoints share: the streams' chunk events."""

import json

from vllm.entrypoints.openai.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    DeltaMessage,
)
from vllm.entrypoints.openai.serving_engine import ChunkEvents, sse


def test_chunk_events_are_the_bytes_of_a_dumped_copy():
    completion = CompletionResponse(id="cmpl-1", created=7, model="m", choices=[])
    chat = ChatCompletionStreamResponse(id="chat-1", created=7, model="m", choices=[])
    logprobs = CompletionLogProbs(
        text_offset=[0], token_logprobs=[-0.5], tokens=['"a\\'], top_logprobs=[{}]
    )
    cases = [
        (completion, CompletionResponseChoice(index=3, text='é "q"\n', logprobs=None)),
        (
            completion,
            CompletionResponseChoice(
                index=0, text="x", logprobs=logprobs, finish_reason="stop"
            ),
        ),
        (
            chat,
            ChatCompletionResponseStreamChoice(
                index=1, delta=DeltaMessage(content="}]"), finish_reason="length"
            ),
        ),
    ]
    for response, choice in cases:
        event = ChunkEvents(response).event(choice)
        assert event == sse(response.model_copy(update={"choices": [choice]}))
        payload = json.loads(event.removeprefix("data: "))
        assert payload["choices"] == [json.loads(choice.model_dump_json())]
