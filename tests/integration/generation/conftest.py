"""What several generation test modules share: SmolLM2 loaded once in the test process, for the answers of
transformers `generate` that the served answers must equal (a load is seconds of the suite; each module once
loaded its own), and one keyed `--generation on` server for the modules whose tests need no flags of their own."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Callable

import pytest

from tests.conftest import LiveServer, start_server

# Fixtures of other modules that modules here take as parameters, imported once here rather than into each of them
# (an import there is shadowed by the parameter, which pyflakes rightly reports as F811): `model` (SmolLM2 on the
# CPU, module-scoped as in test_static_decode) and `receiver` (the OTLP receiver of test_tracing).
from tests.integration.backends.test_static_decode import model  # noqa: F401
from tests.integration.test_tracing import receiver  # noqa: F401

Reference = Callable[[list[str], int], dict[str, str]]
KEYED_SLOTS = 4
# Tenants of keyed_generation: test_shares' (a hog and the small chats beside it, a preempted tenant and the
# one that preempts it, a batch and the caller beside it) and test_refusals' (one looping refused prompts, one not)
KEYED_TENANTS = ("hog", "small", "first", "second", "batcher", "caller", "acme", "globex")


@pytest.fixture(scope="session")
def generate_reference() -> Reference:
    """`(prompts, max_new) -> {prompt: answer}`: each prompt alone through transformers `generate`, greedy,
    shaped and decoded as the batch backend does."""
    import torch

    from batchserve.backends.smollm2 import load_model, load_tokenizer, prompt_ids, source_dir
    from batchserve.config import Settings

    source = source_dir(Settings(backend="smollm2"))
    tokenizer, lm = load_tokenizer(source), load_model("cpu", source)

    def answers(prompts: list[str], max_new: int) -> dict[str, str]:
        out = {}
        with torch.inference_mode():
            for text in prompts:
                ids = torch.tensor(prompt_ids(tokenizer, [text]))
                new = lm.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                )[0, ids.shape[1] :]
                out[text] = tokenizer.decode(new, skip_special_tokens=True).strip()
        return out

    return answers


@pytest.fixture(scope="session")
def keyed_generation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, dict[str, str]]]:
    """`(server, {tenant: key})`: a `--generation on` server with SmolLM2's real weights, KEYED_SLOTS slots of
    1,024 tokens, one paid key per tenant of KEYED_TENANTS, a job store of its own, and `--refused-per-s 4`
    (test_refusals' rate; the other tests here send nothing refused). One start for test_shares and
    test_refusals (the model's load and warm-up is most of a short test's time: each module once started its
    own); each test waits for the engine to be idle first, and its tenants are its own."""
    from bench.gen_share import keyed

    tmp = tmp_path_factory.mktemp("keyed-generation")
    config, keys = keyed(tmp, KEYED_TENANTS)
    s = start_server(
        "--devices",
        "1",
        "--generation",
        "on",
        "--generation-max-seqs",
        str(KEYED_SLOTS),
        "--generation-max-context",
        "1024",
        "--config",
        str(config),
        "--refused-per-s",
        "4",
        "--jobs-db",
        str(tmp / "jobs.db"),
        timeout=240,
    )
    try:
        yield s, keys
    finally:
        s.stop()
