"""Integrations with model libraries (each loads its library only when registered)."""
