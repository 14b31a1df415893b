"""What both connectors (P2P and pool) and the proxy share: the shared secret, settings and
identity of an engine, layout math, block pins and load jobs, thread priorities."""
