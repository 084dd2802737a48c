"""Noninterference: tenant B's deterministic answers do not depend on tenant A's traffic."""
