"""OpenAI's completions and chat completions, and `/v1/inference` on a generative model, on the decoding engine
(`batchserve/decoding/`).

Split like vLLM's OpenAI layer: `parse` and `render` (the OpenAI request and answer), `complete` (a request's
prompt and sampling), `serving` (one request's walk through the engine), `routes` (the HTTP endpoints), `shapes`
(their declared bodies and operations), `inference` and `inference_records` (`/v1/inference` on the engine).
"""
