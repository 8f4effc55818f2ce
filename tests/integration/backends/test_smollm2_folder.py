"""`--backend smollm2` is its package's folder served as any causal LM folder (issue 36, item 3): the folder
(`--smollm2-dir` here; by default the GGUF converted once into the weights cache, tests/integration/backends/
test_weights_cache.py) goes through the `hf` backend's generation path, checked as a `--model` folder is, and the
generation engine loads the same folder. Small folders the test builds (random weights), no SmolLM2 weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from batchserve.backends.hf import generation_folder
from batchserve.backends.smollm2 import SmolLM2Backend
from batchserve.config import ModelSpec, Settings
from tests.hf_folders import causal_lm


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return causal_lm(tmp_path_factory.mktemp("smollm2-folder"))


def test_the_package_folder_loads_through_the_folder_path(tiny_lm: Path) -> None:
    settings = Settings(backend="smollm2", smollm2_dir=str(tiny_lm), max_new_tokens=4, devices=1)
    backend = SmolLM2Backend.from_settings(ModelSpec("smollm2", backend="smollm2"), settings)
    model = backend.models[0]
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 32  # the folder's weights
    assert backend.decoders  # the static batch path, as for any causal LM folder
    device = backend.devices[0]
    assert backend.batch(["hi"], device) == backend.run_generate(device, ["hi"])
    assert generation_folder(settings) == str(tiny_lm)  # the generation engine loads the same folder


def test_a_package_folder_the_slot_stepper_cannot_run_stops_the_start_in_one_line(
    tmp_path: Path, tiny_lm: Path
) -> None:
    """Checked as a `--model` folder is: before, any folder was loaded (a GPT-2 here) and failed later, or not."""
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    shutil.copyfile(tiny_lm / "tokenizer.json", gpt2 / "tokenizer.json")
    settings = Settings(backend="smollm2", smollm2_dir=str(gpt2))
    for load in (
        lambda: SmolLM2Backend.from_settings(ModelSpec("smollm2", backend="smollm2"), settings),
        lambda: SmolLM2Backend.shell(settings),
    ):
        with pytest.raises(RuntimeError) as err:
            load()
        message = str(err.value)
        assert message.startswith("smollm2: ") and "\n" not in message
        assert "GPT2LMHeadModel" in message and "slot stepper" in message
