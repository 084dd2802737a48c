"""Paged KV storage and its ownership ledger (I1, I5, I7).

Layering: this package imports only `kvfence.faults` and torch. The model
reads pages through it and the engine allocates through it; neither of them is
imported from here (tests/test_layering.py).
"""
