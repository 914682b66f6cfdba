"""Shipped presets: one TOML file each, with [model] and [train] tables."""
