"""Async batch jobs: durable, ordered, idempotent, and fed to the GPUs from spare capacity.

- `store`: the `JobStore` interface and its records; `sqlite_store`: the default store (one SQLite file, WAL);
  `pg_store`: a store shared by many nodes (PostgreSQL; items leased with `FOR UPDATE SKIP LOCKED`).
- `scheduler`: feeds pending items into the batcher at tier `batch`, a bounded number at a time, and writes
  their results back in batches of rows.
- `service`: what `Runtime` starts and stops; `routes`: the `/v1/batches` routes; `shapes`: their declared
  bodies and operations.
"""
