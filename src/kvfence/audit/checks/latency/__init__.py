"""Latency: a long prompt answered as fast as a short one was not prefilled (KV reused)."""
