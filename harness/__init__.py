"""Development harness, not shipped by ``pip install .``: the tiny test model builder, the
real-server harness (tests, benchmarks) and the demo (``make demo``)."""
