import os
import sys
import tempfile
from pathlib import Path

import pytest

# No test may reach the hub: set before transformers/datasets are imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests' models are tiny: one torch thread each (mha2gqa/runtime/threads.py says why), in subprocesses too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# convert's check caches each parent's numbers (convert/check_cache.py): in a folder of this run, never the user's.
os.environ.setdefault("MHA2GQA_CACHE", tempfile.mkdtemp(prefix="mha2gqa-test-cache-"))
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    """A small calibration text (a module may define its own)."""
    from tiny_models import SAMPLE_TEXT

    path = tmp_path_factory.mktemp("cal") / "cal.txt"
    path.write_text(SAMPLE_TEXT * 12)
    return str(path)


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    """A tiny llama with a 64-token context (so calibration and refine blocks are 64 tokens), and its tokenizer."""
    from tiny_models import make_tiny_tokenizer, save_tiny_model

    src = tmp_path_factory.mktemp("src") / "llama"
    save_tiny_model(src, "llama", max_position_embeddings=64)
    make_tiny_tokenizer(src)
    return src


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
    """$TMPDIR for this case, empty (the fault tests check it empty again after the case)."""
    folder = tmp_path / "TMPDIR"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder
