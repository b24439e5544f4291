"""Named Qwen3 sizes (``model.flavor``): the published models' configurations (Hugging Face's Qwen/Qwen3-*
config.json files, as torchtitan 0.2.2's qwen3 flavors copy them), their benchmark cuts with fewer layers (named
as the reference kit, ../shared/bench/anchor/titan_runner.py, names them) and two debug models that train on CPU.

Every published size has vocabulary 151936, heads 128 wide with QK-norm, RMSNorm epsilon 1e-6, RoPE base 1e6
and 40960 positions (max_position_embeddings). 0.6B, 1.7B and 4B tie the output projection to the embedding;
the MoE sizes route each token to 8 of 128 experts, softmax scores renormalized over the 8 (norm_topk_prob),
no shared experts, every block sparse.
"""

from __future__ import annotations

import dataclasses

from models.moe import MoEArgs
from models.qwen3.model import Qwen3ModelArgs

__all__ = ["qwen3_flavors"]

VOCAB = 151936


def _published(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, hidden: int, tie: bool = False,
               moe_hidden: int = 0) -> Qwen3ModelArgs:
    """A published Qwen3 configuration; ``moe_hidden`` > 0: Qwen3-MoE with experts of that hidden size."""
    moe = MoEArgs(num_experts=128, top_k=8, hidden_dim=moe_hidden, score_func="softmax", route_norm=True,
                  load_balance_coeff=None) if moe_hidden else None
    return Qwen3ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=VOCAB,
                          head_dim_override=128, ffn_hidden=hidden, qk_norm=True, tie_embeddings=tie, moe=moe,
                          norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=40960)


_PUBLISHED = {
    "0.6B": _published(1024, 28, 16, 8, 3072, tie=True),
    "1.7B": _published(2048, 28, 16, 8, 6144, tie=True),
    "4B": _published(2560, 36, 32, 8, 9728, tie=True),
    "8B": _published(4096, 36, 32, 8, 12288),
    "14B": _published(5120, 40, 40, 8, 17408),
    "32B": _published(5120, 64, 64, 8, 25600),
    # intermediate_size (the dense SwiGLU) is published for the MoE sizes too, though every block is sparse.
    "30B-A3B": _published(2048, 48, 32, 4, 6144, moe_hidden=768),
    "235B-A22B": _published(4096, 94, 64, 4, 12288, moe_hidden=1536),
}

# The debug models: heads 64 wide, so that n_heads * head_dim (512) is not dim (256) and a mix-up shows.
_DEBUG = Qwen3ModelArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=-1, head_dim_override=64,
                        ffn_hidden=768, qk_norm=True, norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=2048)

_DEBUG_MOE = dataclasses.replace(_DEBUG, moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=128, score_func="softmax",
                                                   route_norm=True, load_balance_coeff=None))

qwen3_flavors: dict[str, Qwen3ModelArgs] = {
    # Small models for tests and debugging; the vocabulary comes from the tokenizer.
    "debugmodel": _DEBUG,
    "debugmodel_moe": _DEBUG_MOE,
    # 2 layers, for tests whose checks do not need depth (each layer costs CPU time).
    "debugmodel_L2": dataclasses.replace(_DEBUG, n_layers=2),
    "debugmodel_moe_L2": dataclasses.replace(_DEBUG_MOE, n_layers=2),
    **_PUBLISHED,
    # The benchmark shapes: a published size with fewer layers.
    **{f"{name}_L{n}": dataclasses.replace(_PUBLISHED[name], n_layers=n)
       for name, counts in (("8B", (2, 4, 8)), ("30B-A3B", (2, 4, 8)), ("235B-A22B", (1, 2))) for n in counts},
}
