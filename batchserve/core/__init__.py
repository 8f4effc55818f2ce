"""Core policy: tiers, the fair queue and its items, admission, the request log, and the inference service
(the one door to the batcher). Nothing here speaks HTTP."""
