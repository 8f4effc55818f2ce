"""batchserve on Ray Serve: one batchserve runtime per replica behind Ray's HTTP proxy (`app`)."""
