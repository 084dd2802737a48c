"""`kvfence watch`: the runbook after deploy (docs/ARCHITECTURE.md, "The audit and the guard").

Every interval the guard re-reads each target's live capacity facts through
the audit's target adapters (HTTP only, like the audit), keeps a fingerprint
of them, and re-runs the capacity gate and the boundary probe whenever the
fingerprint changes (INCIDENT.md checklist item 5: every capacity change is
a security change). Within an operator-set request budget it also sends one
canary pair across two tenants (signal 2) and a few fresh-prompt timing
probes whose window is judged by the audit's prefill-latency analysis
(signal 3), beside the engine's own TTFT / prefill histograms read from its
/metrics (exported; corroboration, never an alarm by themselves). Everything is exported for Prometheus; facts that cannot be read
are exported as unknown, and unknown is never healthy.
"""
