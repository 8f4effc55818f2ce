"""The smallest plugin: a plain function that takes a batch of inputs and returns one output per input.

    batchserve serve --backend examples.uppercase:batch      # from the repository's root
    curl -s localhost:8000/v1/inference -H 'Content-Type: application/json' -d '{"input": "hello"}'
    {"request_id":"req_…","output":"HELLO","model":"uppercase@v1",…}

It runs on one worker thread ("cpu"), one batch at a time; batchserve learns its batch time from the
warm-up (a batch of ["warm-up"]) and from then on from every batch.
"""


def batch(inputs: list[str]) -> list[str]:
    return [text.upper() for text in inputs]
