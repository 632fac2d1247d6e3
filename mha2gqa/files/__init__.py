"""Checkpoints and the other files mha2gqa reads and writes (docs/code.md)."""
