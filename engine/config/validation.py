"""Validation: every cross-field rule that needs neither the model's memory nor the data, run before anything is
allocated or written. ``validate`` returns the resolved ``Plan`` (the mesh degrees, gradient accumulation,
pipeline microbatches, the float8 layers) that the trainer, the dry run and the tools use as it is.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

import torch

from engine.config.errors import ConfigError, check_choice, check_positive, check_shard_split, is_hf_folder
from engine.config.schema import Config
from models.attention import BACKENDS, SDPA_BACKENDS, flash_attn_available
from models.registry import get_model_spec, model_names
from parallelize.compile import COMPILE_BACKENDS
from parallelize.float8 import check_float8_layers, check_float8_supported, cuda_capability
from parallelize.mesh import ParallelDims
from parallelize.pipeline_parallel import (SCHEDULES, V_SCHEDULES, check_schedule_csv, is_multi_stage, num_stages,
                                           split_backward_takes_custom_functions, splits_backward)

MAX_SEQ_LEN = 2**24  # sanity bounds: a value past them is a typo, and would fail later with a traceback
MAX_TIMEOUT_SECONDS = 10**8


@dataclass(frozen=True)
class Machine:
    """What validation assumes about the GPUs a run will have: this machine's (a launch), or the cluster's (a
    dry run, which plans on a CPU login node for GPUs it does not see)."""

    cuda: bool
    """CUDA GPUs are present."""
    cuda_capability: Optional[tuple[int, int]]
    """Their compute capability (float8 matmuls need >= 8.9); None without CUDA."""
    flash_attn: bool
    """A FlashAttention package these GPUs run is installed (4: flash-attn-4; 3: its Hopper build; 2: flash-attn)."""

    @staticmethod
    def this() -> "Machine":
        """This machine, as a launch here will find it."""

        cuda = torch.cuda.is_available()
        return Machine(cuda=cuda, cuda_capability=cuda_capability() if cuda else None,
                       flash_attn=flash_attn_available())


# What a dry run plans for: Hopper GPUs (H100) with flash-attn installed.
HOPPER = Machine(cuda=True, cuda_capability=(9, 0), flash_attn=True)


@dataclass(frozen=True)
class Plan:
    """What validation resolved from a config for its world; everything after it (the trainer, the dry run, the
    memory estimate, the planner) takes these values as they are."""

    dims: ParallelDims
    """The mesh degrees (dp_replicate, dp_shard, cp, tp, pp; ep carved from dp_shard x cp) and the world size."""
    grad_accum: int
    """Microbatches per optimizer step on each data-parallel rank (gradient accumulation)."""
    pp_microbatches: int
    """Pipeline microbatches per accumulation batch (1 without pipeline parallelism)."""
    float8_layers: Optional[tuple[int, int]]
    """With float8.enable: (linear layers converted, linear layers) of the whole model; else None."""
    resume: Any = None
    """The resume decision (engine.checkpoint.resume.ResumePlan), added by the entry point, which reads the run's
    checkpoints after validation; None: not decided (a dry run, a tool)."""


def validate(cfg: Config, world_size: int = 1, machine: Optional[Machine] = None, check_paths: bool = True) -> Plan:
    """Check every rule that does not need the model's memory or the data; return the resolved Plan. Raises
    ConfigError naming the field.

    ``machine``: the GPUs the run will have (default: this machine's). ``check_paths``: False skips the checks that
    the files and folders the layout does not depend on exist (assets, tokenizer, data, validation data, initial
    weights), for planning a cluster's run on a machine that lacks them; every other rule still applies."""

    machine = machine or Machine.this()

    if not cfg.job.dump_folder.strip():
        raise ConfigError("job.dump_folder: must not be empty")
    check_positive("job.owner_timeout_seconds", cfg.job.owner_timeout_seconds)
    if cfg.job.owner_timeout_seconds > MAX_TIMEOUT_SECONDS:
        raise ConfigError(f"job.owner_timeout_seconds: at most {MAX_TIMEOUT_SECONDS:,} seconds, got "
                          f"{cfg.job.owner_timeout_seconds:,}")

    # model
    check_choice("model.name", cfg.model.name, model_names())
    spec = get_model_spec(cfg.model.name)
    check_choice("model.flavor", cfg.model.flavor, list(spec.flavors))
    check_choice("model.attn", cfg.model.attn, BACKENDS)
    check_choice("model.attn_mask", cfg.model.attn_mask, ["causal", "block_causal"])
    if cfg.model.attn_mask == "block_causal" and cfg.model.attn != "flex":
        raise ConfigError("model.attn_mask: block_causal document masking needs model.attn = flex")
    if cfg.model.attn == "flash_attn":
        if not machine.flash_attn:
            raise ConfigError("model.attn: flash_attn is not installed for this GPU; pip install flash-attn-4 (Hopper, "
                              "Blackwell) or flash-attn, or use model.attn = sdpa")
        if not machine.cuda:
            raise ConfigError("model.attn: flash_attn needs a CUDA GPU; use model.attn = sdpa on this machine")
    check_choice("model.sdpa_backend", cfg.model.sdpa_backend, SDPA_BACKENDS)
    if cfg.model.sdpa_backend != "auto":
        if cfg.model.attn != "sdpa":
            raise ConfigError(f"model.sdpa_backend: picks the kernel of attn = sdpa, not of {cfg.model.attn}; "
                              "leave it at auto")
        if cfg.model.sdpa_backend in ("cudnn", "efficient") and not machine.cuda:
            raise ConfigError(f"model.sdpa_backend: {cfg.model.sdpa_backend} needs a CUDA GPU; use auto, flash or "
                              "math on this machine")
    if cfg.model.moe_aux_loss_coeff < 0:
        raise ConfigError(f"model.moe_aux_loss_coeff: must be >= 0, got {cfg.model.moe_aux_loss_coeff}")
    if cfg.model.moe_aux_loss_coeff and getattr(spec.flavors[cfg.model.flavor], "moe", None) is None:
        raise ConfigError(f"model.moe_aux_loss_coeff: {cfg.model.name}/{cfg.model.flavor} has no Mixture-of-Experts "
                          "blocks to balance; leave it at 0")
    if cfg.model.vocab_size != -1 and cfg.model.vocab_size <= 0:
        raise ConfigError(f"model.vocab_size: must be > 0 or -1, got {cfg.model.vocab_size}")
    if check_paths and cfg.model.hf_assets_path and not os.path.isdir(cfg.model.hf_assets_path):
        raise ConfigError(
            f"model.hf_assets_path: folder '{cfg.model.hf_assets_path}' not found; download the Hugging Face model's "
            f"tokenizer.json and config.json into it (hf download REPO tokenizer.json config.json --local-dir "
            f"{cfg.model.hf_assets_path}; the shipped configs name their REPO at the top), or leave it empty "
            "(--model.hf_assets_path=) for the built-in tokenizer")

    # data
    if cfg.data.path:
        if check_paths and not os.path.exists(cfg.data.path):
            raise ConfigError(f"data.path: '{cfg.data.path}' not found; give a json, jsonl, parquet or txt file or folder")
    elif not cfg.data.dataset:
        raise ConfigError("data.dataset: empty; name a built-in dataset (tessera_docs), a Hugging Face dataset, or set data.path")
    # A folder: its tokenizer.json is checked later.
    if check_paths and cfg.data.tokenizer and not os.path.exists(cfg.data.tokenizer):
        raise ConfigError(f"data.tokenizer: '{cfg.data.tokenizer}' not found; give a Hugging Face tokenizer.json or "
                          "the folder holding one")
    if not cfg.data.text_field:
        raise ConfigError("data.text_field: must not be empty")

    # training
    t = cfg.training
    check_positive("training.steps", t.steps)
    check_positive("training.seq_len", t.seq_len)
    if t.seq_len > MAX_SEQ_LEN:
        raise ConfigError(f"training.seq_len: at most {MAX_SEQ_LEN:,} tokens (2**24), got {t.seq_len:,}")
    check_positive("training.local_batch_size", t.local_batch_size)
    dims = validate_parallelism(cfg, world_size, spec, machine)
    dp = dims.dp
    ac, n_layers = cfg.activation_checkpoint, spec.flavors[cfg.model.flavor].n_layers
    if ac.mode == "selective" and ac.selective_option != "op" and int(ac.selective_option) > n_layers:
        raise ConfigError(
            f"activation_checkpoint.selective_option: {ac.selective_option} exceeds the {n_layers} layers of "
            f"{cfg.model.flavor}, and checkpointing every {ac.selective_option}-th block checkpoints the first one "
            f"only; give an N from 1 to {n_layers} (2 checkpoints every other block), or set "
            f"activation_checkpoint.mode to none"
        )
    check_positive("training.max_norm", t.max_norm)
    if t.gc_freq < 0:
        raise ConfigError(f"training.gc_freq: must be >= 0 (0 = Python's automatic collection), got {t.gc_freq}")
    check_choice("training.mixed_precision_param", t.mixed_precision_param, ["bfloat16", "float32"])
    check_choice("training.mixed_precision_reduce", t.mixed_precision_reduce, ["float32", "bfloat16"])
    if t.loss_chunk_tokens < 0:
        raise ConfigError(f"training.loss_chunk_tokens: must be >= 0 (0 = off), got {t.loss_chunk_tokens}")
    _validate_float8(cfg, machine)

    # compile
    if not cfg.compile.autotune and not cfg.compile.enable:
        raise ConfigError("compile.autotune: false applies to compiled kernels; set compile.enable = true as well, "
                          "or drop it")
    check_choice("compile.backend", cfg.compile.backend, list(COMPILE_BACKENDS))
    if cfg.compile.backend != "inductor":
        if not cfg.compile.enable:
            raise ConfigError(f"compile.backend: {cfg.compile.backend} applies to compiled blocks; set "
                              "compile.enable = true as well, or drop it")
        if not cfg.compile.autotune:
            raise ConfigError(f"compile.autotune: false applies to inductor's kernels, and compile.backend is "
                              f"{cfg.compile.backend}; drop compile.autotune, or set compile.backend = inductor")

    # optimizer
    o = cfg.optimizer
    check_choice("optimizer.name", o.name, ["AdamW", "Adam"])
    if o.lr < 0:
        raise ConfigError(f"optimizer.lr: must be >= 0, got {o.lr}")
    for key, beta in (("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"{key}: must be in [0, 1), got {beta}")
    check_positive("optimizer.eps", o.eps)
    if o.weight_decay < 0:
        raise ConfigError(f"optimizer.weight_decay: must be >= 0, got {o.weight_decay}")
    check_choice("optimizer.implementation", o.implementation, ["auto", "fused", "foreach", "for-loop"])

    # lr schedule
    s = cfg.lr_scheduler
    if s.warmup_steps < 0:
        raise ConfigError(f"lr_scheduler.warmup_steps: must be >= 0, got {s.warmup_steps}")
    if s.decay_ratio != -1.0 and not 0.0 <= s.decay_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_ratio: must be in [0, 1] or -1, got {s.decay_ratio}")
    check_choice("lr_scheduler.decay_type", s.decay_type, ["linear", "cosine", "sqrt"])
    if not 0.0 <= s.min_lr_factor <= 1.0:
        raise ConfigError(f"lr_scheduler.min_lr_factor: must be in [0, 1], got {s.min_lr_factor}")

    # validation
    v = cfg.validation
    check_positive("validation.freq", v.freq)
    check_positive("validation.steps", v.steps)
    if v.enable and v.freq > t.steps:  # it validates at the multiples of freq
        raise ConfigError(f"validation.freq: {v.freq} exceeds training.steps = {t.steps}, so validation would never "
                          f"run; set validation.freq to at most {t.steps}, or turn validation.enable off")
    if v.dataset_config and not v.dataset:
        raise ConfigError(f"validation.dataset_config: '{v.dataset_config}' is set without validation.dataset; set "
                          "validation.dataset too (validation reading data.dataset takes data.dataset_config)")
    if check_paths and v.path and not os.path.exists(v.path):
        raise ConfigError(f"validation.path: '{v.path}' not found; give a json, jsonl, parquet or txt file or folder")

    # checkpoint
    c = cfg.checkpoint
    check_positive("checkpoint.interval", c.interval)
    if c.keep_latest_k < 0:
        raise ConfigError(f"checkpoint.keep_latest_k: must be >= 0 (0 keeps all), got {c.keep_latest_k}")
    if c.load_step < -1:
        raise ConfigError(f"checkpoint.load_step: must be >= 0, or -1 for the newest, got {c.load_step}")
    check_choice("checkpoint.async_mode", c.async_mode, ["disabled", "async", "async_with_pinned_mem"])
    check_choice("checkpoint.export_dtype", c.export_dtype, ["float32", "bfloat16", "float16"])
    if not c.folder.strip():
        raise ConfigError("checkpoint.folder: must not be empty")
    if check_paths and c.initial_load_path and not os.path.isdir(c.initial_load_path):
        raise ConfigError(f"checkpoint.initial_load_path: folder '{c.initial_load_path}' not found")
    if c.initial_load_hf and not c.initial_load_path:
        raise ConfigError("checkpoint.initial_load_hf: no folder to load; set checkpoint.initial_load_path to the "
                          "Hugging Face folder (config.json + safetensors)")
    if check_paths and c.initial_load_hf and not is_hf_folder(c.initial_load_path):
        raise ConfigError(f"checkpoint.initial_load_hf: '{c.initial_load_path}' (checkpoint.initial_load_path) has no "
                          "config.json, so it is not a Hugging Face folder; give the folder that holds config.json "
                          "and the .safetensors files, or set checkpoint.initial_load_hf = false for a Tessera step "
                          "folder")
    if c.initial_load_path and c.create_seed_checkpoint:
        raise ConfigError("checkpoint.initial_load_path: a seed checkpoint (checkpoint.create_seed_checkpoint) is the "
                          "freshly initialized model, not loaded weights; drop one of the two (python -m "
                          "tools.convert_hf from-hf turns a Hugging Face folder into a checkpoint)")
    for part in c.exclude_from_loading:
        check_choice("checkpoint.exclude_from_loading", part, ["dataloader"])
    if c.load_step != -1 and not c.enable:
        raise ConfigError(f"checkpoint.load_step: loading step {c.load_step} needs checkpoint.enable = true (it reads "
                          "this run's checkpoint folder); for initial weights use checkpoint.initial_load_path")
    for key in ("last_save_hf", "last_save_model_only"):
        if getattr(c, key) and not c.enable:
            raise ConfigError(f"checkpoint.{key}: the export is made from the last step's checkpoint; set "
                              "checkpoint.enable = true as well")
    if cfg.data.num_shards != -1:
        check_positive("data.num_shards", cfg.data.num_shards)
        check_shard_split(cfg.data.num_shards, dp, "the data is split into", f"use a multiple of {dp}")

    # profiling, comm
    pr = cfg.profiling
    check_positive("profiling.profile_freq", pr.profile_freq)
    check_positive("profiling.profiler_active", pr.profiler_active)
    if pr.profiler_warmup < 0:
        raise ConfigError(f"profiling.profiler_warmup: must be >= 0, got {pr.profiler_warmup}")
    if pr.enable_profiling and pr.profiler_warmup + pr.profiler_active > pr.profile_freq:
        raise ConfigError(
            f"profiling.profile_freq: {pr.profile_freq} is shorter than profiler_warmup + profiler_active = "
            f"{pr.profiler_warmup} + {pr.profiler_active}; raise it or shorten the warm-up"
        )
    if pr.enable_profiling and pr.profile_freq > cfg.training.steps:
        raise ConfigError(
            f"profiling.profile_freq: {pr.profile_freq} exceeds training.steps = {cfg.training.steps}, so no step "
            f"would be traced; set profiling.profile_freq to at most {cfg.training.steps}, or turn "
            "profiling.enable_profiling off"
        )
    for key in ("save_traces_folder", "save_memory_snapshot_folder"):
        if not getattr(pr, key).strip():
            raise ConfigError(f"profiling.{key}: must not be empty")
    if pr.enable_memory_snapshot and not machine.cuda:
        raise ConfigError("profiling.enable_memory_snapshot: records the CUDA caching allocator and needs CUDA "
                          "GPUs; turn it off on this machine (profiling.enable_profiling traces CPU runs)")
    for key in ("init_timeout_seconds", "train_timeout_seconds", "checkpoint_timeout_seconds"):
        seconds = getattr(cfg.comm, key)
        check_positive(f"comm.{key}", seconds)
        if seconds > MAX_TIMEOUT_SECONDS:  # Python's timedelta, which the collectives take, stops at 10**9 days
            raise ConfigError(f"comm.{key}: at most {MAX_TIMEOUT_SECONDS:,} seconds (about 3 years), got {seconds:,}")
    if cfg.comm.trace_buf_size < 0:
        raise ConfigError(f"comm.trace_buf_size: must be >= 0 (0 = off), got {cfg.comm.trace_buf_size}")

    # metrics, debug
    check_positive("metrics.log_freq", cfg.metrics.log_freq)
    check_choice("metrics.wandb_mode", cfg.metrics.wandb_mode, ["auto", "online", "offline", "disabled"])
    if cfg.metrics.wandb_rewind and not cfg.metrics.enable_wandb:
        raise ConfigError("metrics.wandb_rewind: rewinds the run's wandb run; set metrics.enable_wandb = true as "
                          "well, or drop it")
    if cfg.metrics.peak_flops != -1.0:
        check_positive("metrics.peak_flops", cfg.metrics.peak_flops)
    if not 0 <= cfg.debug.seed <= 2**32 - 1:  # what torch.manual_seed and numpy take
        raise ConfigError(f"debug.seed: must be in [0, 2**32 - 1], got {cfg.debug.seed}")
    return Plan(dims=dims, grad_accum=grad_accumulation_steps(cfg, dp),
                pp_microbatches=pp_microbatches(cfg, dims) if dims.pp > 1 else 1,
                float8_layers=float8_layers(cfg.model.name, cfg.model.flavor, tuple(cfg.float8.filter_fqns), dims.tp)
                if cfg.float8.enable else None)


def validate_parallelism(cfg: Config, world_size: int, spec, machine: Optional[Machine] = None):
    """The parallel layout: degrees, their product, and the model shapes they must divide."""

    p, t = cfg.parallelism, cfg.training
    _validate_values(cfg)
    dims = ParallelDims.from_config(p, world_size)
    if t.global_batch_size != -1:  # gradient accumulation: whole local batches on every data-parallel rank
        check_positive("training.global_batch_size", t.global_batch_size)
        if t.global_batch_size % (t.local_batch_size * dims.dp):
            raise ConfigError(
                f"training.global_batch_size: {t.global_batch_size} is not a multiple of local_batch_size x dp "
                f"= {t.local_batch_size} x {dims.dp}"
            )
    args = spec.flavors[cfg.model.flavor]
    if dims.tp > 1:
        for name, heads in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads)):
            if heads % dims.tp:
                raise ConfigError(
                    f"parallelism.tp: {dims.tp} does not divide the {cfg.model.flavor} flavor's {name} = {heads}; "
                    f"tensor parallelism gives each rank whole heads (KV heads are not replicated), so pick a tp "
                    f"that divides {args.n_kv_heads}"
                )
    _validate_model_layout(cfg, dims, args)
    cuda = (machine or Machine.this()).cuda
    if p.enable_async_tp:
        if dims.tp == 1 or not cfg.compile.enable or cfg.compile.backend != "inductor" or not cuda:
            raise ConfigError(
                "parallelism.enable_async_tp: needs parallelism.tp > 1, compile.enable (compile.backend inductor) and "
                "CUDA GPUs"
            )
    if p.fsdp_cpu_offload:
        if not cuda:
            raise ConfigError("parallelism.fsdp_cpu_offload: offloading to CPU memory needs CUDA GPUs")
        if not dims.data_parallel:
            raise ConfigError("parallelism.fsdp_cpu_offload: FSDP does the offloading, and this layout has no FSDP; "
                              "set parallelism.fsdp_single_rank = true on one GPU, or use data parallelism")
    if t.fsdp_bf16_weights:
        _validate_fsdp_bf16_weights(cfg, dims)
    if dims.pp > 1:
        _validate_pipeline(cfg, dims, args)
    if dims.cp > 1:
        if cfg.model.attn not in ("sdpa", "flex"):
            raise ConfigError("model.attn: context parallelism runs its own ring attention; use model.attn = sdpa "
                              "(or flex, with model.attn_mask = block_causal)")
        if cfg.model.sdpa_backend != "auto":
            raise ConfigError("model.sdpa_backend: context parallelism's ring attention calls its kernels directly; "
                              "leave it at auto")
    chunks = 2 * dims.cp * dims.tp if dims.cp > 1 else dims.tp
    if cfg.training.seq_len % chunks:
        raise ConfigError(
            f"training.seq_len: {cfg.training.seq_len} is not divisible by 2 x cp x tp = {chunks} (context "
            f"parallelism cuts each sequence into 2 x cp chunks, sequence parallelism each chunk into tp)"
        )
    return dims


def _validate_model_layout(cfg: Config, dims: ParallelDims, args) -> None:
    """What a flavor's Mixture-of-Experts blocks cannot be split by, and what ep needs."""
    flavor = f"{cfg.model.name}/{cfg.model.flavor}"
    moe = getattr(args, "moe", None)
    if dims.ep > 1:
        if moe is None:
            raise ConfigError(f"parallelism.ep: {flavor} has no Mixture-of-Experts blocks to spread over ranks; set "
                              "parallelism.ep = 1, or pick a MoE flavor")
        if moe.num_experts % dims.ep:
            raise ConfigError(f"parallelism.ep: {dims.ep} does not divide {flavor}'s {moe.num_experts} experts; pick "
                              "an ep that does, so that every rank holds as many experts")
    if moe is not None and dims.tp > 1 and not dims.data_parallel:
        raise ConfigError(f"parallelism.tp: {flavor} runs its Mixture-of-Experts layers on each tensor-parallel "
                          "rank's own tokens, sharded by FSDP over those ranks, which needs data parallelism; set "
                          "parallelism.dp_shard >= 2 (or dp_replicate), or parallelism.tp = 1")


def _validate_values(cfg: Config) -> None:
    """The parallelism and activation checkpointing options' own values (names, signs), whether or not the layout
    uses them: a config valid at pp = 1 stays valid at pp = 2 as far as they go."""

    p = cfg.parallelism
    check_choice("parallelism.fsdp_reshard_after_forward", p.fsdp_reshard_after_forward, ["default", "always", "never"])
    check_choice("parallelism.pp_schedule", p.pp_schedule, list(SCHEDULES))
    if p.pp_schedule_csv and not os.path.isfile(p.pp_schedule_csv):
        raise ConfigError(f"parallelism.pp_schedule_csv: file '{p.pp_schedule_csv}' not found")
    check_positive("parallelism.pp_virtual_stages", p.pp_virtual_stages)
    if p.pp_microbatches != -1 and p.pp_microbatches < 1:
        raise ConfigError(f"parallelism.pp_microbatches: must be >= 1 or -1, got {p.pp_microbatches}")
    if any(n < 0 for n in p.pp_layers_per_stage):
        raise ConfigError(f"parallelism.pp_layers_per_stage: layer counts must be >= 0, got {p.pp_layers_per_stage}")
    check_choice("parallelism.cp_rotate", p.cp_rotate, ["allgather", "alltoall"])
    ac = cfg.activation_checkpoint
    check_choice("activation_checkpoint.mode", ac.mode, ["none", "full", "selective"])
    check_choice("activation_checkpoint.op_matmuls", ac.op_matmuls, ["all", "alternate"])
    if ac.selective_option != "op":
        try:
            every = int(ac.selective_option)
        except ValueError:
            every = 0
        if every <= 0:
            raise ConfigError(
                f"activation_checkpoint.selective_option: {ac.selective_option!r} is neither \"op\" nor a "
                f"positive integer N (checkpoint every N-th block)"
            )


def _validate_float8(cfg: Config, machine: Machine) -> None:
    """float8: the recipe and its options, then whether this machine can run it (torchao installed; a GPU
    with float8 matmuls, unless emulated)."""
    f8 = cfg.float8
    check_choice("float8.recipe", f8.recipe, ["tensorwise", "rowwise"])
    if any(not name.strip() for name in f8.filter_fqns):
        raise ConfigError("float8.filter_fqns: an empty name would match every layer; list layer names such as attention.wk")
    if not f8.enable:
        return
    if f8.fsdp_float8_all_gather and f8.recipe != "tensorwise":
        raise ConfigError(
            f"float8.fsdp_float8_all_gather: the FSDP float8 all-gather needs float8.recipe = tensorwise (got "
            f"{f8.recipe}); turn it off for {f8.recipe}"
        )
    if f8.precompute_scale and not f8.fsdp_float8_all_gather:
        raise ConfigError(
            "float8.precompute_scale: it precomputes the scales of the FSDP float8 all-gather; set "
            "float8.fsdp_float8_all_gather = true, or turn it off"
        )

    check_float8_supported(f8.emulate, machine.cuda_capability)


def _check_split_backward(cfg: Config) -> None:
    """A zero-bubble schedule runs each stage's backward in two passes (input gradients, later the weights'),
    both through the same autograd graph, the weight pass as one ``autograd.grad`` call per group of weights.
    Features that cannot run their part of that graph again, or would redo their whole backward in each call,
    are refused."""

    p, ac = cfg.parallelism, cfg.activation_checkpoint
    field = "parallelism.pp_schedule_csv" if p.pp_schedule_csv else "parallelism.pp_schedule"
    head = f"{field}: {p.pp_schedule_csv or p.pp_schedule} splits the backward into input and weight passes"
    fix = ("use a CSV schedule with whole backwards (B) instead of I and W actions, or" if p.pp_schedule_csv else
           "use GPipe, 1F1B, Interleaved1F1B or LoopedBFS, or")
    if cfg.compile.enable:  # a compiled block's backward donates its buffers: it may run once per forward
        raise ConfigError(
            f"{head}, and a compiled block's backward (compile.enable) runs only once per forward; {fix} turn "
            f"compile.enable off"
        )
    if ac.mode == "selective" and ac.selective_option == "op":  # the saved activations serve one backward
        raise ConfigError(
            f"{head}, and per-op selective activation checkpointing keeps its saved activations for one backward "
            f"pass only; {fix} set activation_checkpoint.mode to none"
        )
    if ac.mode != "none":  # each autograd.grad call is a new graph task: checkpoint recomputes per task
        raise ConfigError(
            f"{head}, and activation checkpointing ({ac.mode}) recomputes a block's forward for the input pass "
            f"and again for each weight group of the weight pass (10x the forwards); {fix} set "
            f"activation_checkpoint.mode to none"
        )
    if cfg.float8.enable:  # torchao's float8 matmul is one autograd node: both its gradients, in each pass
        raise ConfigError(
            f"{head}, but float8 linear layers (float8.enable) compute both gradients in each pass (twice the "
            f"backward matmuls, so the split saves nothing); {fix} turn float8.enable off"
        )
    # The fused loss's node takes the output weight directly: the weight pass goes through its Python function
    # (its backward only scales the gradients its forward computed, so running it twice costs nothing).
    if cfg.training.loss_chunk_tokens and not split_backward_takes_custom_functions():
        raise ConfigError(
            f"{head}, which torch {torch.__version__} cannot run through the fused output loss "
            f"(training.loss_chunk_tokens; torch 2.13 can); {fix} set training.loss_chunk_tokens to 0"
        )


def _validate_pipeline(cfg: Config, dims, args) -> None:

    p = cfg.parallelism
    if get_model_spec(cfg.model.name).pipeline_fn is None:
        raise ConfigError(f"parallelism.pp: model {cfg.model.name!r} has no pipeline split (its ModelSpec registers "
                          "no pipeline_fn); set parallelism.pp = 1")
    stages = num_stages(dims.pp, p.pp_schedule, p.pp_virtual_stages)
    if p.pp_layers_per_stage:
        if len(p.pp_layers_per_stage) != stages or sum(p.pp_layers_per_stage) != args.n_layers:
            raise ConfigError(
                f"parallelism.pp_layers_per_stage: {p.pp_layers_per_stage} must list {stages} stages adding up "
                f"to the {args.n_layers} layers of {cfg.model.flavor}"
            )
        if any(n == 0 for n in p.pp_layers_per_stage[1:-1]):
            raise ConfigError(
                f"parallelism.pp_layers_per_stage: {p.pp_layers_per_stage} leaves a middle stage without layers "
                "(only the first and last stages, which hold the embedding and the output, may have 0)"
            )
    elif stages > args.n_layers + 2:

        if not is_multi_stage(p.pp_schedule):
            fix = "lower parallelism.pp"
        elif p.pp_schedule in V_SCHEDULES:  # two stages per rank, whatever pp_virtual_stages says
            fix = "lower parallelism.pp, or use a schedule of one stage per rank (1F1B, GPipe)"
        else:
            fix = "lower parallelism.pp or parallelism.pp_virtual_stages"
        raise ConfigError(
            f"parallelism.pp: {stages} pipeline stages ({p.pp_schedule} on pp = {dims.pp}) but {cfg.model.flavor} "
            f"has only {args.n_layers} layers (plus the embedding and the output, which may be stages of their "
            f"own); {fix}"
        )
    if splits_backward(p.pp_schedule, p.pp_schedule_csv):
        _check_split_backward(cfg)
    micro = p.pp_microbatches if p.pp_microbatches != -1 else stages
    # One schedule step runs the microbatches of every gradient-accumulation batch of the optimizer step.
    accum = grad_accumulation_steps(cfg, dims.dp)
    total = micro * accum
    got = f"{total} ({micro} x {accum} gradient accumulation batches)" if accum > 1 else f"{total}"
    if total < dims.pp:
        raise ConfigError(
            f"parallelism.pp_microbatches: {got} microbatches per step cannot keep {dims.pp} pipeline ranks busy; "
            f"use at least {-(-dims.pp // accum)}"
        )
    if p.pp_schedule in ("Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS") and total % dims.pp:
        raise ConfigError(
            f"parallelism.pp_microbatches: {p.pp_schedule} needs a multiple of pp = {dims.pp} microbatches per "
            f"step, got {got}"
        )
    if p.pp_schedule == "DualPipeV" and not p.pp_schedule_csv and total < stages:
        raise ConfigError(
            f"parallelism.pp_microbatches: DualPipeV needs at least as many microbatches per step as stages "
            f"({stages} on pp = {dims.pp}), got {got}"
        )
    if p.pp_schedule_csv:

        try:
            check_schedule_csv(p.pp_schedule_csv, dims.pp, p.pp_schedule, p.pp_virtual_stages, micro, accum)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.training.local_batch_size % micro:
        raise ConfigError(
            f"training.local_batch_size: {cfg.training.local_batch_size} samples do not split into "
            f"{micro} pipeline microbatches (parallelism.pp_microbatches)"
        )


def pp_microbatches(cfg: Config, dims) -> int:

    p = cfg.parallelism
    if p.pp_microbatches != -1:
        return p.pp_microbatches
    return num_stages(dims.pp, p.pp_schedule, p.pp_virtual_stages)


def _validate_fsdp_bf16_weights(cfg: Config, dims) -> None:
    """training.fsdp_bf16_weights: FSDP2 with bf16 parameters, and none of what it does not cover."""
    t, p = cfg.training, cfg.parallelism
    if not dims.data_parallel:
        raise ConfigError("training.fsdp_bf16_weights: splits FSDP2's parameter shards, and this layout has no FSDP; "
                          "set parallelism.fsdp_single_rank = true on one GPU, or use data parallelism")
    if t.mixed_precision_param != "bfloat16":
        raise ConfigError(f"training.fsdp_bf16_weights: needs training.mixed_precision_param = bfloat16 (got "
                          f"{t.mixed_precision_param})")
    conflicts = [f"{name} ({why})" for name, on, why in (
        ("parallelism.fsdp_cpu_offload", p.fsdp_cpu_offload, "the shards would be updated on the CPU"),
        ("float8.fsdp_float8_all_gather", cfg.float8.enable and cfg.float8.fsdp_float8_all_gather,
         "its all-gather casts fp32 shards"),
        ("gradient accumulation (training.global_batch_size)", grad_accumulation_steps(cfg, dims.dp) > 1,
         "each batch's sharded gradients would be added up in bf16"),
    ) if on]
    if conflicts:
        raise ConfigError(f"training.fsdp_bf16_weights: not with {'; '.join(conflicts)}; turn it off for this "
                          "layout")


def grad_accumulation_steps(cfg: Config, dp: int) -> int:
    """Microbatches per optimizer step on each data-parallel rank."""
    t = cfg.training
    if t.global_batch_size == -1:
        return 1
    return t.global_batch_size // (t.local_batch_size * dp)


@lru_cache(maxsize=64)
def float8_layers(name: str, flavor: str, filter_fqns: tuple[str, ...], tp: int) -> tuple[int, int]:
    """(linear layers converted, linear layers) under float8 for the model ``name``/``flavor``, built on the meta
    device (no memory): float8.filter_fqns must name linear layers and leave some to convert. Cached: the planner
    asks for many layouts of one model."""
    spec = get_model_spec(name)
    args = spec.flavors[flavor]
    vocab = args.vocab_size if args.vocab_size > 0 else 4096  # the layer names do not depend on it
    with torch.device("meta"):
        model = spec.model_cls(dataclasses.replace(args, vocab_size=vocab))
    return check_float8_layers(model, filter_fqns, tp)
