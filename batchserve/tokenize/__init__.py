"""The tokenizer wing: `POST /tokenize` and `/detokenize` (vLLM's shapes, and TEI's `/tokenize`)."""
