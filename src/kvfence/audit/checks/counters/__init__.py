"""Counters: the engine's own isolation and transfer failure counters do not move."""
