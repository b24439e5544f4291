"""Named Llama 3, 3.1 and 3.2 sizes (``model.flavor``)."""

from __future__ import annotations

import dataclasses

from models.llama3.model import TransformerModelArgs

__all__ = ["llama3_flavors"]

_8B = TransformerModelArgs(
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    vocab_size=128256,
    ffn_dim_multiplier=1.3,
    multiple_of=1024,
    rope_theta=500000.0,
    rope_scaling=True,
    max_seq_len=131072,
)


def _llama3_2(dim: int, n_layers: int, n_heads: int) -> TransformerModelArgs:
    """Llama 3.2 1B/3B as published (meta-llama/Llama-3.2-*'s config.json): SwiGLU hidden size 8192, the output
    projection tied to the embedding, Llama 3.1's RoPE scaling with factor 32."""
    return TransformerModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=8192,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=True,
        rope_scaling_factor=32.0,
        max_seq_len=131072,
        tie_embeddings=True,
    )


# A small model for tests and debugging; the vocabulary comes from the tokenizer.
_DEBUG = TransformerModelArgs(
    dim=256,
    n_layers=6,
    n_heads=16,
    n_kv_heads=8,
    vocab_size=-1,
    multiple_of=256,
    rope_theta=500000.0,
    rope_scaling=False,
    max_seq_len=2048,
    norm_eps=1e-5,
)

llama3_flavors: dict[str, TransformerModelArgs] = {
    "debugmodel": _DEBUG,
    # The debug model with 2 layers, for tests whose checks do not need depth (each layer costs CPU time).
    "debugmodel_L2": dataclasses.replace(_DEBUG, n_layers=2),
    # The 2-layer debug model with its output projection tied to the embedding, as Llama 3.2's.
    "debugmodel_tied": dataclasses.replace(_DEBUG, n_layers=2, tie_embeddings=True),
    "1B": _llama3_2(dim=2048, n_layers=16, n_heads=32),
    "3B": _llama3_2(dim=3072, n_layers=28, n_heads=24),
    "8B": _8B,
    # The 8B shapes with 8 layers: the benchmark shape.
    "8B_L8": dataclasses.replace(_8B, n_layers=8),
    # The 8B shapes with 2 layers: GPU smoke tests.
    "8B_L2": dataclasses.replace(_8B, n_layers=2),
    "70B": TransformerModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000.0,
        rope_scaling=True,
        max_seq_len=131072,
    ),
    "405B": TransformerModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000.0,
        rope_scaling=True,
        max_seq_len=131072,
    ),
}
