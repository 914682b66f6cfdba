"""Corpora shipped with glassgpt, compressed: Tiny Shakespeare (public domain)."""
