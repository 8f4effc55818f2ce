"""A class plugin: a keyword sentiment scorer that returns an object per input, with options, set-up and a
batch limit. Serve it with its options from a config file:

    # sentiment.toml
    [[models]]
    name = "sentiment"
    backend = "examples.sentiment:KeywordSentiment"
    [models.options]
    positive = ["good", "great", "love", "excellent"]
    negative = ["bad", "awful", "hate", "poor"]

    batchserve serve --config sentiment.toml                # from the repository's root
    curl -s localhost:8000/v1/inference -H 'Content-Type: application/json' -d '{"input": "I love it"}'
    {"request_id":"req_…","output":{"label":"positive","score":1.0,"hits":1},…}

What batchserve calls, and where (docs/backends.md):
- `KeywordSentiment(**options)` once, on the start-up thread (the port is open, /readyz 503 until warm);
- `devices()` once: one worker thread per name;
- `setup(device)` once per device, on that device's worker thread, before the server is ready (load weights here);
- `warm(device)` once per device on the same thread: its duration seeds the learned batch time;
- `batch(inputs, device)` on the device's thread, one batch at a time per device, at most `max_batch_size`
  inputs; `bucket_of(text)` on the event loop for each input (inputs of different buckets never share a batch).
"""

from __future__ import annotations

import re

WORD = re.compile(r"[a-z']+")


class KeywordSentiment:
    max_batch_size = 64  # lowers the server's --max-batch-size for this model

    def __init__(self, positive: list[str] | None = None, negative: list[str] | None = None, devices: int = 1) -> None:
        self.positive = set(positive or ["good", "great", "love", "excellent", "happy"])
        self.negative = set(negative or ["bad", "awful", "hate", "poor", "sad"])
        self.device_count = devices
        self.ready: set[str] = set()

    def devices(self) -> list[str]:
        return [f"cpu:{i}" for i in range(self.device_count)]

    def setup(self, device: str) -> None:
        self.ready.add(device)  # a real model would load its weights onto `device` here

    def warm(self, device: str) -> None:
        self.batch(["a good warm-up", "a bad one"], device)

    def bucket_of(self, text: str) -> int:
        return 0 if len(text) <= 512 else 1  # long texts batch with long texts

    def batch(self, inputs: list[str], device: str) -> list[dict]:
        assert device in self.ready, f"{device} was not set up"
        out = []
        for text in inputs:
            words = WORD.findall(text.lower())
            pos = sum(w in self.positive for w in words)
            neg = sum(w in self.negative for w in words)
            hits = pos + neg
            score = (pos - neg) / hits if hits else 0.0
            label = "positive" if score > 0 else "negative" if score < 0 else "neutral"
            out.append({"label": label, "score": round(score, 3), "hits": hits})
        return out
