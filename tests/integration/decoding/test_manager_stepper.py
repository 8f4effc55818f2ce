"""transformers' manager behind the Stepper interface (`--generation-engine manager`): the same greedy tokens
as `generate`, as new-token updates on the event loop, and cancel. A 2-layer Llama with random weights."""

from __future__ import annotations

from typing import Any

from batchserve.decoding.build import EngineConfig, build_stepper
from batchserve.decoding.manager_stepper import ManagerStepper
from batchserve.decoding.stepper import SamplingParams, TokenUpdate
from tests.integration.decoding.test_slot_decoder import run_updates
from tests.integration.backends.test_static_decode import PAD, prompts, reference


class FakeTokenizer:
    """What build_stepper and the manager's warm-up ask of a tokenizer; its eos is past the vocabulary, so
    rows end at max_tokens."""

    pad_token_id = PAD

    def __init__(self, vocab: int) -> None:
        self.eos_token_id = vocab + 7

    def __call__(self, text: str, **kwargs: Any) -> dict[str, list[int]]:
        return {"input_ids": [5, 6, 7]}


def test_manager_stepper_gives_generates_tokens_as_updates_and_cancels(model: Any) -> None:
    batch = prompts(model, (5, 9, 3), seed=6)
    cfg = EngineConfig(stepper="manager", max_tokens=16, max_seqs=4, kv_tokens=1024, page_size=16)
    stepper = build_stepper(model, FakeTokenizer(model.config.vocab_size), cfg)
    assert isinstance(stepper, ManagerStepper) and stepper.capacity.max_sequence_tokens == 1024

    def cancel_c(u: TokenUpdate, seen: dict[str, list[TokenUpdate]], waiting_for: set[str]) -> None:
        if u.seq_id == "c" and sum(len(x.tokens) for x in seen["c"]) >= 2 and not u.finished:
            stepper.cancel("c")

    adds = [
        (name, p, SamplingParams(max_tokens=8 if name != "c" else 16, temperature=0)) for name, p in zip("abc", batch)
    ]
    seen = run_updates(stepper, adds, {"a", "b"}, react=cancel_c)
    for name, p in zip("ab", batch):
        assert [t for u in seen[name] for t in u.tokens] == reference(model, [p], None, 8)[0]
    assert not any(u.finished for u in seen.get("c", []))  # dropped, never finished
    assert not stepper.is_running()
