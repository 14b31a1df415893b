"""``MooncakeConnector``, the P2P handoff: ``connector`` (the facade vLLM loads) → ``scheduler``
(engine core: claims loads, pins blocks, opens leases) → ``worker`` (the pull) → ``side_channel``
(acquire/release) → ``transfer.engine`` (reads). See ``mooncake_vllm/README.md``."""
