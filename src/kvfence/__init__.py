"""kvfence: tenant isolation for disaggregated LLM serving, proven on the bug."""

__version__ = "0.1.0"
