"""Train the embedded default's byte-level BPE tokenizer on the five training novels.

    python scripts/train_tokenizer.py                       # writes into mha2gqa/data/austen-mha/
    python scripts/train_tokenizer.py --out /tmp/tok --vocab-size 8192

Deterministic: the novels are read in a fixed order and the trainer is single-threaded, so the
same inputs give byte-identical tokenizer files. Persuasion (held out) is never read.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

# The BPE trainer's merge order must not depend on thread scheduling.
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from mha2gqa.files import embedded  # noqa: E402

# ids 0, 1, 2: the same convention as the model config (pad, bos, eos).
SPECIALS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}


def training_lines():
    """Every line of the five training novels, in a fixed order (the trainer counts words per line)."""
    for name in embedded.TRAIN_NOVELS:
        yield from embedded.read_novel(name).splitlines(keepends=True)


def train(vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    # Byte level: every string is encodable (no <unk>), and decoding gives the text back exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIALS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_lines(), trainer=trainer)
    # No automatic bos/eos: the training loop packs documents itself and decides where they go.
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length, **SPECIALS)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=embedded.tokenizer_dir(), help="directory to write the HF tokenizer files into"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=4096, help="BPE vocabulary size including the 3 special tokens (default 4096)"
    )
    parser.add_argument(
        "--model-max-length",
        type=int,
        default=512,
        help="context length recorded in tokenizer_config.json (default 512)",
    )
    args = parser.parse_args(argv)
    if args.vocab_size < 256 + len(SPECIALS):
        parser.error(f"--vocab-size {args.vocab_size} must be at least {256 + len(SPECIALS)} (256 bytes + specials)")
    fast = train(args.vocab_size, args.model_max_length)
    args.out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(args.out)
    sample = embedded.read_novel(embedded.HELDOUT_NOVEL)
    n_tokens = len(fast(sample)["input_ids"])
    print(
        f"wrote {args.out}: vocab {len(fast)}, Persuasion = {n_tokens} tokens ({len(sample) / n_tokens:.2f} chars/token)"
    )


if __name__ == "__main__":
    main()
