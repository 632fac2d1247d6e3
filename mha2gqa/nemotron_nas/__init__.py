"""NVIDIA's Nemotron-NAS (DeciLM) checkpoint format: a Llama whose layers each have their own kv-head count.

blocks.py reads and writes the format's config.json (pure, no torch); modeling.py is the transformers model
class mha2gqa registers for it (model_type "nemotron-nas"), so that eval and uptrain load such a checkpoint
without trust_remote_code.
"""
