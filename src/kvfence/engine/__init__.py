"""The isolation core: pages, ledger, request lifecycle, sizing, scheduling.

This package knows no process, network, lab or audit (docs/ARCHITECTURE.md, "The layers").
"""
