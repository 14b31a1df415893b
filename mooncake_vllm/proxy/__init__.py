"""The prefill/decode proxy: clients talk to it; it prefills on one vLLM and decodes on another.

One module per concern; the first six are pure (``config`` reads the secret files it names):

- ``rewrite``: request bodies and headers of the two legs; ``prompt_list``: a list of prompts
  split into one request per prompt and the answers merged back; ``routing``: backend choice and
  health state; ``prefix``: the prefix key and the bounded-load hash ring of ``--policy prefix``;
  ``kv_index``: what each engine's cache holds, from its KV events (``--policy kv``);
  ``limits``: per-client token buckets and in-flight counts; ``config``: the validated settings;
- ``errors``: what a client can get, and what a failed backend call means;
- ``failover``: the pools, the HTTP session, and the one failover path both legs take;
- ``legs``: the prefill leg and the decode leg; ``fanout``: the legs of a list of prompts, all at
  once; ``stream``: relaying a streamed decode answer, or merging a list's;
- ``health``: the background prober; ``kv_events``: the subscription to the engines' KV
  events; ``metrics``: the Prometheus metrics; ``discovery``: pools
  that follow the engine registry (``--discover``);
- ``app``: the Quart app and its routes; ``http_servers``: the ASGI servers it runs on (uvicorn,
  granian, hypercorn); ``server``: the command line (``mooncake-vllm-proxy``).
"""
