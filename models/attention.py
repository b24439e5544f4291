"""Attention backends shared by all models: sdpa, flex (with block-causal document masking) and flash_attn.

All backends compute causal attention on ``q [B, Hq, S, D]``, ``k, v [B, Hkv, S, D]`` (grouped-query attention:
``Hq`` a multiple of ``Hkv``) and return ``[B, Hq, S, D]``. Only ``flex`` supports document masking: with
``doc_ids [B, S]`` a query attends only to earlier-or-same positions of the same document.

FlexAttention notes (torch 2.13):
  * On CUDA, ``flex_attention`` is wrapped in ``torch.compile`` once (lazily, at first use); uncompiled flex
    materializes the full score matrix.
  * On CPU, flex runs uncompiled (compiling it costs tens of seconds there and the result is the same), and
    FlexAttention has no CPU backward at all. When a CPU call needs gradients, the flex backend computes the same
    masked attention with ``scaled_dot_product_attention`` and a dense ``[B, 1, S, S]`` boolean mask built from
    ``doc_ids`` instead; that keeps CPU training with block-causal masks possible (tests, debugging).
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

__all__ = [
    "BACKENDS",
    "SDPA_BACKENDS",
    "select_sdpa_backend",
    "flash_attn_available",
    "attention",
    "flex_block_mask",
    "dense_causal_mask",
]

logger = logging.getLogger(__name__)

BACKENDS = ("sdpa", "flex", "flash_attn")
"""Valid values of ``model.attn``."""

SDPA_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")
"""Valid values of ``model.sdpa_backend``: the kernel ``scaled_dot_product_attention`` may use."""

# The kernels that take grouped-query attention (fewer K/V heads) directly; with the others K/V are repeated
# to the query heads first (https://github.com/pytorch/pytorch/issues/139586: enable_gqa was a flash feature;
# cuDNN takes it in recent torch releases, which select_sdpa_backend probes once on the GPU).
_GQA_NATIVE = ("auto", "flash", "math")
_gqa_native = True


def _cudnn_takes_gqa() -> bool:
    """Whether cuDNN's SDPA kernel runs grouped-query attention as it is, forward and backward (one tiny bf16
    step on the GPU, with only cuDNN enabled); a torch release or GPU where it does not gets K/V repeated
    instead."""
    q = torch.zeros(1, 4, 128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.zeros(1, 2, 128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    try:
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True).sum().backward()
        return True
    except RuntimeError:
        return False


def select_sdpa_backend(name: str) -> str:
    """Let ``scaled_dot_product_attention`` use only the ``name`` kernel in this process (``auto``: any, torch's
    own choice). torch keeps this choice per process (torch.backends.cuda.enable_*_sdp, which CPU SDPA
    follows too), and so does this module: a kernel that lacks grouped-query support gets repeated K/V.
    Returns the choice in words, for the start-up log."""
    global _gqa_native
    if name not in SDPA_BACKENDS:
        raise ValueError(f"model.sdpa_backend: unknown kernel {name!r}; choose one of {', '.join(SDPA_BACKENDS)}")
    every = name == "auto"
    torch.backends.cuda.enable_flash_sdp(every or name == "flash")
    torch.backends.cuda.enable_cudnn_sdp(every or name == "cudnn")
    torch.backends.cuda.enable_mem_efficient_sdp(every or name == "efficient")
    torch.backends.cuda.enable_math_sdp(every or name == "math")
    _gqa_native = name in _GQA_NATIVE or (name == "cudnn" and torch.cuda.is_available() and _cudnn_takes_gqa())
    if name == "auto":
        return "any SDPA kernel"
    return f"{name} SDPA kernel only, {'grouped-query' if _gqa_native else 'K/V repeated to the query heads'}"


def _sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    if k.shape[1] != q.shape[1] and not _gqa_native:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])

_FLASH_MISSING = "model.attn: flash_attn is not installed; pip install flash-attn, or use model.attn = sdpa"


def flash_attn_available() -> bool:
    """True when the flash-attn package is installed and a CUDA device is present."""
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


# ----------------------------------------------------------------------------------------------------------------
# flex_attention
# ----------------------------------------------------------------------------------------------------------------

_compiled_flex = None
_causal_masks: dict[tuple[int, str], BlockMask] = {}
_warned_cpu_fallback = False


def _flex_fn(device: torch.device):
    """The flex_attention callable for ``device``: compiled once on CUDA, eager elsewhere."""
    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def _causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flex_block_mask(doc_ids: Optional[Tensor], seq_len: int, device: torch.device | str) -> BlockMask:
    """The flex ``BlockMask`` for causal attention over ``seq_len`` tokens, restricted to same-document pairs when
    ``doc_ids [B, seq_len]`` is given.

    The causal mask is cached per ``(seq_len, device)``; a document mask depends on the batch and is built each call
    (compiled on CUDA), so build it once per forward and pass it to every layer.
    """
    device = torch.device(device)
    if doc_ids is None:
        key = (seq_len, str(device))
        mask = _causal_masks.get(key)
        if mask is None:
            mask = create_block_mask(_causal_mod, None, None, seq_len, seq_len, device=device)
            _causal_masks[key] = mask
        return mask
    if doc_ids.dim() != 2 or doc_ids.shape[1] != seq_len:
        raise ValueError(f"doc_ids must be [batch, {seq_len}], got {list(doc_ids.shape)}")
    doc_ids = doc_ids.to(device)

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return create_block_mask(
        document_causal, doc_ids.shape[0], None, seq_len, seq_len, device=device, _compile=device.type == "cuda"
    )


def dense_causal_mask(doc_ids: Optional[Tensor], seq_len: int, device: torch.device | str) -> Tensor:
    """Boolean ``[B or 1, 1, S, S]`` mask (True = attend) equal to ``flex_block_mask``'s, for SDPA."""
    idx = torch.arange(seq_len, device=device)
    mask = (idx[:, None] >= idx[None, :])[None, None]
    if doc_ids is not None:
        doc_ids = doc_ids.to(device)
        mask = mask & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    return mask


def _flex(q: Tensor, k: Tensor, v: Tensor, doc_ids: Optional[Tensor], block_mask: Optional[BlockMask]) -> Tensor:
    seq_len = q.shape[2]
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if q.device.type == "cpu" and needs_grad:
        # FlexAttention has no CPU backward (torch 2.13): compute the same masked attention with SDPA.
        global _warned_cpu_fallback
        if not _warned_cpu_fallback and not torch.compiler.is_compiling():  # (logging inside a graph breaks it)
            logger.info("model.attn = flex: no flex backward on CPU, using SDPA with a dense mask instead")
            _warned_cpu_fallback = True
        if doc_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        mask = dense_causal_mask(doc_ids, seq_len, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if block_mask is None:
        block_mask = flex_block_mask(doc_ids, seq_len, q.device)
    fn = _flex_fn(q.device)
    if q.device.type == "cuda" or torch.compiler.is_compiling():
        return fn(q, k, v, block_mask=block_mask, enable_gqa=True)
    with warnings.catch_warnings():
        # Uncompiled flex on CPU is deliberate (see the module docstring).
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return fn(q, k, v, block_mask=block_mask, enable_gqa=True)


# ----------------------------------------------------------------------------------------------------------------
# flash_attn
# ----------------------------------------------------------------------------------------------------------------


def _flash(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    if importlib.util.find_spec("flash_attn") is None:
        raise ValueError(_FLASH_MISSING)
    if q.device.type != "cuda":
        raise ValueError("model.attn: flash_attn needs CUDA tensors; use model.attn = sdpa on this device")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"model.attn: flash_attn needs bf16 or fp16 activations, got {q.dtype}")
    from flash_attn import flash_attn_func

    # flash_attn takes [B, S, H, D] and handles GQA (fewer k/v heads) itself.
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    return out.transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------------
# dispatcher
# ----------------------------------------------------------------------------------------------------------------


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    backend: str = "sdpa",
    doc_ids: Optional[Tensor] = None,
    block_mask: Optional[BlockMask] = None,
) -> Tensor:
    """Causal attention with ``backend``: q ``[B, Hq, S, D]``, k/v ``[B, Hkv, S, D]`` -> ``[B, Hq, S, D]``.

    ``doc_ids [B, S]`` restricts attention to tokens of the same document (block-causal); only ``flex`` supports
    it, the other backends raise ``ValueError``. ``block_mask`` (flex only) is a prebuilt ``flex_block_mask`` for
    these ``doc_ids``, to build it once per forward instead of once per layer.
    """
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if backend == "flex":
        return _flex(q, k, v, doc_ids, block_mask)
    if doc_ids is not None:
        raise ValueError(
            f"model.attn_mask: block_causal document masking needs model.attn = flex, not {backend!r}"
        )
    if backend == "sdpa":
        return _sdpa(q, k, v)
    if backend == "flash_attn":
        return _flash(q, k, v)
    raise ValueError(f"model.attn: unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
