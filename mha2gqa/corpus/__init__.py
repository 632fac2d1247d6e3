"""Text that feeds a model, for every command that reads some: convert's calibration, uptrain's data, sweep's
and eval's measurement text. It imports none of them (tests/test_layers.py).

- textdata.py: the one reader of text corpora (files, folders, compressed, jsonl/parquet fields, hub datasets);
- tokens.py: text -> token ids, with the rule for where a document ends (every reader tokenizes here);
- blocks.py: token ids -> fixed-length blocks (whole blocks, packed with EOS), and the one mix builder of
  several parts' blocks, its orders named (MixOrder);
- mix.py: the notation that names several texts with shares (`parent:0.5 austen:0.5`) and splits a token
  budget between them;
- calibration.py: the one calibration read: a spec resolved into parts, then read into ids and their record
  (convert's stages, --kv-budget's layer losses, sweep's statistics all call read_calibration);
- sampling.py: text sampled from the parent itself (`parent`), the data a user always has;
- probe.py: the probe set (small texts of several domains shipped in the package) and how --data names texts.

Importing it imports no torch: the modules that need torch import it inside their functions.
"""
