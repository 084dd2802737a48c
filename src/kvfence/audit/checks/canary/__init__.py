"""Canary: tenant A's sentinel never comes back in tenant B's output."""
