"""GET /v1/models' card for the generation engine names the backend of the model it serves: smollm2's weights,
or a causal LM folder (`--model`, backend hf), not smollm2 whatever was loaded."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from batchserve.config import ModelSpec, Settings
from batchserve.decoding.build import EngineConfig
from batchserve.generation.routes import model_cards


@dataclass
class Served:
    """The engine as `model_cards` reads it: its config."""

    cfg: EngineConfig


@pytest.mark.parametrize(
    "models,backend",
    [
        ([ModelSpec("smollm2", backend="smollm2")], "smollm2-continuous-batching"),
        ([ModelSpec("tiny-llama", backend="hf", path="/m", task="generation")], "hf-continuous-batching"),
        (
            [
                ModelSpec("emb", backend="hf", path="/e", task="embeddings"),
                ModelSpec("lm", backend="hf", task="generation"),
            ],
            "hf-continuous-batching",
        ),
        ([ModelSpec("sim")], "smollm2-continuous-batching"),  # --generation on beside sim: smollm2's weights
    ],
)
def test_the_card_names_the_served_models_backend(models: list[ModelSpec], backend: str) -> None:
    cfg = EngineConfig.from_settings(Settings(models=models))
    (card,) = model_cards(Served(cfg))  # type: ignore[arg-type]
    assert card["backend"] == backend


def test_no_engine_no_card() -> None:
    assert model_cards(None) == []
