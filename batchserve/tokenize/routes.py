"""`POST /tokenize` and `POST /detokenize`: a served model's tokenizer (`backends/tokenizer_of.py`) run on a
thread, not through the door (it is for model work, and a long text would hold the event loop); vLLM's answer, or
TEI's for `inputs`. Not in a model's SLO ledger."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

import msgspec
from starlette.routing import Route

from batchserve.backends import Backend
from batchserve.backends.tokenizer_of import TextTokenizer, tokenizer_of
from batchserve.http.model_choice import ModelRegistry
from batchserve.errors import warming_up
from batchserve.http.dialects import OPENAI
from batchserve.http.endpoint import COUNTED, Call, Endpoint, Served, as_json
from batchserve.http.plumbing import decode
from batchserve.http.openai_error import bad, no_model, refused, unknown_model
from batchserve.tokenize import shapes

TOKENIZE = msgspec.json.Decoder(shapes.TokenizeRequest)
DETOKENIZE = msgspec.json.Decoder(shapes.DetokenizeRequest)


class TokenizeHost(Served, Protocol):
    """What these routes read from `app.state.rt`."""

    registry: ModelRegistry
    backends: dict[str, Backend]

    @property
    def generation(self) -> object | None: ...  # the generation engine: its `cfg.model_id` and `tokenizer`


@dataclass(slots=True)
class Texts:
    """What to tokenize: the texts, whether it came in TEI's shape (`inputs`), and the tokenizer."""

    texts: list[str]
    tei: bool
    special: bool
    tok: TextTokenizer


@dataclass(slots=True)
class Ids:
    ids: list[int]
    tok: TextTokenizer


def pick(rt: TokenizeHost, call: Call, requested: str | None) -> TextTokenizer:
    """The tokenizer of the model named (the generation model's by its id), or with none named the generation
    model's, else the first served model's that has one; 404 unknown, 503 loading, 400 a model without one."""
    engine = rt.generation
    engine_id = getattr(getattr(engine, "cfg", None), "model_id", None)
    if engine is not None and requested in (None, engine_id):
        tok = tokenizer_of(engine)
        if tok is not None:
            call.work.model = str(engine_id)
            return tok
    if requested is None:
        for model_id, backend in rt.backends.items():
            tok = tokenizer_of(backend)
            if tok is not None:
                call.work.model = model_id
                return tok
        if len(rt.backends) < len(rt.registry.by_id):
            raise warming_up()
        raise no_model("no model served here has a tokenizer")
    spec = rt.registry.resolve(requested, call.who.key_id)
    if spec is None:
        raise unknown_model(requested)
    chosen = rt.backends.get(spec.id)
    if chosen is None:
        raise warming_up()
    tok = tokenizer_of(chosen)
    if tok is None:
        raise bad("model", f"the model '{spec.id}' has no tokenizer (a Hugging Face folder has)", "model_no_tokenizer")
    call.work.model = spec.id
    return tok


def parse_tokenize(rt: TokenizeHost, call: Call, body: bytes) -> Texts:
    req = decode(TOKENIZE, body, refused)
    if (req.prompt is None) == (req.inputs is None):
        raise bad("prompt", "give one of 'prompt' (vLLM's shape) or 'inputs' (TEI's)")
    texts = [req.prompt] if req.prompt is not None else [req.inputs] if isinstance(req.inputs, str) else req.inputs
    limit = rt.settings.max_input_chars
    field = "prompt" if req.prompt is not None else "inputs"
    if any(len(t) > limit for t in texts or ()):
        raise bad(field, f"a text is over the {limit}-character limit", "string_above_max_length")
    return Texts(list(texts or ()), req.inputs is not None, req.add_special_tokens, pick(rt, call, req.model))


async def tokenize(rt: TokenizeHost, call: Call, t: Texts) -> object:
    ids = await asyncio.to_thread(lambda: [t.tok.encode(text, t.special) for text in t.texts])
    if t.tei:
        return [[{"id": i, "text": s} for i, s in zip(one, t.tok.token_texts(one))] for one in ids]
    return {"count": len(ids[0]), "max_model_len": t.tok.max_model_len, "tokens": ids[0]}


def parse_detokenize(rt: TokenizeHost, call: Call, body: bytes) -> Ids:
    req = decode(DETOKENIZE, body, refused)
    limit = rt.settings.max_input_chars
    if len(req.tokens) > limit:
        raise bad("tokens", f"over the {limit}-token limit (--max-input-chars)", "array_above_max_length")
    tok = pick(rt, call, req.model)
    size = tok.vocab_size()
    if any(i >= size for i in req.tokens):
        raise bad("tokens", f"a token id is not below the vocabulary's size ({size})")
    return Ids(req.tokens, tok)


async def detokenize(rt: TokenizeHost, call: Call, d: Ids) -> dict[str, str]:
    return {"prompt": await asyncio.to_thread(d.tok.decode, d.ids)}


tokenize_route: Endpoint[TokenizeHost, Texts, object] = Endpoint(
    OPENAI, parse_tokenize, tokenize, as_json, book=COUNTED
)
detokenize_route: Endpoint[TokenizeHost, Ids, dict[str, str]] = Endpoint(
    OPENAI, parse_detokenize, detokenize, as_json, book=COUNTED
)

ROUTES = [
    Route("/tokenize", tokenize_route, methods=["POST"]),
    Route("/detokenize", detokenize_route, methods=["POST"]),
]
