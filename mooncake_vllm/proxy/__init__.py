"""The prefill/decode proxy: clients talk to it; it prefills on one vLLM and decodes on another.

``rewrite`` (request bodies) and ``routing`` (backend choice and health) are pure; ``app`` does
the HTTP; ``server`` holds the configuration and the command line (``mooncake-vllm-proxy``).
"""
