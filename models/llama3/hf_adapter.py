"""Conversion between Tessera's Llama 3 state dict and Hugging Face's ``LlamaForCausalLM`` checkpoint layout.

The two layouts hold the same numbers under other names, except ``wq`` and ``wk``: Tessera (like Meta's reference
code) rotates each head's features as interleaved pairs ``(x[2i], x[2i+1])``, while Hugging Face rotates halves
``(x[i], x[i + D/2])``. Both are correct RoPE; they differ by a fixed permutation of the output rows of ``wq``/``wk``
within each head, which ``to_hf`` applies and ``from_hf`` undoes (exactly: a permutation loses nothing).

=====================================================  ==========================================
Tessera                                                Hugging Face
=====================================================  ==========================================
``tok_embeddings.weight``                              ``model.embed_tokens.weight``
``layers.N.attention.{wq,wk,wv,wo}.weight``            ``model.layers.N.self_attn.{q,k,v,o}_proj.weight``
``layers.N.feed_forward.{w1,w2,w3}.weight``            ``model.layers.N.mlp.{gate,down,up}_proj.weight``
``layers.N.{attention_norm,ffn_norm}.weight``          ``model.layers.N.{input,post_attention}_layernorm.weight``
``norm.weight``                                        ``model.norm.weight``
``output.weight``                                      ``lm_head.weight``
``output.weight`` (tied to the embedding)              none: ``model.embed_tokens.weight`` is both
=====================================================  ==========================================

RoPE scaling is Llama 3.1's (``rope_type`` llama3) with the model's factor (8 for Llama 3.1, 32 for Llama 3.2 1B and
3B); its other three numbers are fixed, and a config.json with others is refused.

``hf_config`` writes the matching ``config.json`` (read by transformers 4.45+ and 5.x); ``args_from_hf_config`` reads
one back, and ``check_hf_config`` tells whether a checkpoint's config.json fits the configured model.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from models.llama3.model import (
    ROPE_HIGH_FREQ_FACTOR,
    ROPE_LOW_FREQ_FACTOR,
    ROPE_ORIGINAL_MAX_POS,
    TransformerModelArgs,
    ffn_hidden_dim,
)

__all__ = ["Llama3HFAdapter"]

# Names that do not depend on the layer, Tessera -> Hugging Face.
_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Names inside block N, Tessera ("layers.N." + key) -> Hugging Face ("model.layers.N." + value), in the order of the
# block's parameters.
_PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}

# The numbers of Llama 3.1's RoPE scaling (Hugging Face's names) that Tessera's model holds fixed; the factor is
# the model's own (rope_scaling_factor).
_HF_ROPE_FIXED = {
    "low_freq_factor": ROPE_LOW_FREQ_FACTOR,
    "high_freq_factor": ROPE_HIGH_FREQ_FACTOR,
    "original_max_position_embeddings": ROPE_ORIGINAL_MAX_POS,
}

# config.json keys whose value must match the configured model: (key, Tessera's name for it in error messages, its
# value in TransformerModelArgs).
_CHECKED_FIELDS = (
    ("hidden_size", "dim", lambda a: a.dim),
    ("num_hidden_layers", "n_layers", lambda a: a.n_layers),
    ("num_attention_heads", "n_heads", lambda a: a.n_heads),
    ("num_key_value_heads", "n_kv_heads", lambda a: a.n_kv_heads),
    ("intermediate_size", "FFN hidden size", lambda a: a.ffn_hidden_size),
    ("vocab_size", "vocab_size", lambda a: a.vocab_size),
    ("rms_norm_eps", "norm_eps", lambda a: a.norm_eps),
    ("rope_theta", "rope_theta", lambda a: a.rope_theta),
    ("rope_scaling", "rope_scaling", lambda a: a.rope_scaling),
    ("rope_scaling.factor", "rope_scaling_factor", lambda a: a.rope_scaling_factor if a.rope_scaling else None),
    ("tie_word_embeddings", "tie_embeddings", lambda a: a.tie_embeddings),
)


def _hf_name(name: str) -> str:
    """The Hugging Face name of the Tessera parameter ``name``."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    assert match is not None and match.group(2) in _PER_LAYER, f"not a Llama 3 parameter: {name}"
    return f"model.layers.{match.group(1)}.{_PER_LAYER[match.group(2)]}"


def _tessera_names(args: TransformerModelArgs) -> list[str]:
    """Every state-dict key of ``Transformer(args)`` (``output.weight`` included when tied), in the model's order."""
    names = ["tok_embeddings.weight"]
    for i in range(args.n_layers):
        names += [f"layers.{i}.{key}" for key in _PER_LAYER]
    return names + ["norm.weight", "output.weight"]


def _is_tied_output(name: str, args: TransformerModelArgs) -> bool:
    """Whether ``name`` is an output projection tied to the embedding (stored as ``model.embed_tokens.weight``
    alone, as transformers saves a model with tie_word_embeddings)."""
    return name == "output.weight" and args.tie_embeddings


def _hf_names(name: str, args: TransformerModelArgs) -> list[str]:
    """The Hugging Face tensors that hold the Tessera tensor ``name``: one, or none for a tied output."""
    return [] if _is_tied_output(name, args) else [_hf_name(name)]


def _interleaved_to_half(w: Tensor, n_heads: int) -> Tensor:
    """Reorder the output rows of ``wq``/``wk`` ``[n_heads * D, dim]`` from interleaved pairs to rotate-half.

    Within each head, row ``2i + j`` (pair ``i``, component ``j``) moves to row ``j * D/2 + i``.
    """
    rows, cols = w.shape
    head_dim = rows // n_heads
    return w.view(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _half_to_interleaved(w: Tensor, n_heads: int) -> Tensor:
    """The inverse of ``_interleaved_to_half``: row ``j * D/2 + i`` of each head moves back to row ``2i + j``."""
    rows, cols = w.shape
    head_dim = rows // n_heads
    return w.view(n_heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_heads(name: str, args: TransformerModelArgs) -> Optional[int]:
    """The number of heads of ``name`` when it is a ``wq``/``wk`` weight (Tessera name), else None."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def _hf_rope_scaling(args: TransformerModelArgs) -> Optional[dict[str, Any]]:
    """config.json's ``rope_scaling`` of ``args`` (None without scaling)."""
    if not args.rope_scaling:
        return None
    return {"rope_type": "llama3", "factor": args.rope_scaling_factor, **_HF_ROPE_FIXED}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_rope(config: dict[str, Any], field: str) -> tuple[float, bool, float]:
    """``(rope_theta, rope_scaling, rope_scaling_factor)`` from a config.json, in the 4.x form (``rope_theta`` +
    ``rope_scaling``) or the 5.x form (``rope_parameters``); like transformers 5, ``rope_scaling`` takes precedence
    when both are present. Without scaling the factor is the args' default."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{field}: config.json's rope_scaling/rope_parameters must be an object, got {rope!r}")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    unscaled_factor = TransformerModelArgs.rope_scaling_factor
    if rope_type == "default":
        return float(theta), False, unscaled_factor
    if rope_type != "llama3":
        raise ValueError(
            f"{field}: config.json has RoPE type {rope_type!r}; Tessera's Llama 3 supports 'default' and 'llama3'"
        )
    factor = rope.get("factor")
    if not (_is_number(factor) and factor > 0):
        raise ValueError(f"{field}: config.json has {key}.factor {factor!r}; Tessera's Llama 3 needs a positive number")
    for name, value in _HF_ROPE_FIXED.items():
        theirs = rope.get(name)
        if not (_is_number(theirs) and math.isclose(theirs, value)):
            raise ValueError(
                f"{field}: config.json has {key}.{name} {theirs}; Tessera's Llama 3 supports only {value} (Llama "
                "3.1's and 3.2's)"
            )
    return float(theta), True, float(factor)


class Llama3HFAdapter:
    """Converts Tessera Llama 3 state dicts and configs to and from Hugging Face's ``LlamaForCausalLM`` layout.

    Stateless: every method is static and may be called on the class or on an instance.
    """

    @staticmethod
    def to_hf(state_dict: dict[str, Tensor], args: TransformerModelArgs) -> dict[str, Tensor]:
        """A Tessera state dict (full tensors; a tied ``output.weight`` may be left out) under Hugging Face names,
        ``wq``/``wk`` rows in rotate-half order, no ``lm_head.weight`` when tied.

        Tensors other than ``wq``/``wk`` are passed through, not copied.
        """
        expected = _tessera_names(args)
        optional = {"output.weight"} if args.tie_embeddings else set()
        missing = set(expected) - set(state_dict) - optional
        unexpected = set(state_dict) - set(expected)
        assert not missing and not unexpected, (
            f"not a {args.n_layers}-layer Llama 3 state dict: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
        return {_hf_name(name): Llama3HFAdapter.tensor_to_hf(name, state_dict[name], args)
                for name in expected if not _is_tied_output(name, args)}

    @staticmethod
    def tensor_to_hf(name: str, tensor: Tensor, args: TransformerModelArgs) -> Tensor:
        """The whole Tessera tensor ``name`` in Hugging Face's layout (``wq``/``wk`` rows in rotate-half order; any
        other tensor passed through, not copied), for exporting one tensor at a time (a tied output is not
        exported: see ``tensors_to_hf``)."""
        heads = _rope_heads(name, args)
        return _interleaved_to_half(tensor, heads) if heads is not None else tensor

    @staticmethod
    def from_hf(hf_state_dict: dict[str, Tensor], args: TransformerModelArgs) -> dict[str, Tensor]:
        """The inverse of ``to_hf``: a Hugging Face state dict under Tessera names, ``wq``/``wk`` rows interleaved,
        ``output.weight`` included (the embedding, when tied).

        The caller has checked the names (``engine.hf.load_hf`` does); tensors other than ``wq``/``wk`` are passed
        through, not copied.
        """
        hf_names = set(Llama3HFAdapter.hf_shapes(args))
        assert set(hf_state_dict) == hf_names, (
            f"not a {args.n_layers}-layer Llama checkpoint of this flavor: missing "
            f"{sorted(hf_names - set(hf_state_dict))[:5]}, unexpected {sorted(set(hf_state_dict) - hf_names)[:5]}"
        )
        state_dict: dict[str, Tensor] = {}
        for name in _tessera_names(args):
            tensor = hf_state_dict[_hf_name("tok_embeddings.weight" if _is_tied_output(name, args) else name)]
            heads = _rope_heads(name, args)
            state_dict[name] = _half_to_interleaved(tensor, heads) if heads is not None else tensor
        return state_dict

    @staticmethod
    def names(args: TransformerModelArgs) -> list[str]:
        """The Tessera name of every tensor of ``Transformer(args)``, in the model's order."""
        return _tessera_names(args)

    @staticmethod
    def hf_name(name: str) -> str:
        """The Hugging Face name of the Tessera parameter ``name`` (``output.weight``: ``lm_head.weight``, as
        untied)."""
        return _hf_name(name)

    @staticmethod
    def hf_names(name: str, args: TransformerModelArgs) -> list[str]:
        """The Hugging Face tensors the Tessera tensor ``name`` is stored as: one, or none for a tied output."""
        return _hf_names(name, args)

    @staticmethod
    def tensors_to_hf(name: str, tensor: Tensor, args: TransformerModelArgs) -> dict[str, Tensor]:
        """The whole Tessera tensor ``name`` as the Hugging Face tensors ``hf_names`` gives."""
        return {hf: Llama3HFAdapter.tensor_to_hf(name, tensor, args) for hf in _hf_names(name, args)}

    @staticmethod
    def shapes(args: TransformerModelArgs) -> dict[str, tuple[int, ...]]:
        """Every Tessera tensor's shape, by Tessera name, in the model's order (a tied ``output.weight`` included:
        the state dict holds it under both names)."""
        hf_shapes = Llama3HFAdapter.hf_shapes(dataclasses.replace(args, tie_embeddings=False))
        return {name: hf_shapes[_hf_name(name)] for name in _tessera_names(args)}

    @staticmethod
    def read_from_hf(
        name: str, box: tuple[slice, ...], read: Callable[[str, tuple[slice, ...]], Tensor], args: TransformerModelArgs
    ) -> Tensor:
        """The part ``box`` (one slice per dimension) of the Tessera tensor ``name``, as ``from_hf`` would give it,
        read through ``read(hf_name, slices)`` (the slices of one stored Hugging Face tensor), so that a rank reads
        only the part of the checkpoint it holds.

        For ``wq``/``wk`` the rows of every head the box touches are read (a head's rows are permuted among
        themselves), reordered, then cut to the box; a tied ``output.weight`` is read from the embedding.
        """
        if _is_tied_output(name, args):
            return read(_hf_name("tok_embeddings.weight"), box)
        heads = _rope_heads(name, args)
        if heads is None:
            return read(_hf_name(name), box)
        rows, rest = box[0], box[1:]
        head_dim = args.head_dim
        first, last = rows.start // head_dim, -(-rows.stop // head_dim)  # the heads the rows fall in
        if first == last:  # an empty part (FSDP gives some ranks no rows of a small tensor)
            return read(_hf_name(name), box)
        block = read(_hf_name(name), (slice(first * head_dim, last * head_dim), *rest))
        start = first * head_dim
        return _half_to_interleaved(block, last - first)[rows.start - start:rows.stop - start]

    @staticmethod
    def hf_shapes(args: TransformerModelArgs) -> dict[str, tuple[int, ...]]:
        """The shape of every tensor of the Hugging Face checkpoint of ``Transformer(args)``, by Hugging Face name
        (no ``lm_head.weight`` when tied)."""
        if args.vocab_size <= 0:
            raise ValueError(f"model.vocab_size: must be set (positive), got {args.vocab_size}")
        dim, hd = args.dim, args.head_dim
        hidden = args.ffn_hidden_size
        per_layer = {
            "attention.wq.weight": (args.n_heads * hd, dim),
            "attention.wk.weight": (args.n_kv_heads * hd, dim),
            "attention.wv.weight": (args.n_kv_heads * hd, dim),
            "attention.wo.weight": (dim, args.n_heads * hd),
            "feed_forward.w1.weight": (hidden, dim),
            "feed_forward.w3.weight": (hidden, dim),
            "feed_forward.w2.weight": (dim, hidden),
            "attention_norm.weight": (dim,),
            "ffn_norm.weight": (dim,),
        }
        shapes = {
            "tok_embeddings.weight": (args.vocab_size, dim),
            "norm.weight": (dim,),
            "output.weight": (args.vocab_size, dim),
        }
        for i in range(args.n_layers):
            shapes.update({f"layers.{i}.{key}": shape for key, shape in per_layer.items()})
        return {_hf_name(name): shapes[name] for name in _tessera_names(args) if not _is_tied_output(name, args)}

    @staticmethod
    def hf_config(
        args: TransformerModelArgs,
        dtype: torch.dtype = torch.bfloat16,
        bos_token_id: Optional[int] = None,
        eos_token_id: Optional[int] = None,
    ) -> dict[str, Any]:
        """The ``config.json`` of ``LlamaForCausalLM`` for ``args``, with weights stored in ``dtype``.

        RoPE is written both ways: ``rope_theta`` + ``rope_scaling`` (what transformers 4.45+ reads) and
        ``rope_parameters`` (5.x's name; 5.x also reads the 4.x keys, preferring ``rope_scaling``). The weight dtype
        is written as ``torch_dtype`` (4.x) and ``dtype`` (5.x).
        """
        if args.vocab_size <= 0:
            raise ValueError(f"model.vocab_size: must be set (positive) to export, got {args.vocab_size}")
        dtype_name = str(dtype).removeprefix("torch.")
        rope_scaling = _hf_rope_scaling(args)
        rope_parameters = {"rope_type": "default", "rope_theta": args.rope_theta}
        if rope_scaling is not None:
            rope_parameters.update(rope_scaling)
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden_size,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": rope_scaling,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": args.max_seq_len,
            "vocab_size": args.vocab_size,
            "tie_word_embeddings": args.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }
        if bos_token_id is not None:
            config["bos_token_id"] = bos_token_id
        if eos_token_id is not None:
            config["eos_token_id"] = eos_token_id
        return config

    @staticmethod
    def args_from_hf_config(config: dict[str, Any], field: str = "config.json") -> TransformerModelArgs:
        """The ``TransformerModelArgs`` of a Hugging Face Llama ``config.json`` (as a dict).

        ``multiple_of`` is set to ``intermediate_size`` (and ``ffn_dim_multiplier`` below 1 only when the hidden size
        is smaller than ``int(8 * dim / 3)``) so that the model's FFN hidden size equals ``intermediate_size``; the
        other fields map one to one. Raises ``ValueError`` starting with ``field`` when the config describes a model
        Tessera's Llama 3 cannot hold (another architecture, biases, a RoPE scaling other than Llama 3.1's with any
        factor, ...).
        """
        if config.get("model_type", "llama") != "llama":
            raise ValueError(f"{field}: config.json has model_type {config.get('model_type')!r}, not 'llama'")
        required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [key for key in required if not (isinstance(config.get(key), int) and config[key] > 0)]
        if missing:
            raise ValueError(f"{field}: config.json lacks a positive integer {', '.join(missing)}")
        unsupported = {
            "hidden_act": ("silu", config.get("hidden_act", "silu")),
            "attention_bias": (False, bool(config.get("attention_bias", False))),
            "mlp_bias": (False, bool(config.get("mlp_bias", False))),
        }
        for key, (supported, value) in unsupported.items():
            if value != supported:
                raise ValueError(f"{field}: config.json has {key} {value}; Tessera's Llama 3 supports only {supported}")
        dim, n_heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim") or dim // n_heads
        if head_dim * n_heads != dim:
            raise ValueError(
                f"{field}: config.json has head_dim {head_dim} with {n_heads} heads and hidden_size {dim}; Tessera's "
                f"Llama 3 needs head_dim * num_attention_heads == hidden_size"
            )
        rope_theta, rope_scaling, rope_scaling_factor = _read_rope(config, field)
        hidden = config["intermediate_size"]
        base_hidden = int(2 * (4 * dim) / 3)
        ffn_dim_multiplier = None if hidden >= base_hidden else (hidden + 0.5) / base_hidden  # int() gives hidden
        try:
            args = TransformerModelArgs(
                dim=dim,
                n_layers=config["num_hidden_layers"],
                n_heads=n_heads,
                n_kv_heads=config.get("num_key_value_heads") or n_heads,
                vocab_size=config["vocab_size"],
                multiple_of=hidden,
                ffn_dim_multiplier=ffn_dim_multiplier,
                norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                rope_scaling_factor=rope_scaling_factor,
                max_seq_len=int(config.get("max_position_embeddings", 2048)),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"{field}: config.json describes an impossible Llama model: {e}") from None
        assert ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier) == hidden
        return args

    @staticmethod
    def check_hf_config(
        config: dict[str, Any], args: TransformerModelArgs, field: str, model_label: Optional[str] = None
    ) -> None:
        """Raise ``ValueError`` naming ``field`` and the first differing setting unless the checkpoint described by
        ``config`` (a config.json) has the architecture of ``Transformer(args)``; ``model_label`` names ``args`` in
        the message as the user chose them (``model.flavor 8B`` in a config, ``--flavor 8B`` on a command line)."""
        hf_args = Llama3HFAdapter.args_from_hf_config(config, field)
        who = model_label or "the configured model"
        for hf_key, name, value in _CHECKED_FIELDS:
            theirs, ours = value(hf_args), value(args)
            floats = isinstance(ours, float) and isinstance(theirs, float)
            same = math.isclose(theirs, ours) if floats else theirs == ours
            if not same:
                raise ValueError(f"{field}: config.json has {hf_key} {theirs} but {who} has {name} {ours}")
