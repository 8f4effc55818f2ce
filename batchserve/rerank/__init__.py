"""The rerank wing: `POST /v1/rerank` (and `/rerank`), Cohere's / vLLM's shape, on any cross-encoder model."""
