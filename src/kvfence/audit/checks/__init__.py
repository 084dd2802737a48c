"""The runbook's checks, one package each: its probes, its statistics and its verdict together.

A check package imports the audit's shared parts (the contract, the HTTP client, the
adapters, prompts and statistics), never another check; the runbook names every check
class in its table (`audit.runbook.CHECKS`).
"""
