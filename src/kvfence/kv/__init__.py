"""Fixed pools of slots guarded by an ownership ledger (I1, I5, I7).

`ledger.py` is the ledger itself (allocate all-or-nothing, release
invalidates, every use verifies owner and generation, check_integrity);
`pool.py` is the ledger plus KV tensors (the engine's paged KV cache);
`slots.py` is the ledger plus plain objects with a reset (`SlotPool`, for
any pooled resource); `harness.py` tests any such pool with a hypothesis
state machine (needs the `harness` extra).

Layering: this package imports only `kvfence.faults`, torch and, in the
harness alone, hypothesis. The model reads pages through it and the engine
allocates through it; neither is imported from here (tests/arch/test_layering.py).
"""
