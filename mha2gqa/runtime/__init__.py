"""The run's environment and the rules every command shares (docs/code.md)."""
