"""batchserve: a dynamic-batching inference server (one process per GPU host)."""

__version__ = "0.1.0"
