"""Serving: the OpenAI-compatible router, tenants, workers, transports and metrics."""
