"""The embeddings wing: OpenAI's `POST /v1/embeddings` on any model whose backend's outputs are vectors."""
