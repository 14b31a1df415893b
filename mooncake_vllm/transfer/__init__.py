"""The Mooncake Transfer Engine's one owner (``engine``) and where its segment metadata lives:
the stores (P2P handshake, etcd, redis, http), the bridge the engine talks to, our http store."""
