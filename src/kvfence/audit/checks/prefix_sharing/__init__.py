"""Prefix sharing: tenant B cannot detect tenant A's cached prefix by timing, on any route."""
