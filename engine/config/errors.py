"""The configuration's user error and the small checks every layer uses to name the field at fault.

A user error raises ``ConfigError`` (a ``ValueError``) whose message names the field; the entry point prints it
as one ``error:`` line and exits non-zero before anything is written.
"""

from __future__ import annotations

import difflib
import json
import os

__all__ = ["ConfigError", "read_json_object", "is_hf_folder", "did_you_mean", "check_choice", "check_positive",
           "check_shard_split"]


class ConfigError(ValueError):
    """A user error in the configuration; the message names the offending field."""


def read_json_object(path: str, field: str) -> dict:
    """The JSON object in the file ``path`` (a checkpoint's or an HF folder's metadata); ConfigError naming
    ``field`` when the file is missing, is not JSON, or holds something else."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{field}: {path} is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{field}: cannot read '{path}' as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{field}: '{path}' does not hold a JSON object")
    return data


def is_hf_folder(path: str) -> bool:
    """Whether ``path`` is a Hugging Face checkpoint folder (it holds config.json) rather than a Tessera step folder:
    the two kinds checkpoint.initial_load_path takes."""
    return os.path.isfile(os.path.join(path, "config.json"))


def did_you_mean(word: str, choices) -> str:
    same_letters = [c for c in choices if c.lower() == word.lower()]  # '8b' for '8B'
    close = same_letters or difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def check_choice(key: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: '{value}' is not one of {', '.join(choices)}{did_you_mean(value, choices)}")


def check_positive(key: str, value) -> None:
    if not value > 0:
        raise ConfigError(f"{key}: must be > 0, got {value}")


def check_shard_split(num_shards: int, dp: int, origin: str, fix: str) -> None:
    """The data.num_shards rule: every data-parallel rank reads as many shards (a rank with fewer would read
    them faster and oversample them). ``origin`` says where the count comes from, ``fix`` what to do."""
    if num_shards % dp:
        raise ConfigError(
            f"data.num_shards: {origin} {num_shards} shards, which do not split evenly over {dp} data-parallel "
            f"ranks (a rank with fewer shards would read them faster and oversample them); {fix}"
        )
