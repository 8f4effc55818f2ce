"""The declared shapes of `POST /v1/classify` (vLLM's and SGLang's OpenAI-like shape: `{model, input}` ->
`{object: "list", data: [{index, label, probs, num_classes}], usage}`) and `POST /predict` (Hugging Face TEI's:
`{inputs, raw_scores, truncate}` -> predictions sorted by score, or a list of them per input of a batch): the
requests `parse.py` decodes, the answers `render.py` writes, and the operations in /openapi.json. Errors in
OpenAI's shape on both."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from batchserve.http.openapi import DocAnswer, model_post, versioned_posts
from batchserve.http.shapes import OPENAI, NonNegative, Priority, Text, Timeout

MAX_INPUTS = 2048  # inputs per request, as /v1/embeddings

Model = Annotated[
    Text | None, Meta(description="a classification model (GET /v1/models); default: the first such model")
]


class ClassifyRequest(Struct):
    """What `POST /v1/classify` takes; members it does not know are ignored."""

    input: Annotated[
        Text | Annotated[list[Text], Meta(min_length=1, max_length=MAX_INPUTS)],
        Meta(description="text, or a list of texts; each is one item on the batcher"),
    ]
    model: Model = None
    user: Annotated[str | None, Meta(description="accepted and ignored")] = None
    timeout_ms: Timeout | UnsetType = UNSET
    service_tier: Priority | None = None


class ClassificationData(Struct):
    index: Annotated[NonNegative, Meta(description="the input's place in the request")]
    label: Annotated[str, Meta(description="the class with the highest score")]
    probs: Annotated[
        list[float],
        Meta(
            description="every class's score in the model's label order (id2label): softmax of the logits, or "
            "sigmoid for a multi-label model, as transformers' text-classification pipeline gives them"
        ),
    ]
    num_classes: NonNegative


class ClassifyUsage(Struct):
    prompt_tokens: NonNegative
    total_tokens: NonNegative
    completion_tokens: NonNegative


class ClassifyResponse(Struct):
    id: str
    object: Literal["list"]
    created: Annotated[int, Meta(description="Unix seconds")]
    model: Annotated[str, Meta(description="name@version that served it")]
    data: Annotated[list[ClassificationData], Meta(description="one per input, in input order")]
    usage: ClassifyUsage


Sequence = Annotated[
    list[Text], Meta(min_length=1, max_length=2, description="one text [text], or a pair [text, text_pair]")
]


class PredictRequest(Struct):
    """What `POST /predict` takes (TEI's); members it does not know are ignored."""

    inputs: Annotated[
        Text | Annotated[list[Text | Sequence], Meta(min_length=1, max_length=MAX_INPUTS)],
        Meta(
            description="a text; a list of one or two strings: one text or a pair [text, text_pair]; or a batch, "
            "a list of such lists (answered with one list of predictions each). Each is one item on the batcher"
        ),
    ]
    raw_scores: Annotated[bool, Meta(description="the logits, not their softmax or sigmoid")] = False
    truncate: Annotated[
        bool, Meta(description="accepted: an input is always cut at the model's own sequence length")
    ] = False
    model: Model = None
    timeout_ms: Timeout | UnsetType = UNSET
    service_tier: Priority | None = None


class Prediction(Struct):
    score: float
    label: str


OPERATIONS = (
    *versioned_posts(
        "/v1/classify",
        "classify",
        "Classify texts (vLLM's shape): every class's score per input; each input rides the batcher on its own",
        DocAnswer(200, "one result per input, in input order", ClassifyResponse),
        OPENAI,
        Annotated[ClassifyRequest, Meta(examples=[{"input": ["a great film", "a dull film"]}])],
    ),
    model_post(
        "/predict",
        "predict",
        "Classify a text, a pair or a batch of them (Hugging Face TEI's shape); each rides the batcher on its own",
        DocAnswer(
            200,
            "every class's prediction, highest score first; for a batch (a list of lists), one such list per "
            "input, in input order",
            list[Prediction | list[Prediction]],
        ),
        OPENAI,
        Annotated[PredictRequest, Meta(examples=[{"inputs": "a great film"}])],
    ),
)
