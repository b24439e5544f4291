"""Train Tessera's built-in tokenizer: engine/data/assets/tokenizer.json (+ tokenizer_config.json).

A byte-level BPE (GPT-2 style pre-tokenization, every byte in the base alphabet so any text encodes) with
4096 entries in all, the three special tokens included, trained with the ``tokenizers`` library on the
built-in corpus ``tessera_docs.jsonl.gz`` (run ``scripts/make_corpus.py`` first). Like Llama 3's, its
post-processor puts BOS before a text when the caller asks for special tokens (``transformers``' default, so
that a model exported with it sees BOS first, as in training); Tessera's data loader encodes without them and
adds BOS/EOS around each document itself.

Training is deterministic: the corpus is read in file order and the BPE trainer breaks ties between
equally frequent pairs the same way on every run, so the output is byte-identical for the same corpus and
``tokenizers`` version (this script checks it by hashing, with ``--check``).

Usage: ``python scripts/make_tokenizer.py [--assets engine/data/assets] [--check]``
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys

VOCAB_SIZE = 4096
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]
DEFAULT_ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine", "data", "assets")


def read_corpus(path: str) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def train(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def tokenizer_config() -> dict:
    """What Hugging Face's tokenizer_config.json says about the special tokens."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000_000_000_019_884_624_838_656,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--assets", default=DEFAULT_ASSETS, help="folder with the corpus; outputs go there too")
    parser.add_argument("--check", action="store_true", help="train twice and fail if the results differ")
    args = parser.parse_args(argv)

    texts = read_corpus(os.path.join(args.assets, "tessera_docs.jsonl.gz"))
    tokenizer = train(texts)
    data = tokenizer.to_str(pretty=True)
    if args.check:
        again = train(texts).to_str(pretty=True)
        if again != data:
            print("error: two training runs gave different tokenizers", file=sys.stderr)
            return 1
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE, tokenizer.get_vocab_size()
    for token in SPECIAL_TOKENS:
        assert tokenizer.token_to_id(token) is not None, token

    with open(os.path.join(args.assets, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(data + "\n")
    with open(os.path.join(args.assets, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(), f, indent=2)
        f.write("\n")
    digest = hashlib.sha256(data.encode("utf-8")).hexdigest()[:16]
    print(f"wrote {args.assets}/tokenizer.json: vocab {tokenizer.get_vocab_size(with_added_tokens=True)}, sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
