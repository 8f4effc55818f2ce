"""The answers of `/v1/classify` (vLLM's: the best label, every score in label order) and `/predict` (TEI's:
`{score, label}` highest first, the logits with raw_scores, a list per input for a batch), from the classifier's
outputs (every class's `{label, score, logit}` in label order); an output of another shape is the model's 500."""

from __future__ import annotations

import orjson
import pytest

from batchserve.classify.render import answer, answer_predict
from batchserve.errors import ApiError


def row(*triples: tuple[str, float, float]) -> list[dict]:
    return [{"label": label, "score": score, "logit": logit} for label, score, logit in triples]


A = row(("neg", 0.2, -1.0), ("neu", 0.5, 0.3), ("pos", 0.3, 2.0))
B = row(("neg", 0.7, 1.0), ("neu", 0.1, -2.0), ("pos", 0.2, 0.0))


def test_classify_answers_in_vllms_shape() -> None:
    body = orjson.loads(answer([A, B], "clf@v1", 12))
    assert body["object"] == "list" and body["model"] == "clf@v1" and body["id"].startswith("classify-")
    assert body["data"] == [
        {"index": 0, "label": "neu", "probs": [0.2, 0.5, 0.3], "num_classes": 3},
        {"index": 1, "label": "neg", "probs": [0.7, 0.1, 0.2], "num_classes": 3},
    ]
    assert body["usage"] == {"prompt_tokens": 12, "total_tokens": 12, "completion_tokens": 0}


def test_predict_sorts_by_score_and_raw_scores_by_logit() -> None:
    assert orjson.loads(answer_predict([A], False, False)) == [
        {"score": 0.5, "label": "neu"},
        {"score": 0.3, "label": "pos"},
        {"score": 0.2, "label": "neg"},
    ]
    assert [p["label"] for p in orjson.loads(answer_predict([A], True, False))] == ["pos", "neu", "neg"]
    assert orjson.loads(answer_predict([A], True, False))[0]["score"] == 2.0
    batch = orjson.loads(answer_predict([A, B], False, True))
    assert [[p["label"] for p in one] for one in batch] == [["neu", "pos", "neg"], ["neg", "pos", "neu"]]


def test_equal_scores_keep_label_order() -> None:
    tied = row(("a", 0.5, 0.0), ("b", 0.5, 0.0))
    assert [p["label"] for p in orjson.loads(answer_predict([tied], False, False))] == ["a", "b"]
    assert orjson.loads(answer([tied], "m", 0))["data"][0]["label"] == "a"


@pytest.mark.parametrize(
    "output",
    [0.5, [], [0.1, 0.2], [{"label": "a", "score": 0.5}], row(("a", float("nan"), 0.0)), row(("a", True, 0.0))],
)
def test_an_output_that_is_not_classes_is_the_models_500(output: object) -> None:
    for render in (lambda: answer([output], "m", 0), lambda: answer_predict([output], False, False)):
        with pytest.raises(ApiError) as caught:
            render()
        assert caught.value.status == 500 and "output 0" in caught.value.message
