"""Generation through a live server on the real model, driven by the official `openai` client (issue 6).

One server for the module: SmolLM2 on the CPU, at most 4 sequences at once (so 6 concurrent streams must
queue for a slot) of at most 512 tokens each, a 10 s queue timeout (so a request behind 4 long ones is
refused at the door), and one API key (the same tenancy as /v1/inference: a wrong key gets 401).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncio
import re
import time

import httpx

import pytest

from bench.ledger_drill import ledger_of
from tests.conftest import LiveServer, start_server
from tests.integration.generation.conftest import Reference
from tests.conftest import add_key

if TYPE_CHECKING:
    import openai

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
MAX_NEW_TOKENS = 8
CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Japan": "Tokyo",
    "England": "London",
    "Russia": "Moscow",
    "China": "Beijing",
}


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    config = tmp_path_factory.mktemp("gen") / "bs.toml"
    return str(config), add_key(config, "gen-tests", "enterprise", "--rate", "10000")


@pytest.fixture(scope="module")
def server(key: tuple[str, str], request: pytest.FixtureRequest):
    # /v1/inference on the static batch path (not the stepper, the default): the overlap test below is about
    # the batch path's model and the engine's never corrupting each other.
    s = start_server(
        "--backend",
        "smollm2",
        "--max-new-tokens",
        str(MAX_NEW_TOKENS),
        "--generation-max-seqs",
        "4",
        "--generation-max-context",
        "512",
        "--generation-queue-timeout-ms",
        "10000",
        "--inference-path",
        "static",
        "--config",
        key[0],
        ready=False,
        timeout=180,
    )
    s.key = key[1]  # type: ignore[attr-defined]
    try:
        # the session's in-process SmolLM2 (the static path's test below compares with it) loads meanwhile
        request.getfixturevalue("generate_reference")
        s.wait_ready(180)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=60)


def auth(server: LiveServer) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.key}"}


def ask(country: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is the capital of {country}?"}]


def engine_stats(server: LiveServer) -> dict:
    return httpx.get(server.url + "/internal/generation").json()


def metric(server: LiveServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_idle(server: LiveServer, within_s: float) -> dict:
    give_up = time.monotonic() + within_s
    while (stats := engine_stats(server))["running"] or stats["waiting"]:
        assert time.monotonic() < give_up, stats
        time.sleep(0.05)
    return stats


def test_models_lists_the_generation_model_first_under_a_usable_name(client: openai.OpenAI) -> None:
    first = client.models.list().data[0].id  # what guidellm and other clients take when no model is named
    assert first == MODEL
    r = client.chat.completions.create(model=first, messages=ask("France"), temperature=0, max_tokens=4)
    assert r.model == MODEL


def test_chat(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ask("France"), temperature=0, max_tokens=24)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    choice = r.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens < 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ask("France"),
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert len({c.id for c in chunks}) == 1


def test_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert "Paris" in r.choices[0].text
    assert r.usage.completion_tokens == 5


def test_completions_stream(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5, stream=True
        )
    )
    assert "Paris" in "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ask("France"), temperature=0, max_tokens=24, stop=["Paris"]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content.startswith("The capital of France is")
    assert "Paris" not in r.choices[0].message.content


def test_seed_makes_sampling_repeatable(client: openai.OpenAI) -> None:
    def draw(seed: int) -> str:
        r = client.chat.completions.create(
            model=MODEL,
            messages=ask("Japan"),
            temperature=1.0,
            top_p=0.95,
            seed=seed,
            max_tokens=12,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].message.content

    first = draw(7)
    assert draw(7) == first
    assert any(draw(seed) != first for seed in (8, 9))


def test_concurrent_streams_all_complete_with_sensible_text(server: LiveServer) -> None:
    import openai

    async def one(c: openai.AsyncOpenAI, country: str) -> str:
        stream = await c.chat.completions.create(
            model=MODEL, messages=ask(country), temperature=0, max_tokens=24, stream=True
        )
        parts = [chunk.choices[0].delta.content or "" async for chunk in stream]
        return "".join(parts)

    async def main() -> list[str]:
        # Retries as the client's default does: on a machine slow enough that the two streams waiting for a slot
        # are predicted past the 10 s queue timeout, the door refuses them (503, Retry-After) and they come back.
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=3, timeout=90) as c:
            return await asyncio.gather(*(one(c, country) for country in CAPITALS))

    texts = asyncio.run(main())  # 6 streams, 4 slots: two wait for a slot (or are refused and retry), then run
    for (country, capital), text in zip(CAPITALS.items(), texts):
        assert capital in text, (country, text)
    wait_idle(server, 5)


def test_disconnect_mid_stream_frees_its_slot(server: LiveServer, client: openai.OpenAI) -> None:
    before = metric(server, 'batchserve_generation_cancelled_total{reason="client_disconnect"}')
    tokens_before = wait_idle(server, 5)["generated_tokens"]
    stream = client.chat.completions.create(
        model=MODEL, messages=ask("China"), temperature=0, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    for _ in range(3):
        next(it)
    stats = engine_stats(server)
    assert stats["running"] == 1 and stats["kv_blocks_reserved"] > 0
    stream.close()
    stats = wait_idle(server, 5)
    # The slot was freed by the hang-up, not by the sequence running out: far fewer than its 400 tokens were made.
    assert stats["generated_tokens"] - tokens_before < 200, stats
    assert stats["kv_blocks_reserved"] == 0 and stats["cancelled"] >= 1
    assert metric(server, 'batchserve_generation_cancelled_total{reason="client_disconnect"}') == before + 1
    assert metric(server, "batchserve_generation_running_sequences") == 0


def test_request_behind_full_slots_gets_503_not_a_long_wait(server: LiveServer, client: openai.OpenAI) -> None:
    import openai

    streams = [
        client.chat.completions.create(
            model=MODEL, messages=ask(c), temperature=0, max_tokens=450, stream=True, extra_body={"ignore_eos": True}
        )
        for c in ("France", "Germany", "Japan", "England")
    ]
    try:
        for s in streams:  # all 4 slots hold a 450-token sequence
            next(iter(s))
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(model=MODEL, messages=ask("Russia"), max_tokens=450)
        # Refused at the door: the four 450-token sequences still hold every slot, so it did not wait for one.
        assert engine_stats(server)["running"] == 4
        assert err.value.status_code == 503 and err.value.code == "service_overloaded"
        assert int(err.value.response.headers["retry-after"]) >= 1
        assert set(err.value.body) == {"message", "type", "param", "code"}
    finally:
        for s in streams:
            s.close()
    wait_idle(server, 5)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"logprobs": True}, "logprobs"),
        ({"seed": "seven"}, "seed"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
    ],
)
def test_bad_parameters_get_400_in_openai_shape(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    import openai

    body = {"model": MODEL, "messages": ask("France"), "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body)
    assert err.value.status_code == 400
    assert err.value.param == param and err.value.type == "invalid_request_error"
    assert set(err.value.body) == {"message", "type", "param", "code"}


def test_a_long_prompt_without_max_tokens_runs_to_the_end_of_the_context(client: openai.OpenAI) -> None:
    """Each sequence holds 512 tokens here: 500 prompt tokens leave 12 (OpenAI's rule when max_tokens is not
    given); asking for more than fits is a 400 that says so."""
    import openai

    prompt = [(i * 7919) % 40000 + 100 for i in range(500)]
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
    assert "512 tokens one sequence may hold" in err.value.message


def test_bad_completion_prompt_and_unknown_model(client: openai.OpenAI) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="", max_tokens=4)
    assert err.value.param == "prompt"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=ask("France"), max_tokens=4)
    assert err.value.code == "model_not_found"


def test_not_json_gets_openai_error_shape(server: LiveServer) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=b"{nope",
        headers={"content-type": "application/json", **auth(server)},
    )
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_answers_match_the_published_openapi_schemas(server: LiveServer) -> None:
    import jsonschema

    doc = httpx.get(server.url + "/openapi.json").json()

    def check(name: str, value: dict) -> None:
        jsonschema.Draft202012Validator({**doc, "$ref": f"#/components/schemas/{name}"}).validate(value)

    ok = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=30,
        headers=auth(server),
        json={"model": MODEL, "messages": ask("France"), "temperature": 0, "max_tokens": 4},
    )
    check("ChatCompletion", ok.json())
    ok = httpx.post(
        server.url + "/v1/completions",
        timeout=30,
        headers=auth(server),
        json={"model": MODEL, "prompt": "Hi", "temperature": 0, "max_tokens": 2},
    )
    check("Completion", ok.json())
    bad = httpx.post(
        server.url + "/v1/completions", headers=auth(server), json={"model": MODEL, "prompt": "Hi", "top_p": 7}
    )
    assert bad.status_code == 400
    check("OpenAIError", bad.json())
    check("GenerationStatus", httpx.get(server.url + "/internal/generation").json())


def test_wrong_key_gets_401_in_openai_shape(server: LiveServer) -> None:
    import openai

    stranger = openai.OpenAI(base_url=server.url + "/v1", api_key="bs_not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        stranger.chat.completions.create(model=MODEL, messages=ask("France"), max_tokens=4)
    assert err.value.status_code == 401 and err.value.type == "authentication_error"
    assert set(err.value.body) == {"message", "type", "param", "code"}


def test_inference_during_and_after_a_long_stream_answers_right(server: LiveServer, client: openai.OpenAI) -> None:
    """Generation and the batch path never corrupt each other (issue 9 §1): they once shared one model object,
    and the engine's steps flipped `config.is_causal` under the batch's `generate` ("The capital of France is
    France.", and so on for every later answer)."""

    def inference(question: str) -> str:
        r = httpx.post(
            server.url + "/v1/inference",
            json={"input": question, "timeout_ms": 60000},
            headers=auth(server),
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return r.json()["output"]

    wait_idle(server, 5)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ask("Germany"),
        temperature=0,
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    text = [next(chunks).choices[0].delta.content or "" for _ in range(3)]
    during = [inference("What is the capital of France?"), inference("What is the capital of Japan?")]
    assert engine_stats(server)["running"] == 1, "the chat stopped before the inference ran: no overlap tested"
    for c in chunks:  # enough of the answer to check it; the rest of its 400 tokens would only cost time
        text += [c.choices[0].delta.content or "" for _ in c.choices[:1]]
        if len("".join(text)) >= 200:
            break
    stream.close()  # the hang-up cancels the sequence
    wait_idle(server, 5)
    after = inference("What is the capital of France?")
    assert "Paris" in during[0] and "Tokyo" in during[1], during
    assert "Paris" in after, after
    assert "Berlin" in "".join(text)[:200], "".join(text)[:200]


def test_chat_and_completion_without_model_use_the_served_one(server: LiveServer) -> None:
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        headers=auth(server),
        timeout=60,
        json={"messages": ask("France"), "temperature": 0, "max_tokens": 24},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == MODEL and "Paris" in chat.json()["choices"][0]["message"]["content"]
    completion = httpx.post(
        server.url + "/v1/completions",
        headers=auth(server),
        timeout=60,
        json={"prompt": "The capital of France is", "temperature": 0, "max_tokens": 5},
    )
    assert completion.status_code == 200 and "Paris" in completion.json()["choices"][0]["text"]
    empty = httpx.post(
        server.url + "/v1/chat/completions",
        headers=auth(server),
        timeout=60,
        json={"model": "", "messages": ask("France"), "max_tokens": 4},
    )
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "model"


def test_the_static_path_answers_as_generate_does(server: LiveServer, generate_reference: Reference) -> None:
    """`--inference-path static` stays selectable (issue 25, item 1): with the engine on, /v1/inference answers
    through the batcher's static batches, each prompt as transformers `generate` answers it alone, greedy. On
    this module's static-path server rather than one started for it (a real-model start, ~10 s of the suite)."""
    prompts = ["Hi", "What is the capital of France?"]
    reference = generate_reference(prompts, MAX_NEW_TOKENS)
    before = wait_idle(server, 5)["generated_tokens"]
    for text in prompts:  # one at a time: batches of one, as `generate` ran them
        r = httpx.post(
            server.url + "/v1/inference", json={"input": text, "timeout_ms": 60000}, headers=auth(server), timeout=120
        )
        assert r.status_code == 200 and r.json()["output"] == reference[text], (r.text, reference[text])
    assert engine_stats(server)["generated_tokens"] == before  # the engine is on, and untouched: the batcher answered


def usage_of(server: LiveServer) -> dict:
    (mine,) = httpx.get(server.url + "/v1/usage", headers=auth(server)).json()["data"]
    return mine


def test_the_ledger_books_each_answer_with_its_tokens(server: LiveServer, client: openai.OpenAI) -> None:
    """The SLO ledger on the generation routes (issue 33): each answer once, an outcome by its time to the first
    token, cost served = prompt + completion tokens (the answers' own usage), a 400 not an outcome."""
    import openai

    wait_idle(server, 5)
    before = usage_of(server)
    chat = client.chat.completions.create(model=MODEL, messages=ask("Japan"), temperature=0, max_tokens=8)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The capital of Italy is",
            temperature=0,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ask("France"), max_tokens=0)
    tokens = chat.usage.total_tokens + chunks[-1].usage.total_tokens
    give_up = time.monotonic() + 5  # a stream is booked once its last chunk went out: wait for it
    while (after := usage_of(server))["cost_served"] < before["cost_served"] + tokens:
        assert time.monotonic() < give_up, (before, after, tokens)
        time.sleep(0.05)
    assert sum(after["requests"][o] - before["requests"][o] for o in ("met", "slow")) == 2
    assert after["cost_served"] - before["cost_served"] == tokens
    assert after["inputs"]["met"] + after["inputs"]["slow"] - before["inputs"]["met"] - before["inputs"]["slow"] == 2
    assert sum(after["requests"].values()) - sum(before["requests"].values()) == 2  # the 400: no outcome
    assert after["latency_ms"]["count"] >= 2 and after["tier"] == "enterprise"
    text = httpx.get(server.url + "/metrics").text
    booked = ledger_of(text)  # by (model, tier, outcome)
    assert sum(booked.get((MODEL, "enterprise", o), 0) for o in ("met", "slow")) >= 2, booked
    assert "gen-tests" not in text
