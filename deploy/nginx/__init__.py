"""nginx in front of N batchserve processes: the config (`render`) and a local nginx for tests and benches."""
