"""Data: tokenizers, datasets (built-in, local files, Hugging Face Hub) and the packing data loader."""

from engine.data.datasets import build_dataset, check_data_config
from engine.data.loader import DataLoader, build_dataloader
from engine.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["DataLoader", "Tokenizer", "build_dataloader", "build_dataset", "build_tokenizer", "check_data_config"]
