"""Tokenizers: any Hugging Face ``tokenizer.json`` (Llama-3's included) or Tessera's built-in one.

``Tokenizer`` never relies on the file's post-processor to add BOS/EOS (Llama-3's tokenizer.json adds BOS only,
GPT-2's adds nothing): text is encoded with ``add_special_tokens=False`` and the BOS/EOS ids are added here. They
are found from a ``tokenizer_config.json`` beside the file (``bos_token``/``eos_token``, a string or ``{"content":
...}``) when there is one, else from the first known pair of names present in the vocabulary:
``<|begin_of_text|>``/``<|end_of_text|>`` (Llama 3), ``<s>``/``</s>`` (Llama 2, Mistral), ``<|endoftext|>`` for
both (GPT-2 style). A ``tokenizer_config.json`` whose ``bos_token`` is null asks for no BOS: documents are then
separated by EOS alone, as Megatron-LM's end-of-document token does. Special tokens written in a document's text
are encoded as plain text. Truncation and padding saved in the file (some published tokenizer.json files have them
on) are turned off: a document is encoded whole and unpadded, and packing cuts it.
"""

from __future__ import annotations

import json
import os

from engine.config import Config, ConfigError

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
BUILTIN_TOKENIZER = os.path.join(ASSETS_DIR, "tokenizer.json")

KNOWN_SPECIAL_TOKENS = [
    ("<|begin_of_text|>", "<|end_of_text|>"),
    ("<s>", "</s>"),
    ("<|endoftext|>", "<|endoftext|>"),
]


def _token_content(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """A ``tokenizers.Tokenizer`` loaded from ``path`` plus its BOS/EOS ids.

    ``field`` is the config field that named the file; every error raised here is a ConfigError that
    starts with it.
    """

    def __init__(self, path: str, field: str = "data.tokenizer"):
        from tokenizers import Tokenizer as HFTokenizer

        self.path = path
        if not os.path.isfile(path):
            raise ConfigError(f"{field}: tokenizer file '{path}' not found; give a Hugging Face tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a plain Exception for malformed files
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ConfigError(f"{field}: '{path}' is not a valid Hugging Face tokenizer.json ({reason})") from None
        # A document's text is text: "<|end_of_text|>" written in it is encoded as those characters, never as
        # the special token (as Llama 3's own tiktoken encoding does), so a document cannot end itself early.
        self._tok.encode_special_tokens = True
        self._tok.no_truncation()
        self._tok.no_padding()
        self.bos_token, self.eos_token = self._find_special_tokens(field)
        self._bos_id = None if self.bos_token is None else self._tok.token_to_id(self.bos_token)
        self._eos_id = self._tok.token_to_id(self.eos_token)

    def _find_special_tokens(self, field: str) -> tuple[str | None, str]:
        """(BOS, EOS) token names; BOS None when tokenizer_config.json sets bos_token to null (no BOS)."""
        config_path = os.path.join(os.path.dirname(self.path), "tokenizer_config.json")
        bos = eos = None
        no_bos = False
        if os.path.isfile(config_path):
            try:
                with open(config_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ConfigError(f"{field}: cannot read '{config_path}' ({e})") from None
            if isinstance(config, dict):
                bos = _token_content(config.get("bos_token"))
                eos = _token_content(config.get("eos_token"))
                no_bos = "bos_token" in config and config["bos_token"] is None
            for name, token in (("bos_token", bos), ("eos_token", eos)):
                if token is not None and self._tok.token_to_id(token) is None:
                    raise ConfigError(
                        f"{field}: {config_path} names {name} '{token}', which is not in the vocabulary of {self.path}"
                    )
        for bos_name, eos_name in KNOWN_SPECIAL_TOKENS:
            if bos is None and not no_bos and self._tok.token_to_id(bos_name) is not None:
                bos = bos_name
            if eos is None and self._tok.token_to_id(eos_name) is not None:
                eos = eos_name
        missing = [name for name, token in (("BOS", bos), ("EOS", eos))
                   if token is None and not (name == "BOS" and no_bos)]
        if missing:
            known = ", ".join(f"{b}/{e}" for b, e in KNOWN_SPECIAL_TOKENS[:2]) + ", " + KNOWN_SPECIAL_TOKENS[2][0]
            other = "" if field == "data.tokenizer" else ", or set data.tokenizer to another tokenizer.json"
            raise ConfigError(
                f"{field}: no {' or '.join(missing)} token found for {self.path}; put a tokenizer_config.json "
                f"naming bos_token and eos_token beside it, or use a vocabulary with {known}{other}"
            )
        return bos, eos

    @property
    def bos_id(self) -> int | None:
        """None when the tokenizer asks for no BOS (tokenizer_config.json's bos_token is null)."""
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, added (special) tokens included: embeddings need at least this many rows."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if bos and self._bos_id is not None:
            ids.insert(0, self._bos_id)
        if eos:
            ids.append(self._eos_id)
        return ids

    def encode_batch(self, texts: list[str], bos: bool = True, eos: bool = True) -> list[list[int]]:
        """``encode`` for many texts at once (parallel in the Rust library)."""
        out = []
        for enc in self._tok.encode_batch(list(texts), add_special_tokens=False):
            ids = enc.ids
            if bos and self._bos_id is not None:
                ids.insert(0, self._bos_id)
            if eos:
                ids.append(self._eos_id)
            out.append(ids)
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r})"


def tokenizer_path(cfg: Config) -> tuple[str, str]:
    """(path of the tokenizer.json to use, the config field that chose it)."""
    if cfg.data.tokenizer:  # the file, or a folder holding it (as model.hf_assets_path)
        if os.path.isdir(cfg.data.tokenizer):
            return os.path.join(cfg.data.tokenizer, "tokenizer.json"), "data.tokenizer"
        return cfg.data.tokenizer, "data.tokenizer"
    if cfg.model.hf_assets_path:
        return os.path.join(cfg.model.hf_assets_path, "tokenizer.json"), "model.hf_assets_path"
    return BUILTIN_TOKENIZER, "data.tokenizer"


def check_tokenizer_config(cfg: Config) -> None:
    """The cheap part of build_tokenizer: the file exists."""
    path, field = tokenizer_path(cfg)
    if not os.path.isfile(path):
        where = "" if field == "data.tokenizer" else f" (from {field}; set data.tokenizer to use another file)"
        raise ConfigError(f"{field}: tokenizer file '{path}' not found{where}; give a Hugging Face tokenizer.json")


def build_tokenizer(cfg: Config) -> Tokenizer:
    """data.tokenizer if set, else <model.hf_assets_path>/tokenizer.json if set, else the built-in one."""
    check_tokenizer_config(cfg)
    path, field = tokenizer_path(cfg)
    return Tokenizer(path, field)
