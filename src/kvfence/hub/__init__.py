"""Disaggregated prefill/decode across processes and hosts: workers, the router's backend, the launcher."""
