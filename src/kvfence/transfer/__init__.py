"""KV transfer between prefill and decode: the `KVTransport` contract and its backends.

`base.py` is the contract, `registry.py` picks a backend by name, `rooms.py` has what a
receiver reports. Import from those modules: this package imports nothing, so asking
whether a native engine loads (`native.py`) costs no torch import.
"""
