"""Integrations with training frameworks (import the one you use; each patches only when imported)."""
