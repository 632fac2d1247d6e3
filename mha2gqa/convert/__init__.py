"""Conversion of MHA/GQA checkpoints to fewer kv heads: plan (pure), methods (pure tensor math), run (I/O)."""
