"""Token generation with continuous batching, behind OpenAI-compatible routes.

Split like vLLM's OpenAI layer: `engine` (the continuous-batching engine on the model), `parse` and `render` (the
OpenAI request and answer), `serving` (one request's walk through the engine), `routes` (the HTTP endpoints),
`shapes` (their declared bodies and operations); `kv_budget`, `sampling` and `textstream` are the engine's parts.
"""
