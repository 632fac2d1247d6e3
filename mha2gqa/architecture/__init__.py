"""What a model is, per architecture (docs/code.md)."""
