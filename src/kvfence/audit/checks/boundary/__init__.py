"""Boundary: probes at the limit, at limit + 1 and in the pool gap get the right answer."""
