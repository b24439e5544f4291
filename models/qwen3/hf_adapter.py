"""Conversion between Tessera's Qwen3 state dict and Hugging Face's ``Qwen3ForCausalLM`` (model_type "qwen3") and
``Qwen3MoeForCausalLM`` ("qwen3_moe") checkpoint layouts.

The names are Llama 3's (models/llama3/hf_adapter.py, whose RoPE permutation of the ``wq``/``wk`` rows is used
here too) plus:

=====================================================  ===================================================
Tessera                                                Hugging Face
=====================================================  ===================================================
``layers.N.attention.{q,k}_norm.weight``               ``model.layers.N.self_attn.{q,k}_norm.weight``
``layers.N.feed_forward.router.gate.weight``           ``model.layers.N.mlp.gate.weight``
``layers.N.feed_forward.experts.{w1,w2,w3}``           ``model.layers.N.mlp.experts.E.{gate,down,up}_proj.weight``
                                                       for every expert E (one Tessera tensor, E of theirs)
``output.weight`` (tied to the embedding)              none: ``model.embed_tokens.weight`` is both
=====================================================  ===================================================

The QK-norm weights act on a head's features before RoPE, so their entries get the permutation of a head's rows.
A MoE model's ``feed_forward.expert_bias`` (auxiliary-loss-free balancing, ``load_balance_coeff``) has no place
in Hugging Face's model: it loads as zeros; ``hf_config`` refuses such a flavor and ``tensors_to_hf`` a non-zero
bias, since the export would route otherwise.

One Tessera tensor may be several Hugging Face tensors (an expert stack) or none (a tied output): ``hf_names``
and ``tensors_to_hf`` say which; ``shapes`` gives the Tessera shapes. ``read_from_hf`` reads any box of a
Tessera tensor from the stored tensors, expert by expert.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from models.llama3.hf_adapter import (
    _PER_LAYER as _LLAMA_PER_LAYER,
    _TOP_LEVEL,
    Llama3HFAdapter,
    _half_to_interleaved,
    _interleaved_to_half,
)
from models.moe import MoEArgs
from models.qwen3.model import Qwen3ModelArgs

__all__ = ["Qwen3HFAdapter"]

MODEL_TYPES = {False: "qwen3", True: "qwen3_moe"}  # by whether the model has MoE blocks
ARCHITECTURES = {False: "Qwen3ForCausalLM", True: "Qwen3MoeForCausalLM"}

# Tessera names inside block N ("layers.N." + key) -> Hugging Face ("model.layers.N." + value), for the tensors
# that are one Hugging Face tensor each.
_ATTENTION = {k: v for k, v in _LLAMA_PER_LAYER.items() if k.startswith("attention.")}
_QK_NORMS = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}
_DENSE = {k: v for k, v in _LLAMA_PER_LAYER.items() if k.startswith("feed_forward.")}
_BLOCK_NORMS = {k: v for k, v in _LLAMA_PER_LAYER.items() if k.endswith("_norm.weight")}
_ROUTER = {"feed_forward.router.gate.weight": "mlp.gate.weight"}
# An expert stack -> the name of each expert's tensor, "{e}" the expert.
_EXPERTS = {
    "feed_forward.experts.w1": "mlp.experts.{e}.gate_proj.weight",
    "feed_forward.experts.w2": "mlp.experts.{e}.down_proj.weight",
    "feed_forward.experts.w3": "mlp.experts.{e}.up_proj.weight",
}
_EXPERT_BIAS = "feed_forward.expert_bias"
_ONE_TO_ONE = {**_ATTENTION, **_QK_NORMS, **_DENSE, **_BLOCK_NORMS, **_ROUTER}

_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")


def _layer_keys(args: Qwen3ModelArgs, i: int) -> list[str]:
    """The state-dict keys of block ``i`` (after ``layers.i.``), in the model's order."""
    if args.is_moe_layer(i):
        ffn = ([_EXPERT_BIAS] if args.moe.load_balance_coeff is not None else []) + [*_ROUTER, *_EXPERTS]
    else:
        ffn = list(_DENSE)
    return [*_ATTENTION, *_QK_NORMS, *ffn, *_BLOCK_NORMS]


def _tessera_names(args: Qwen3ModelArgs) -> list[str]:
    """Every state-dict key of ``Transformer(args)`` (``output.weight`` included when tied), in the model's order."""
    names = ["tok_embeddings.weight"]
    for i in range(args.n_layers):
        names += [f"layers.{i}.{key}" for key in _layer_keys(args, i)]
    return names + ["norm.weight", "output.weight"]


def _split(name: str) -> tuple[Optional[str], str]:
    """``(layer index, key inside the block)`` of a block's tensor; ``(None, name)`` for the others."""
    match = _LAYER_NAME.fullmatch(name)
    return (match.group(1), match.group(2)) if match else (None, name)


def _shapes(args: Qwen3ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every Tessera tensor's shape, by name, in the model's order."""
    dim, hd, q, kv = args.dim, args.head_dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    per_key: dict[str, tuple[int, ...]] = {
        "attention.wq.weight": (q, dim), "attention.wk.weight": (kv, dim), "attention.wv.weight": (kv, dim),
        "attention.wo.weight": (dim, q), "attention.q_norm.weight": (hd,), "attention.k_norm.weight": (hd,),
        "feed_forward.w1.weight": (args.ffn_hidden_size, dim), "feed_forward.w3.weight": (args.ffn_hidden_size, dim),
        "feed_forward.w2.weight": (dim, args.ffn_hidden_size),
        "attention_norm.weight": (dim,), "ffn_norm.weight": (dim,),
    }
    if args.moe is not None:
        e, h = args.moe.num_experts, args.moe.hidden_dim
        per_key.update({_EXPERT_BIAS: (e,), "feed_forward.router.gate.weight": (e, dim),
                        "feed_forward.experts.w1": (e, h, dim), "feed_forward.experts.w3": (e, h, dim),
                        "feed_forward.experts.w2": (e, dim, h)})
    top = {"tok_embeddings.weight": (args.vocab_size, dim), "norm.weight": (dim,),
           "output.weight": (args.vocab_size, dim)}
    return {name: top[name] if layer is None else per_key[key]
            for name, (layer, key) in ((n, _split(n)) for n in _tessera_names(args))}


def _hf_names(name: str, args: Qwen3ModelArgs) -> list[str]:
    """The Hugging Face tensors that hold the Tessera tensor ``name``: one, one per expert, or none."""
    layer, key = _split(name)
    if layer is None:
        if name == "output.weight" and args.tie_embeddings:
            return []
        return [_TOP_LEVEL[name]]
    if key in _EXPERTS:
        return [f"model.layers.{layer}.{_EXPERTS[key].format(e=e)}" for e in range(args.moe.num_experts)]
    if key == _EXPERT_BIAS:
        return []
    assert key in _ONE_TO_ONE, f"not a Qwen3 tensor: {name}"
    return [f"model.layers.{layer}.{_ONE_TO_ONE[key]}"]


def _is_qk_norm(name: str) -> bool:
    return name.endswith(("attention.q_norm.weight", "attention.k_norm.weight"))


def _norm_to_half(w: Tensor) -> Tensor:
    """A QK-norm weight ``[head_dim]`` in rotate-half order (the permutation of one head's rows)."""
    return _interleaved_to_half(w.view(-1, 1), 1).view(-1)


def _norm_to_interleaved(w: Tensor) -> Tensor:
    return _half_to_interleaved(w.view(-1, 1), 1).view(-1)


def _length(s: slice, n: int) -> int:
    return len(range(*s.indices(n)))


def _check_expressible(args: Qwen3ModelArgs, exporting: bool = False) -> None:
    """``ValueError`` unless Hugging Face's Qwen3 / Qwen3-MoE can hold ``Transformer(args)`` (``exporting``: and
    route as it does, which a model balanced by an expert bias does not)."""
    if exporting and args.moe is not None and args.moe.load_balance_coeff is not None:
        raise ValueError("model.flavor: Hugging Face's Qwen3-MoE routes without an expert bias; this flavor is "
                         "balanced by one (load_balance_coeff), so an export would route differently")
    if not args.qk_norm:
        raise ValueError("model.flavor: a Qwen3 model has QK-norm (qk_norm = True); this flavor has none")
    m = args.moe
    if m is not None and (m.num_shared_experts or m.score_func != "softmax" or m.route_scale != 1.0):
        raise ValueError(
            f"model.flavor: Hugging Face's Qwen3-MoE routes by softmax with no shared experts and no route scale; "
            f"this flavor has score_func {m.score_func}, {m.num_shared_experts} shared experts, route_scale "
            f"{m.route_scale}"
        )


def _int_field(config: dict[str, Any], key: str, field: str, *aliases: str) -> int:
    for k in (key, *aliases):
        value = config.get(k)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ValueError(f"{field}: config.json lacks a positive integer {key}")


def _read_rope_theta(config: dict[str, Any], field: str) -> float:
    """RoPE's base from a config.json (4.x ``rope_theta``/``rope_scaling`` or 5.x ``rope_parameters``); a scaled
    RoPE (YaRN and others) is refused."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{field}: config.json's rope_scaling/rope_parameters must be an object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"{field}: config.json has RoPE type {kind!r}; Tessera's Qwen3 supports only 'default'")
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def _dense_prefix(config: dict[str, Any], n_layers: int, field: str) -> int:
    """How many first blocks of a Qwen3-MoE config are dense (Hugging Face's rule: a block is sparse unless it is
    in mlp_only_layers or (index + 1) is not a multiple of decoder_sparse_step); any other pattern is refused."""
    only = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step", 1)
    if not isinstance(only, list) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{field}: config.json's mlp_only_layers must be a list and decoder_sparse_step a positive "
                         f"integer, got {only!r} and {step!r}")
    sparse = [i for i in range(n_layers) if i not in only and (i + 1) % step == 0]
    first = sparse[0] if sparse else n_layers
    if sparse != list(range(first, n_layers)):
        raise ValueError(
            f"{field}: config.json makes blocks {sparse} sparse (mlp_only_layers {only}, decoder_sparse_step "
            f"{step}); Tessera's Qwen3 supports every block sparse or the first ones dense, then all sparse"
        )
    return first


# config.json keys whose value must match the configured model: (key, Tessera's name for it in error messages, its
# value in Qwen3ModelArgs; None where the key does not apply).
_CHECKED_FIELDS: tuple[tuple[str, str, Callable[[Qwen3ModelArgs], Any]], ...] = (
    ("model_type", "model_type", lambda a: MODEL_TYPES[a.moe is not None]),
    ("hidden_size", "dim", lambda a: a.dim),
    ("num_hidden_layers", "n_layers", lambda a: a.n_layers),
    ("num_attention_heads", "n_heads", lambda a: a.n_heads),
    ("num_key_value_heads", "n_kv_heads", lambda a: a.n_kv_heads),
    ("head_dim", "head_dim", lambda a: a.head_dim),
    ("intermediate_size", "ffn_hidden",
     lambda a: a.ffn_hidden_size if a.moe is None or a.n_dense_layers else None),  # unused when all are sparse
    ("vocab_size", "vocab_size", lambda a: a.vocab_size),
    ("rms_norm_eps", "norm_eps", lambda a: a.norm_eps),
    ("rope_theta", "rope_theta", lambda a: a.rope_theta),
    ("tie_word_embeddings", "tie_embeddings", lambda a: a.tie_embeddings),
    ("num_experts", "moe.num_experts", lambda a: a.moe.num_experts if a.moe else None),
    ("num_experts_per_tok", "moe.top_k", lambda a: a.moe.top_k if a.moe else None),
    ("moe_intermediate_size", "moe.hidden_dim", lambda a: a.moe.hidden_dim if a.moe else None),
    ("norm_topk_prob", "moe.route_norm", lambda a: a.moe.route_norm if a.moe else None),
    ("mlp_only_layers (its dense first blocks)", "n_dense_layers", lambda a: a.n_dense_layers if a.moe else None),
)


class Qwen3HFAdapter:
    """Converts Tessera Qwen3 state dicts and configs to and from Hugging Face's ``Qwen3ForCausalLM`` and
    ``Qwen3MoeForCausalLM`` layouts.

    Stateless: every method is static and may be called on the class or on an instance.
    """

    @staticmethod
    def names(args: Qwen3ModelArgs) -> list[str]:
        """The Tessera name of every tensor of ``Transformer(args)``'s state dict, in the model's order (a tied
        ``output.weight`` included: the state dict holds it under both names)."""
        return _tessera_names(args)

    @staticmethod
    def shapes(args: Qwen3ModelArgs) -> dict[str, tuple[int, ...]]:
        """Every Tessera tensor's shape, by Tessera name, in the model's order."""
        return _shapes(args)

    @staticmethod
    def hf_names(name: str, args: Qwen3ModelArgs) -> list[str]:
        """The Hugging Face tensors the Tessera tensor ``name`` is stored as: one, one per expert (an expert
        stack), or none (a tied ``output.weight``, an ``expert_bias``)."""
        return _hf_names(name, args)

    @staticmethod
    def hf_name(name: str) -> str:
        """The Hugging Face name of the Tessera tensor ``name`` when it is stored as one tensor (``output.weight``:
        ``lm_head.weight``, as untied); ``ValueError`` for an expert stack or an expert bias (see ``hf_names``)."""
        layer, key = _split(name)
        if layer is None:
            return _TOP_LEVEL[name]
        if key not in _ONE_TO_ONE:
            raise ValueError(f"{name} is not stored as one Hugging Face tensor (see Qwen3HFAdapter.hf_names)")
        return f"model.layers.{layer}.{_ONE_TO_ONE[key]}"

    @staticmethod
    def tensors_to_hf(name: str, tensor: Tensor, args: Qwen3ModelArgs) -> dict[str, Tensor]:
        """The whole Tessera tensor ``name`` as the Hugging Face tensors ``hf_names`` gives (``wq``/``wk`` rows and
        QK-norm entries in rotate-half order, an expert stack split into its experts' views, others passed through
        uncopied), for exporting one tensor at a time. ``ValueError`` for a non-zero expert bias."""
        hf = _hf_names(name, args)
        layer, key = _split(name)
        if key == _EXPERT_BIAS:
            if torch.count_nonzero(tensor).item():
                raise ValueError(f"{name}: Hugging Face's Qwen3-MoE routes without an expert bias; this model's is "
                                 "not zero (trained with load_balance_coeff), so an export would route differently")
            return {}
        if key in _EXPERTS:
            return dict(zip(hf, tensor.unbind(0)))
        if not hf:
            return {}
        if _is_qk_norm(name):
            return {hf[0]: _norm_to_half(tensor)}
        return {hf[0]: Llama3HFAdapter.tensor_to_hf(name, tensor, args)}

    @staticmethod
    def tensor_to_hf(name: str, tensor: Tensor, args: Qwen3ModelArgs) -> Tensor:
        """``tensors_to_hf`` for a Tessera tensor stored as exactly one Hugging Face tensor (``ValueError`` for
        others)."""
        converted = Qwen3HFAdapter.tensors_to_hf(name, tensor, args)
        if len(converted) != 1:
            raise ValueError(f"{name} is stored as {len(converted)} Hugging Face tensors, not one (see tensors_to_hf)")
        return next(iter(converted.values()))

    @staticmethod
    def to_hf(state_dict: dict[str, Tensor], args: Qwen3ModelArgs) -> dict[str, Tensor]:
        """A Tessera state dict (full tensors; a tied ``output.weight`` may be left out) under Hugging Face names,
        in the layout ``tensors_to_hf`` gives."""
        _check_expressible(args)
        expected = _tessera_names(args)
        optional = {"output.weight"} if args.tie_embeddings else set()
        missing = set(expected) - set(state_dict) - optional
        unexpected = set(state_dict) - set(expected)
        assert not missing and not unexpected, (
            f"not a {args.n_layers}-layer Qwen3 state dict of this flavor: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
        hf: dict[str, Tensor] = {}
        for name in expected:
            if name in state_dict:
                hf.update(Qwen3HFAdapter.tensors_to_hf(name, state_dict[name], args))
        return hf

    @staticmethod
    def read_from_hf(
        name: str, box: tuple[slice, ...], read: Callable[[str, tuple[slice, ...]], Tensor], args: Qwen3ModelArgs
    ) -> Tensor:
        """The part ``box`` (one slice per dimension) of the Tessera tensor ``name``, as ``from_hf`` would give it,
        read through ``read(hf_name, slices)`` (the slices of one stored Hugging Face tensor): an expert stack's
        box is read expert by expert (only the experts, rows and columns it covers); a QK-norm weight whole
        (``head_dim`` entries), permuted, then cut; a tied ``output.weight`` is the embedding's; an expert bias
        is zeros."""
        layer, key = _split(name)
        if key == _EXPERT_BIAS:
            return torch.zeros(_length(box[0], args.moe.num_experts))
        if name == "output.weight" and args.tie_embeddings:
            return read(_TOP_LEVEL["tok_embeddings.weight"], box)
        if key in _EXPERTS:
            hf = _hf_names(name, args)
            experts = range(*box[0].indices(len(hf)))
            if not experts:  # FSDP gives some ranks no experts: an empty block in the stored dtype
                shape = _shapes(args)[name]
                stored = read(hf[0], tuple(slice(0, 0) for _ in box[1:]))
                return stored.new_empty((0, *(_length(s, n) for s, n in zip(box[1:], shape[1:]))))
            return torch.stack([read(hf[e], box[1:]) for e in experts])
        if _is_qk_norm(name):
            whole = read(_hf_names(name, args)[0], (slice(0, args.head_dim),))
            return _norm_to_interleaved(whole)[box[0]]
        if key in _ROUTER:
            return read(_hf_names(name, args)[0], box)
        return Llama3HFAdapter.read_from_hf(name, box, read, args)  # Llama 3's tensors, wq/wk by whole heads

    @staticmethod
    def from_hf(hf_state_dict: dict[str, Tensor], args: Qwen3ModelArgs) -> dict[str, Tensor]:
        """The inverse of ``to_hf``: a Hugging Face state dict (all of a checkpoint's tensors) as Tessera's state
        dict, ``output.weight`` included (the embedding, when tied) and a zero expert bias where the model has
        one."""
        expected = Qwen3HFAdapter.hf_shapes(args)
        assert set(hf_state_dict) == set(expected), (
            f"not a {args.n_layers}-layer Qwen3 checkpoint of this flavor: missing "
            f"{sorted(set(expected) - set(hf_state_dict))[:5]}, unexpected "
            f"{sorted(set(hf_state_dict) - set(expected))[:5]}"
        )

        def read(hf_name: str, box: tuple[slice, ...]) -> Tensor:
            return hf_state_dict[hf_name][box]

        return {name: Qwen3HFAdapter.read_from_hf(name, tuple(slice(0, n) for n in shape), read, args)
                for name, shape in _shapes(args).items()}

    @staticmethod
    def hf_shapes(args: Qwen3ModelArgs) -> dict[str, tuple[int, ...]]:
        """The shape of every tensor of the Hugging Face checkpoint of ``Transformer(args)``, by Hugging Face name,
        in the model's order (no ``lm_head.weight`` when tied; each expert's own tensors)."""
        if args.vocab_size <= 0:
            raise ValueError(f"model.vocab_size: must be set (positive), got {args.vocab_size}")
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in _shapes(args).items():
            hf = _hf_names(name, args)
            each = shape[1:] if _split(name)[1] in _EXPERTS else shape
            shapes.update({hf_name: each for hf_name in hf})
        return shapes

    @staticmethod
    def hf_config(
        args: Qwen3ModelArgs,
        dtype: torch.dtype = torch.bfloat16,
        bos_token_id: Optional[int] = None,
        eos_token_id: Optional[int] = None,
    ) -> dict[str, Any]:
        """The ``config.json`` of ``Qwen3ForCausalLM`` (dense) or ``Qwen3MoeForCausalLM`` for ``args``, with weights
        stored in ``dtype``; RoPE written in the 4.x keys (``rope_theta``, ``rope_scaling``) and 5.x's
        ``rope_parameters``, the dtype as ``torch_dtype`` (4.x) and ``dtype`` (5.x)."""
        if args.vocab_size <= 0:
            raise ValueError(f"model.vocab_size: must be set (positive) to export, got {args.vocab_size}")
        _check_expressible(args, exporting=True)
        moe = args.moe is not None
        dtype_name = str(dtype).removeprefix("torch.")
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[moe]],
            "model_type": MODEL_TYPES[moe],
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden_size,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
            "max_position_embeddings": args.max_seq_len,
            "vocab_size": args.vocab_size,
            "tie_word_embeddings": args.tie_embeddings,
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": args.n_layers,
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }
        if moe:
            config.update({
                "num_experts": args.moe.num_experts,
                "num_experts_per_tok": args.moe.top_k,
                "moe_intermediate_size": args.moe.hidden_dim,
                "norm_topk_prob": args.moe.route_norm,
                "decoder_sparse_step": 1,
                "mlp_only_layers": list(range(args.n_dense_layers)),
                "output_router_logits": False,
            })
        config.update({key: token for key, token in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id))
                       if token is not None})
        return config

    @staticmethod
    def args_from_hf_config(config: dict[str, Any], field: str = "config.json") -> Qwen3ModelArgs:
        """The ``Qwen3ModelArgs`` of a Hugging Face Qwen3 or Qwen3-MoE ``config.json`` (as a dict). Raises
        ``ValueError`` starting with ``field`` when the config describes a model Tessera's Qwen3 cannot hold
        (another architecture, biases, sliding-window attention, a scaled RoPE, sparse blocks other than all or
        all after the first ones, ...)."""
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES.values():
            raise ValueError(f"{field}: config.json has model_type {model_type!r}, not 'qwen3' or 'qwen3_moe'")
        moe = model_type == "qwen3_moe"
        dim = _int_field(config, "hidden_size", field)
        n_layers = _int_field(config, "num_hidden_layers", field)
        n_heads = _int_field(config, "num_attention_heads", field)
        unsupported = {
            "hidden_act": ("silu", config.get("hidden_act", "silu")),
            "attention_bias": (False, bool(config.get("attention_bias", False))),
            "use_sliding_window": (False, bool(config.get("use_sliding_window", False))),
        }
        for key, (supported, value) in unsupported.items():
            if value != supported:
                raise ValueError(f"{field}: config.json has {key} {value}; Tessera's Qwen3 supports only {supported}")
        n_dense = 0
        if moe:
            n_dense = _dense_prefix(config, n_layers, field)
            if n_dense == n_layers:
                raise ValueError(f"{field}: config.json's qwen3_moe model has no sparse block (mlp_only_layers, "
                                 "decoder_sparse_step); Tessera holds it as a dense qwen3 model only")
            experts = (_int_field(config, "num_experts", field, "num_local_experts"),
                       _int_field(config, "num_experts_per_tok", field),
                       _int_field(config, "moe_intermediate_size", field))
        vocab_size = _int_field(config, "vocab_size", field)
        ffn_hidden = _int_field(config, "intermediate_size", field)
        rope_theta = _read_rope_theta(config, field)
        try:
            moe_args = None
            if moe:
                moe_args = MoEArgs(num_experts=experts[0], top_k=experts[1], hidden_dim=experts[2],
                                   score_func="softmax", route_norm=bool(config.get("norm_topk_prob", False)),
                                   load_balance_coeff=None)
            return Qwen3ModelArgs(
                dim=dim,
                n_layers=n_layers,
                n_heads=n_heads,
                n_kv_heads=config.get("num_key_value_heads") or n_heads,
                vocab_size=vocab_size,
                head_dim_override=config.get("head_dim") or dim // n_heads,
                ffn_hidden=ffn_hidden,
                qk_norm=True,
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                moe=moe_args,
                n_dense_layers=n_dense,
                norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_seq_len=int(config.get("max_position_embeddings", 40960)),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"{field}: config.json describes an impossible Qwen3 model: {e}") from None

    @staticmethod
    def check_hf_config(
        config: dict[str, Any], args: Qwen3ModelArgs, field: str, model_label: Optional[str] = None
    ) -> None:
        """Check that the checkpoint whose config.json is ``config`` holds the model ``args`` builds: else a
        ``ValueError`` starting with ``field`` that names the first setting that differs (``model_label``: how the
        user named ``args``, e.g. ``model.flavor 8B``)."""
        theirs = Qwen3HFAdapter.args_from_hf_config(config, field)

        def differs(a: Any, b: Any) -> bool:
            return not math.isclose(a, b) if isinstance(a, float) and isinstance(b, float) else a != b

        for hf_key, name, value in _CHECKED_FIELDS:
            if differs(value(theirs), value(args)):
                raise ValueError(f"{field}: config.json has {hf_key} {value(theirs)} but "
                                 f"{model_label or 'the configured model'} has {name} {value(args)}")
