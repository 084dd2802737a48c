"""Models on paged KV: Llama-family decoders and the diagnostic mirror model.

Knows no roles or transports (DESIGN.md, Conventions).
"""
