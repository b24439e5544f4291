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
    "flash_attn_version",
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

_FLASH_MISSING = ("model.attn: flash_attn is not installed for this GPU; pip install flash-attn-4 (Hopper, Blackwell) "
                  "or flash-attn, or use model.attn = sdpa")


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
# flash_attn: FlashAttention 4 (PyPI flash-attn-4: CuTe DSL kernels for Hopper and Blackwell), else 3 (the Hopper
# build's flash_attn_interface), else 2 (flash-attn)
# ----------------------------------------------------------------------------------------------------------------


def _module_exists(name: str) -> bool:
    """Whether ``name`` (a dotted module name) can be imported, without importing it when its package is absent."""
    parent = name.split(".")[0]
    try:
        return importlib.util.find_spec(parent) is not None and importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def flash_attn_version() -> Optional[int]:
    """The FlashAttention generation model.attn = flash_attn runs on this machine: 4 (flash-attn-4, compute
    capability 9 or 10), 3 (flash_attn_interface, Hopper), 2 (flash-attn); None without one (or without CUDA)."""
    if not torch.cuda.is_available():
        return None
    major = torch.cuda.get_device_capability()[0]
    if major in (9, 10, 11) and _module_exists("flash_attn.cute"):
        return 4
    if major == 9 and _module_exists("flash_attn_interface"):
        return 3
    if _module_exists("flash_attn") and _module_exists("flash_attn.flash_attn_interface"):
        return 2
    return None


def flash_attn_available() -> bool:
    """True when a FlashAttention package this GPU runs is installed (flash_attn_version)."""
    return flash_attn_version() is not None


# FlashAttention 4 as one operator: torch.compile keeps it whole (its CuTe kernels are compiled by its own JIT), and
# per-op AC saves its output and log-sum-exp. Its forward and backward functions are flash-attn-4's private
# _flash_attn_fwd / _flash_attn_bwd, called here only.
@torch.library.custom_op("tessera::flash_attn", mutates_args=())
def flash_attn4(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Causal attention on q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]``: the output and the log-sum-exp
    ``[B, Hq, S]`` (fp32)."""
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse = _flash_attn_fwd(q, k, v, softmax_scale=q.shape[-1] ** -0.5, causal=True, return_lse=True)
    return out, lse


@flash_attn4.register_fake
def _(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    b, s, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("tessera::flash_attn_backward", mutates_args=())
def flash_attn4_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
                         ) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, q.shape[-1] ** -0.5, True)
    return dq, dk, dv


@flash_attn4_backward.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash4_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs, *output)


def _flash4_backward(ctx, dout: Tensor, _dlse: Optional[Tensor]):
    q, k, v, out, lse = ctx.saved_tensors
    return flash_attn4_backward(dout, q, k, v, out, lse)


flash_attn4.register_autograd(_flash4_backward, setup_context=_flash4_setup_context)


def _flash(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    version = flash_attn_version()
    if version is None:
        raise ValueError(_FLASH_MISSING)
    if q.device.type != "cuda":
        raise ValueError("model.attn: flash_attn needs CUDA tensors; use model.attn = sdpa on this device")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"model.attn: flash_attn needs bf16 or fp16 activations, got {q.dtype}")
    # FlashAttention takes [B, S, H, D] and handles GQA (fewer k/v heads) itself.
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if version == 4:
        out = flash_attn4(q.contiguous(), k.contiguous(), v.contiguous())[0]
    elif version == 3:
        from flash_attn_interface import flash_attn_func

        out = flash_attn_func(q, k, v, causal=True)
    else:
        from flash_attn import flash_attn_func

        out = flash_attn_func(q, k, v, causal=True)
    if isinstance(out, tuple):  # some releases return (out, lse)
        out = out[0]
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
