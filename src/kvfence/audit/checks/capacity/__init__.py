"""Capacity: the pool holds the longest request the target admits, with headroom."""
