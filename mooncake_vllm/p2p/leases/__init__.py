"""The producer's leases on held KV blocks: ``table`` (the state machine), ``process`` (the lease
server process that holds the tables and serves the side channels), ``client`` (the engine
core's view of it)."""
