"""Pool mode: ``MooncakeStoreConnector``, a content-addressed KV pool on Mooncake Store.

One request's data path, as for P2P: ``connector`` (the facade vLLM loads) → ``scheduler``
(engine-core process: looks up how much of a prompt the pool holds, plans saves) → ``worker``
(worker process: puts and gets) → ``store`` (the only code that touches
``MooncakeDistributedStore``). Beside them: ``keys`` (the hash chain), ``config``, ``stats``.
"""
