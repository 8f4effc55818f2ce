"""The static-KV batch decoder (issue 13): the same greedy tokens as `generate`, the fixed-shape (GPU) layout
checked on the CPU, early stops, and no CUDA capture without CUDA.

The fast tests use a 2-layer Llama with random weights; the slow one SmolLM2's real weights through the backend.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

PAD = 0
NEW = 12


@pytest.fixture(scope="module")
def model() -> Any:
    import torch

    from bench.cb_compare import TINY_VOCAB, random_model

    # 4,096 tokens, not SmolLM2's 49,152: the same decode paths, and the vocabulary's logits, argmax and sort were
    # most of this model's step (these tests, test_slot_decoder's and test_manager_stepper's took 1.5x as long)
    m = random_model("cpu", torch.float32, tiny=True, vocab=TINY_VOCAB)
    m.generation_config.eos_token_id = None  # the reference ends rows only at the eos a test names
    for p in m.parameters():  # spread the logits so greedy picks are far from ties
        p.data.normal_(0, 0.5)
    return m


def prompts(model: Any, lengths: tuple[int, ...] = (5, 9, 3, 12, 1), seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in lengths]


def reference(model: Any, batch: list[list[int]], eos: int | None, new: int = NEW) -> list[list[int]]:
    """transformers' generate on the left-padded batch, each row cut after its first eos (None: no eos)."""
    import torch

    width = max(map(len, batch))
    ids = torch.full((len(batch), width), PAD)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=PAD, eos_token_id=eos
        )
    rows = out[:, width:].tolist()
    return [r[: r.index(eos) + 1] if eos in r else r for r in rows]


def an_eos(model: Any, batch: list[list[int]]) -> int:
    """A token that some rows produce mid-way, so that rows end at different steps."""
    free = reference(model, batch, eos=None)
    return free[0][NEW // 3]


class Counting:
    """Counts the model's forward calls (prefill + one per decode step)."""

    def __init__(self, model: Any) -> None:
        self.model, self.calls = model, 0
        self.forward = model.forward

    def __enter__(self) -> Counting:
        def counted(*a: Any, **kw: Any) -> Any:
            self.calls += 1
            return self.forward(*a, **kw)

        self.model.forward = counted
        return self

    def __exit__(self, *exc: object) -> None:
        self.model.forward = self.forward


def test_greedy_tokens_are_generates_for_mixed_lengths_and_early_ends(model: Any) -> None:
    from batchserve.backends.static_decode import StaticDecoder

    batch = prompts(model)
    eos = an_eos(model, batch)
    want = reference(model, batch, eos)
    assert any(len(r) < NEW for r in want) and any(len(r) == NEW for r in want)  # some rows end early
    got = StaticDecoder(model, NEW, [eos], PAD).generate(batch)
    assert got == want


def test_fixed_shapes_pad_rows_and_cache_and_split_batches_without_changing_a_token(model: Any) -> None:
    """The GPU layout, run eagerly: batches padded to a bucket with finished filler rows, caches sized by
    prompt bucket over one shared KV pool, a batch larger than its shape's bucket split in runs."""
    from batchserve.backends.static_decode import Shape, StaticDecoder

    batch = prompts(model)
    eos = an_eos(model, batch)
    exact = StaticDecoder(model, NEW, [eos], PAD).generate(batch)
    fixed = StaticDecoder(
        model, NEW, [eos], PAD, max_batch=8, fixed_shapes=True, prompt_buckets=(8, 16), kv_tokens=8 * (8 + NEW)
    )  # 16-token prompts fit only a batch of 1
    fixed.warm()
    assert sorted(fixed.runners) == [Shape(1, 8 + NEW), Shape(1, 16 + NEW), Shape(8, 8 + NEW)]
    assert all(r.graph is None for r in fixed.runners.values())  # no CUDA here: nothing captured
    assert fixed.plan(5, 8 + NEW) == (8, True) and fixed.plan(5, 16 + NEW) == (1, True)
    assert fixed.generate(batch) == exact  # 12-token prompt: cache 16 + NEW, five runs of one row
    short = [p for p in batch if len(p) <= 8]
    assert fixed.generate(short) == [r for p, r in zip(batch, exact) if len(p) <= 8]  # one padded run of 8
    assert fixed.generate(batch[:1]) == exact[:1]


def test_the_loop_stops_once_every_row_has_ended(model: Any) -> None:
    from batchserve.backends.static_decode import StaticDecoder

    batch = prompts(model, (4, 4, 4))
    free = reference(model, batch, eos=None, new=40)
    # an eos every row reaches by step 5 at the latest: its token at step 4, if each row has a common one
    eos = free[0][4]
    ends = [r.index(eos) if eos in r[:5] else None for r in free]
    if None in ends:  # not every row has it: make the batch three copies of row 0
        batch, ends = [batch[0]] * 3, [4] * 3
    with Counting(model) as c:
        got = StaticDecoder(model, 40, [eos], PAD).generate(batch)
    assert all(len(r) == e + 1 and r[-1] == eos for r, e in zip(got, ends))
    assert c.calls == 1 + max(ends)  # the prefill, then one step per token up to the last row's eos, not 39


def test_a_lagged_check_costs_steps_only_when_the_last_row_ends_on_a_checks_step(model: Any) -> None:
    """On a GPU a check reads the flags copied before its own step (so the device never waits for the host):
    the same answers, the same stop, but for a batch whose last row ends on a check's very step, which stops
    one check later. Run on the CPU with the lag turned on, all that differs on a GPU but the copy's event."""
    from batchserve.backends.static_decode import StaticDecoder

    row = prompts(model, (4,))[0]
    free = reference(model, [row], eos=None, new=40)[0]
    firsts = [k for k in range(4, 30) if free[k] not in free[:k]]  # token k may be the row's eos
    on_a_check = next(k for k in firsts if (k + 1) % 4 == 0)  # the eos is made by a check's step
    between = next(k for k in firsts if (k + 1) % 4 != 0)
    for k, late in ((between, 0), (on_a_check, 4)):
        answers, calls = {}, {}
        for lagged in (False, True):
            dec = StaticDecoder(model, 40, [free[k]], PAD, max_batch=3, fixed_shapes=True, prompt_buckets=(16,))
            dec.warm()
            dec.check_every = 4
            for runner in dec.runners.values():
                runner.lagged = lagged
            with Counting(model) as c:
                answers[lagged] = dec.generate([row] * 3)
            calls[lagged] = c.calls  # the prefill (token 1) and a step per further token
        assert answers[True] == answers[False] == [free[: k + 1]] * 3
        assert calls[False] == -(-(k + 1) // 4) * 4, (k, calls)  # the first check after the eos
        assert calls[True] == calls[False] + late, (k, calls)


def test_a_stop_callback_ends_the_batch_between_steps(model: Any) -> None:
    from batchserve.backends.static_decode import StaticDecoder

    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) >= 3

    with Counting(model) as c:
        got = StaticDecoder(model, 40, [-1], PAD).generate(prompts(model), should_stop=stop)
    assert c.calls == 4 and all(len(r) == 4 for r in got)  # prefill's token + three steps


def test_no_cuda_capture_is_attempted_without_cuda(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from batchserve.backends.static_decode import StaticDecoder

    def refuse(*a: Any, **kw: Any) -> None:
        raise AssertionError("a CUDA graph was asked for on the CPU")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", refuse)
    monkeypatch.setattr(torch.cuda, "graph", refuse)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", refuse)
    monkeypatch.setattr(torch.cuda, "Stream", refuse)
    dec = StaticDecoder(model, NEW, [-1], PAD)
    assert not dec.use_graphs and not dec.fixed_shapes and dec.check_every == 1
    dec.warm()
    assert dec.generate(prompts(model)) == reference(model, prompts(model), eos=None)
    fixed = StaticDecoder(model, NEW, [-1], PAD, max_batch=8, fixed_shapes=True, prompt_buckets=(16,))
    fixed.warm()  # buffers and pool, no capture
    assert fixed.runners and fixed.generate(prompts(model)) == reference(model, prompts(model), eos=None)
    with pytest.raises(ValueError, match="CUDA"):
        StaticDecoder(model, NEW, [-1], PAD, use_graphs=True)


def test_the_decode_step_traces_as_one_graph(model: Any) -> None:
    """What a CUDA graph capture needs of the step: no host sync and no branch on tensor values anywhere in
    it (transformers' forward included). torch.compile with fullgraph=True fails on exactly those; both it and
    a stream capture make transformers take its tracing-safe paths (`is_tracing`)."""
    import torch

    from batchserve.backends.static_decode import Runner, Shape

    with torch.inference_mode():
        runner = Runner(model, Shape(4, 32), 8, [-1], PAD, None)
        runner.prefill(prompts(model, (3, 1, 2, 5)))
        eager = Runner(model, Shape(4, 32), 8, [-1], PAD, None)
        eager.prefill(prompts(model, (3, 1, 2, 5)))
        torch.compile(runner.decode_step, backend="eager", fullgraph=True)()
        eager.decode_step()
        assert torch.equal(runner.tokens, eager.tokens) and int(runner.step) == 2


@pytest.mark.slow
@pytest.mark.parallel  # in process, token for token, no timing: CI runs it in the parallel workers
def test_smollm2_static_path_gives_generates_answers_on_the_real_weights() -> None:
    """The backend's default path against its `generate` path, same batch of mixed-length prompts."""
    from batchserve.backends.smollm2 import SmolLM2Backend
    from batchserve.config import ModelSpec, Settings

    backend = SmolLM2Backend.from_settings(
        ModelSpec("smollm2", backend="smollm2"), Settings(backend="smollm2", max_new_tokens=48)
    )
    inputs = [
        "What is the capital of France?",
        "Hi",
        "Write one sentence about the sea and the wind, for a child who has never seen either of them.",
        "List three prime numbers.",
        "2+2=",
    ]
    assert backend.decoders and not backend.decoders[0].use_graphs
    tokens = backend.decoders[0].generate(backend.encode(inputs))
    assert any(len(t) < 48 for t in tokens) and any(len(t) == 48 for t in tokens)  # some end before the limit
    texts = [t.strip() for t in backend.tokenizer.batch_decode(tokens, skip_special_tokens=True)]
    device = backend.devices[0]
    assert texts == backend.run_generate(device, inputs)
    assert backend.batch(inputs[:1], device) == texts[:1]  # the backend's own path: encode, decode, decode text
