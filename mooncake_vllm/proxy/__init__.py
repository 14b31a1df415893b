"""The prefill/decode proxy: clients talk to it; it prefills on one vLLM and decodes on another.

``rewrite`` (request bodies) and ``routing`` (backend choice and health) are pure; ``config``
holds the validated settings; ``app`` does the HTTP; ``server`` is the command line
(``mooncake-vllm-proxy``).
"""
