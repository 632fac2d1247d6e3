import os
import sys
from pathlib import Path

# No test may reach the hub: set before transformers/datasets are imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests' models are tiny: one torch thread each (mha2gqa/threads.py says why), in subprocesses too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))
