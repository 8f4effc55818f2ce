"""Benchmarks for batchserve: open-loop load, an ideal-batcher model, a bare baseline, the standard table."""
