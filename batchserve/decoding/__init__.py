"""The continuous-batching decoding engine the generation routes, `/v1/inference` on a generative model and the
batch-job lines all run on (beside `core/`, the batcher of one-shot models).

`engine` (sequences, admission by KV blocks, the shares between tenants and lanes, the step loop; `admitter`
picks who of the waiting runs), the steppers
that run a step on the model (`stepper`'s interface; `manager_stepper`: transformers' paged cache;
`slot_stepper` over `slot_decoder`: fixed slots, CUDA graphs on a GPU; `slot_map` seats the sequences,
`prefill_pieces` pads a prefill), `kv_budget`, `shares`, `step_share`
and `prefill_share` (who gets the next slot, step and prompt tokens), `sampling`, `sizing` (rows and prefill
to the device) and `textstream` (tokens to text deltas and stop strings). Nothing here knows HTTP: the routes in
`generation/` drive it.
"""
