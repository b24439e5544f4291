"""Qwen3, dense and Mixture-of-Experts: the decoder of models/llama3/model.py (``Transformer``) with the options
Qwen3 sets: an RMSNorm over each query and key head before RoPE (``qk_norm``), heads 128 wide whatever the model
width (``head_dim_override``), the SwiGLU size given directly (``ffn_hidden``), the output projection tied to
the embedding on the small sizes (``tie_embeddings``) and, for Qwen3-MoE, softmax top-k routed experts without
shared experts (``moe``, models/moe.py). The module is llama3's; only the arguments' class is Qwen3's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.llama3.model import Transformer, TransformerModelArgs

__all__ = ["Qwen3ModelArgs", "Transformer"]


@dataclass
class Qwen3ModelArgs(TransformerModelArgs):
    """The hyperparameters of a Qwen3 model: ``TransformerModelArgs``' fields, no others. A class of its own so
    that the family can be told from its arguments (the Hugging Face conversion picks its adapter by it), and a
    Qwen3 flavor never equals a Llama one with the same numbers."""
