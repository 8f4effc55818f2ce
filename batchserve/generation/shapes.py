"""The declared shapes of the generation routes (OpenAI's chat and text completions, `generation/routes.py`):
the requests `parse.parse` takes, the answers `render.DocAnswer` renders, and their operations in /openapi.json. Errors
in OpenAI's shape, `{"error": {message, type, param, code}}`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from batchserve.http.openapi import DocAnswer, Operation, model_post
from batchserve.http.shapes import NATIVE, OPENAI, NonNegative, Priority

NonEmpty = Annotated[str, Meta(min_length=1)]


class StreamOptions(Struct):
    include_usage: bool = False


class ResponseFormat(Struct):
    type: Annotated[str, Meta(description="only `text` is supported")]


Unsupported = Annotated[Any, Meta(description="not supported: 400 unsupported_parameter unless empty")]


class _Sampling(Struct):
    """What both completions take; members they do not know are ignored. Members OpenAI defines that this server
    does not do are declared too, so that a request using them is refused (400 unsupported_parameter) rather
    than answered as if they had been heard."""

    model: Annotated[
        NonEmpty | None,
        Meta(description="the generation model id (GET /v1/models); default: the one served here"),
    ] = None
    max_tokens: (
        Annotated[
            int,
            Meta(ge=1, description="capped at --generation-max-tokens (default 512), which is also the default"),
        ]
        | None
    ) = None
    temperature: Annotated[float, Meta(ge=0, le=2, description="0 = greedy; default: the model's own")] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1, description="default: the model's own")] | None = None
    stop: NonEmpty | Annotated[list[NonEmpty], Meta(max_length=4)] | None = None
    seed: Annotated[int, Meta(description="same seed, same prompt and parameters: same tokens")] | None = None
    stream: Annotated[bool, Meta(description="server-sent events ending in `data: [DONE]`")] = False
    stream_options: Annotated[StreamOptions, Meta(description="only with stream: true")] | None = None
    ignore_eos: Annotated[bool, Meta(description="extension: generate max_tokens exactly")] = False
    n: Annotated[int, Meta(description="only 1 is supported")] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2, description="only 0 is supported")] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2, description="only 0 is supported")] | None = None
    logprobs: Annotated[bool | int | None, Meta(description="not supported (false or absent only)")] = None
    top_logprobs: Annotated[int | None, Meta(description="not supported")] = None
    logit_bias: Annotated[dict[str, float] | None, Meta(description="not supported (empty or absent only)")] = None
    service_tier: Priority | None = None


class ContentPart(Struct):
    type: Literal["text"]
    text: str


class Message(Struct):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str | list[ContentPart], Meta(description="text, or a list of text parts")]


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1)]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    response_format: ResponseFormat | None = None
    tools: Unsupported = None
    functions: Unsupported = None
    tool_choice: Unsupported = None
    function_call: Unsupported = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Annotated[
        NonEmpty | Annotated[list[NonNegative | NonEmpty | list[NonNegative]], Meta(min_length=1)],
        Meta(description="text, or token ids; or a list of one of either (a batch of one: one prompt per request)"),
    ]
    echo: Annotated[bool | None, Meta(description="not supported (false or absent only)")] = None
    suffix: Annotated[str | None, Meta(description="not supported (empty or absent only)")] = None
    best_of: Annotated[int | None, Meta(description="only 1 is supported")] = None


class Usage(Struct):
    prompt_tokens: NonNegative
    completion_tokens: NonNegative
    total_tokens: NonNegative


FinishReason = Literal["stop", "length", None]


class AssistantMessage(Struct):
    role: Literal["assistant"]
    content: str


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TextChoice(Struct):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: None = None


class Completion(Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class GenerationStatus(Struct):
    enabled: bool
    ready: bool
    running: int | UnsetType = UNSET
    waiting: int | UnsetType = UNSET
    kv_blocks: int | UnsetType = UNSET
    kv_blocks_reserved: int | UnsetType = UNSET
    step_ms: float | UnsetType = UNSET
    cancelled: int | UnsetType = UNSET


_STREAM = (("text/event-stream", Annotated[str, Meta(description="`data: <chunk JSON>` lines, then `[DONE]`")]),)


def _operation(path: str, op_id: str, summary: str, request: Any, answer: Any) -> Operation:
    streamed = DocAnswer(200, "the whole answer, or with stream: true, text/event-stream chunks", answer, also=_STREAM)
    return model_post(path, op_id, summary, streamed, OPENAI, request)


OPERATIONS = (
    _operation(
        "/v1/chat/completions",
        "createChatCompletion",
        "OpenAI-compatible chat completion, continuous batching",
        ChatCompletionRequest,
        ChatCompletion,
    ),
    _operation(
        "/v1/completions",
        "createCompletion",
        "OpenAI-compatible text completion, continuous batching",
        CompletionRequest,
        Completion,
    ),
    Operation(
        "GET",
        "/internal/generation",
        "generationStatus",
        "The generation engine: sequences, KV blocks, step time (with --metrics-key set, only with that key)",
        (DocAnswer(200, "engine state", GenerationStatus, headers=()),),
        NATIVE,
        errors=(401,),
        public=True,
    ),
)
