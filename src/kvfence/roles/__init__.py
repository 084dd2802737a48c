"""The prefill and decode roles: each one loop over its engine, its pool and its KV half.

A coordinator (the hub's ZeroMQ worker, a worker behind SGLang's router) owns
addressing and pairing and drives a role one turn at a time through the seam
in `control.py`; the role never knows which coordinator it serves.
"""
