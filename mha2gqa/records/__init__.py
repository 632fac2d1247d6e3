"""What a written folder says about itself (docs/code.md)."""
