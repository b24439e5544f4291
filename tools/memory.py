"""Per-rank GPU memory of a training layout: the estimate, its per-rank table, and the command line.

    python -m tools.memory --config FILE [--ngpu W] [--gpu-memory-gib G] [--section.key value ...]

prints one row per pipeline rank (ranks of one pipeline stage are symmetric) for any layout, one GPU included.
The formulas (what is counted, the shapes, the activation bytes per token) are in tools/memory_formulas.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import Optional

from models.registry import get_model_spec
# Re-exported with the table's own names: the dry run, the planner and the tests read all of them as memory.X.
from tools.memory_formulas import (GIB, DEFAULT_GPU_MEMORY_GIB, ModelShape, PartSizes, Precision, RankLayout,  # noqa: F401
                                   StageParams, block_bytes_per_token, block_backward_bytes_per_token, block_kinds,
                                   block_tensors, final_bytes_per_token, in_flight_chunks, layout_precision,
                                   loss_bytes, precision_for, rank_layout, stage_params, _saved_blocks)

# --------------------------------------------------------------------------------------------------------
# The estimate
# --------------------------------------------------------------------------------------------------------


@dataclass
class Moment:
    """Memory at one moment of a step, by kind (bytes); the fp32 params and optimizer state are always there."""

    grads: float = 0
    """Gradients alive (sharded fp32, or FSDP's unsharded root gradients)."""
    working: float = 0
    """Compute copies of the weights (bf16 all-gathers or autocast casts, unsharded accumulators)."""
    activations: float = 0
    """Activations saved for backward, every in-flight microbatch included."""
    other: float = 0
    """Buffers of the moment: loss, logits, a recomputed block, reduce-scatter copies."""

    @property
    def total(self) -> float:
        return self.grads + self.working + self.activations + self.other


@dataclass
class MemoryEstimate:
    """One rank's memory in bytes: the sizes of params, grads and optimizer state, and the peak, which is the
    largest ``moments`` entry plus the params and optimizer state."""

    params: int
    grads: int
    optimizer: int
    moments: dict[str, Moment]
    phase: str
    """The moment of the peak: loss, forward, recompute or backward end."""

    @property
    def at_peak(self) -> Moment:
        return self.moments[self.phase]

    @property
    def peak(self) -> int:
        return int(self.params + self.optimizer + self.at_peak.total)


def estimate(shape: ModelShape, stages: list[StageParams], lay: RankLayout) -> MemoryEstimate:
    """The memory of one rank holding ``stages`` (its pipeline stages) under ``lay``."""
    pr = lay.precision
    T = lay.tokens
    held = PartSizes()
    root = PartSizes()
    for s in stages:
        held = held + s.total
        root = root + s.root
    P = held.local
    split = pr.split_weights  # one rank: local elements are whole (local == tp)

    def grad_bytes(part: PartSizes) -> int:
        """Gradients of ``part``: fp32, but bf16 on split bf16 matmul weights or split FSDP shards."""
        if pr.bf16_grads:
            return 2 * part.local
        return 4 * part.local - (2 * part.matmul_tp if split else 0)

    params = 0 if lay.cpu_offload else 4 * P
    optimizer = 0 if lay.cpu_offload else 4 * lay.optimizer_states * P
    grads = 0 if lay.cpu_offload else grad_bytes(held)
    has_last = any(s.final is not None for s in stages)
    block = next((s.block for s in stages if s.layers), stages[0].block)
    kinds: dict[str, int] = {}
    for s in stages:
        for kind, n in block_kinds(s.layers, lay).items():
            kinds[kind] = kinds.get(kind, 0) + n
    n_blocks = sum(kinds.values())
    checkpointed = {k: n for k, n in kinds.items() if k != "none" and n}
    autocast = pr.casts_weights
    all_mm = sum(s.block.matmul_tp * s.layers + (s.final.matmul_tp if s.final else 0) for s in stages)
    # Under PP the whole schedule step (forwards and backwards) runs in one autocast region, so autocast's cache
    # keeps the bf16 copy of every matmul weight (checkpointed blocks' too) from its first cast to the step's end;
    # every microbatch shares it. Compiled blocks cast inside their graphs, not through the cache.
    step_cache = autocast and lay.pp > 1 and not lay.compiled

    def saved(stage: StageParams) -> float:
        """Activations one microbatch leaves in ``stage``."""
        total = _saved_blocks(shape, lay, block_kinds(stage.layers, lay)) * T
        if stage.embedding is not None:
            total += 8 * T
        if stage.final is not None:
            total += final_bytes_per_token(shape, lay) * T
        return total

    chunk = sum(saved(s) for s in stages) / len(stages)  # one microbatch-stage chunk, on average
    activations = chunk * in_flight_chunks(lay)

    # Gradients alive before this backward: accumulation over microbatches keeps them.
    pp_fsdp = lay.fsdp and lay.pp > 1 and lay.microbatches > 1
    grads_early = grads if (lay.grad_accum > 1 or (lay.pp > 1 and lay.microbatches > 1 and not lay.fsdp)) else 0

    # Compute copies of the weights held at the loss.
    if pp_fsdp:  # the stage stays unsharded (bf16) with fp32 unsharded gradient accumulators
        working = pr.working * held.tp + 4 * held.tp
    elif lay.fsdp:
        blocks = {"always": 1, "default": 2, "never": n_blocks}[lay.reshard_after_forward]
        root_held = 0 if lay.reshard_after_forward == "always" else root.tp
        working = pr.working * (root_held + min(blocks, n_blocks) * block.tp)
    elif step_cache:  # autocast's cache: a bf16 copy of every matmul weight, all step
        working = pr.working * all_mm
    elif autocast:  # a bf16 copy of every matmul weight outside checkpointed blocks
        final_mm = sum(s.final.matmul_tp for s in stages if s.final is not None)
        working = pr.working * (kinds.get("none", 0) * block.matmul_tp + final_mm)
    else:  # fp32, or split bf16 weights: the matmuls read the (bf16) parameters, nothing is cast
        working = 0

    moments: dict[str, Moment] = {}
    loss = loss_bytes(shape, lay, T) if has_last else 0
    moments["loss"] = Moment(grads_early, working, activations, loss)

    if autocast or split:  # the end of the forward: autocast's cache holds every bf16 weight copy made in eager code
        logits = pr.compute * shape.vocab_size / lay.tp * T if has_last and not lay.loss_chunk_tokens else 0
        # compiled blocks cast inside their graphs: they keep the copies of blocks without AC only
        cached = working if lay.compiled or split else pr.working * all_mm
        moments["forward"] = Moment(grads_early, cached, activations, logits)

    if checkpointed:  # a checkpointed block recomputed in backward, at the first and at the last one
        own = max(block_bytes_per_token(shape, lay, k) for k in checkpointed)  # what that block kept
        fresh = block_bytes_per_token(shape, lay, "none") - own  # what its recomputation adds to it
        recompute = (fresh + block_backward_bytes_per_token(shape, lay)) * T
        if autocast and not step_cache:  # the recomputed block casts its weights again
            recompute += pr.working * block.matmul_tp
        others = activations - chunk  # other microbatches still in flight
        kept = _saved_blocks(shape, lay, checkpointed) * T
        first_in = own * T
        if lay.fsdp and not pp_fsdp:  # FSDP reduces the root's (unsharded) gradients at the very end
            root_grads = pr.compute * root.tp
        else:
            root_grads = grad_bytes(root)
        if grads_early:
            top = bottom = grads_early + (root_grads if lay.fsdp and not pp_fsdp else 0)
        else:
            top, bottom = root_grads, root_grads + grad_bytes(block) * max(n_blocks - 1, 0)
        if autocast and not step_cache:  # blocks without checkpointing keep their weight copies until their backward
            at_top_working, at_bottom_working = pr.working * kinds.get("none", 0) * block.matmul_tp, 0
        else:
            at_top_working = at_bottom_working = working
        at_top = Moment(top, at_top_working, others + kept, recompute)
        at_bottom = Moment(bottom, at_bottom_working, others + first_in, recompute)
        moments["recompute"] = max(at_top, at_bottom, key=lambda m: m.total)

    if pp_fsdp:
        moments["backward end"] = Moment(grads, working, 0, 4 * block.tp)
    elif lay.fsdp:  # the root's reduce-scatter; FSDP2 frees the root's unsharded params before it
        # First the unsharded gradients and the reduce-scatter's fp32 input they are copied into; then (the
        # gradients freed) the input and the output, which is the root's sharded gradient (counted in grads
        # until now; with CPU offload it is copied out from there).
        root_sharded = 0 if lay.cpu_offload else grad_bytes(root)
        reduce = max((pr.compute + 4) * root.tp, 4 * root.tp + 4 * root.local)
        moments["backward end"] = Moment(grads - root_sharded, 0, 0, reduce)
    else:
        moments["backward end"] = Moment(grads)

    phase = max(moments, key=lambda k: moments[k].total)
    return MemoryEstimate(params, grads, optimizer, moments, phase)


# --------------------------------------------------------------------------------------------------------
# Rows of the per-rank table (shared with the dry run)
# --------------------------------------------------------------------------------------------------------


@dataclass
class RankRow:
    """One pipeline rank of the table."""

    pp_rank: int
    rank: int
    """A global rank of this pipeline stage (the one the dry run built)."""
    stages: list[StageParams]
    estimate: MemoryEstimate


def analytic_stages(cfg, dims, shape: ModelShape, pp_rank: int) -> list[StageParams]:
    """The stages of pipeline rank ``pp_rank`` and their parameter sizes, from the shapes alone."""
    from parallelize import pipeline_parallel as pipeline

    p = cfg.parallelism
    if dims.pp == 1:
        return [stage_params(shape, 0, 1, shape.n_layers, dims.tp, dims.dp_shard * dims.cp, dims.ep)]
    n = pipeline.num_stages(dims.pp, p.pp_schedule, p.pp_virtual_stages)
    ids = pipeline.stage_ids(pp_rank, dims.pp, p.pp_schedule, p.pp_virtual_stages)
    layers = pipeline.split_layers(shape.n_layers, n, p.pp_layers_per_stage or None)
    return [stage_params(shape, i, n, len(layers[i]), dims.tp, dims.dp_shard * dims.cp, dims.ep) for i in ids]


def first_rank_of_stage(dims, pp_rank: int) -> int:
    """The global rank at pipeline coordinate ``pp_rank`` and 0 in every other dimension (pp is outermost)."""
    return pp_rank * (dims.world_size // dims.pp)


def analytic_rows(cfg, dims, shape: ModelShape) -> list[RankRow]:
    rows = []
    for pp_rank in range(dims.pp):
        stages = analytic_stages(cfg, dims, shape, pp_rank)
        rows.append(RankRow(pp_rank, first_rank_of_stage(dims, pp_rank), stages,
                            estimate(shape, stages, rank_layout(cfg, dims, pp_rank))))
    return rows


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def format_table(rows: list[RankRow], gpu_memory_gib: float) -> str:
    """The per-rank table: one row per pipeline rank; sizes in GiB."""
    header = ["pp_rank", "rank", "stages", "layers", "params", "grads", "optim", "working", "activ", "other",
              "peak", "at", "fits"]
    lines = []
    for row in rows:
        e = row.estimate
        fits = "yes" if e.peak <= gpu_memory_gib * GIB else "NO"
        lines.append([
            str(row.pp_rank), str(row.rank), ",".join(str(s.stage) for s in row.stages),
            ",".join(str(s.layers) for s in row.stages), _gib(e.params), _gib(e.grads), _gib(e.optimizer),
            _gib(e.at_peak.working), _gib(e.at_peak.activations), _gib(e.at_peak.other), _gib(e.peak), e.phase, fits,
        ])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    out += ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in lines]
    worst = max(rows, key=lambda r: r.estimate.peak)
    verdict = "fits" if worst.estimate.peak <= gpu_memory_gib * GIB else "does NOT fit"
    out.append(
        f"largest peak: {worst.estimate.peak / GIB:.2f} GiB on pp_rank {worst.pp_rank} ({worst.estimate.phase}); "
        f"{verdict} in {gpu_memory_gib:g} GiB per GPU"
    )
    return "\n".join(out)


def describe_layout(cfg, dims) -> str:
    """One line: precision, AC, batch, pipeline."""
    from engine.config.validation import grad_accumulation_steps, pp_microbatches

    t, ac = cfg.training, cfg.activation_checkpoint
    pr = layout_precision(cfg, dims)
    ac_text = ac.mode if ac.mode != "selective" else f"selective ({ac.selective_option})"
    if ac.mode == "selective" and ac.selective_option == "op" and ac.op_matmuls != "all":
        ac_text = f"selective (op, {ac.op_matmuls} matmuls)"
    accum = grad_accumulation_steps(cfg, dims.dp)
    text = (f"compute {pr.name}; activation checkpointing {ac_text}; seq_len {t.seq_len}, local batch "
            f"{t.local_batch_size}, grad accumulation {accum}")
    if dims.pp > 1:
        micro = pp_microbatches(cfg, dims)
        per_step = f" per local batch, {micro * accum} per schedule step" if accum > 1 else ""
        p = cfg.parallelism
        schedule = (f"from {os.path.basename(p.pp_schedule_csv)} ({p.pp_schedule} placement)" if p.pp_schedule_csv
                    else p.pp_schedule)
        text += f"; pipeline {schedule}, {micro} microbatches{per_step}"
    return text


# --------------------------------------------------------------------------------------------------------
# Validation of a layout without the data files
# --------------------------------------------------------------------------------------------------------


def copy_config(cfg):
    """A copy of a Config whose sections can be changed without touching ``cfg`` (cheaper than deepcopy)."""
    sections = {f.name: dataclasses.replace(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    copied = type(cfg)(**sections)
    copied.parallelism.pp_layers_per_stage = list(cfg.parallelism.pp_layers_per_stage)
    return copied


def validate_layout(cfg, world_size: int):
    """``engine.config.validate`` for the cluster's GPUs (Hopper: float8, flash-attn and CUDA-only options are
    allowed, whatever this planning machine has) without looking for the files a layout does not depend on and a
    planning machine may lack (assets, tokenizer, data, validation data, initial weights: ``check_paths=False``;
    every rule on those fields that is not about the file itself still applies); returns the plan's ParallelDims.
    Raises ConfigError."""
    from engine.config.validation import HOPPER, validate

    return validate(copy_config(cfg), world_size, HOPPER, check_paths=False).dims


def model_shape(cfg) -> ModelShape:
    """The shape of ``cfg``'s model; the vocabulary from model.vocab_size or the flavor (4,096, the built-in
    tokenizer's size, for a flavor without one)."""
    args = get_model_spec(cfg.model.name).flavors[cfg.model.flavor]
    vocab = cfg.model.vocab_size if cfg.model.vocab_size != -1 else args.vocab_size
    if vocab == -1:
        vocab = 4096
    return ModelShape.from_args(args.update_from_config(cfg.model, vocab, cfg.training.seq_len), cfg.model.name)


def gpu_memory_from_env() -> float:
    """GPU_MEMORY_GIB (GiB per GPU), default DEFAULT_GPU_MEMORY_GIB; ValueError naming it when not positive."""
    return _positive_number("GPU_MEMORY_GIB", os.environ.get("GPU_MEMORY_GIB"), DEFAULT_GPU_MEMORY_GIB)


# --------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------

USAGE = """usage: python -m tools.memory --config FILE [--ngpu W] [--gpu-memory-gib G] [--section.key value ...]

Estimates each pipeline rank's peak GPU memory for the layout of FILE on W GPUs (default 1) without
building anything; G is the memory of one GPU (default 80, or env GPU_MEMORY_GIB)."""


def _take(argv: list[str], flag: str) -> Optional[str]:
    """Remove ``flag VALUE`` or ``flag=VALUE`` from argv; returns VALUE (None when absent)."""
    for i, arg in enumerate(argv):
        if arg == flag:
            if i + 1 >= len(argv):
                raise ValueError(f"{flag}: expects a value")
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
        if arg.startswith(flag + "="):
            del argv[i]
            return arg.split("=", 1)[1]
    return None


def _positive_number(flag: str, value: Optional[str], default: float, kind=float):
    if value is None:
        return default
    try:
        number = kind(value)
    except ValueError:
        number = -1
    if not (number > 0 and math.isfinite(number)):  # nan and inf too
        raise ValueError(f"{flag}: expected a positive {'integer' if kind is int else 'number'}, got {value!r}")
    return number


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    try:
        from engine.config import parse_args

        world = _positive_number("--ngpu", _take(argv, "--ngpu"), 1, int)
        gpu_gib = _positive_number("--gpu-memory-gib", _take(argv, "--gpu-memory-gib"), gpu_memory_from_env())
        if not any(a == "--config" or a.startswith("--config=") for a in argv):
            raise ValueError("--config: give the config file of the run to estimate (e.g. "
                             "train_configs/llama3_8b.toml); its command-line overrides follow it")
        cfg = parse_args(argv)
        dims = validate_layout(cfg, world)
        shape = model_shape(cfg)
        rows = analytic_rows(cfg, dims, shape)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"memory estimate: {cfg.model.name}/{cfg.model.flavor} on {world} GPU(s), layout {dims.describe()}")
    print(describe_layout(cfg, dims))
    print(format_table(rows, gpu_gib))
    return 0


if __name__ == "__main__":
    from engine.lifetime import exit_now

    exit_now(main())  # without the interpreter's slow teardown of torch
