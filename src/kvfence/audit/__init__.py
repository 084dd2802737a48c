"""The audit kit: the incident runbook as checks against any engine, over HTTP only."""
