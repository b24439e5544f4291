"""A multi-rank harness: run N training steps of the debug model under several layouts and compare each with a
single-process reference; ``run_jobs`` runs any other per-rank function the same way.

Processes are started once per world size (gloo, CPU; forked from a forkserver that has torch and the engine
imported already) and run every layout of that size in turn, on the same process group. Every run sees the
same global batches: the reference reads them whole; a parallel run's data-parallel rank ``r`` takes its rows
(and, with gradient accumulation, its microbatches) of the same batch, so the losses must agree to rounding.
Results (per-step loss and gradient norm, the first step's full gradients) are written by rank 0 to
``<out>/<layout name>.pt``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import socket
import sys
import traceback
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.multiprocessing as mp

BASE = [
    "--config", "train_configs/debug_model.toml",
    "--training.seq_len", "64",
    "--lr_scheduler.warmup_steps", "1",
    "--optimizer.lr", "5e-4",
    "--metrics.log_freq", "1",
    "--debug.deterministic",
    # Per-tensor optimizer kernels: DTensor propagates the sharding of a foreach op over all of its tensors
    # on first use (seconds per rank per layout on 2 cores, most of a 5-step run); the for-loop kernel steps
    # each DTensor on its local shard (engine/optim.py). The numerics are the same; test_parallel keeps one
    # layout on the default foreach kernels.
    "--optimizer.implementation", "for-loop",
]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHALLOW = ["--model.flavor", "debugmodel_L2"]
"""The debug model with 2 layers: for layouts whose checks do not need depth (each layer costs every rank CPU time)."""
AOT_EAGER = ["--compile.enable", "--compile.backend", "aot_eager"]
"""Compiled blocks run by eager kernels: Dynamo's graphs and AOT autograd's partition (where compile's failures under
TP, CP and MoE side effects were), without Inductor's C++ code generation, which a GPU does not run (it builds Triton
kernels) and which costs a CPU 10 to 40 s per test. FSDP2's compiled layout and the tests of compiled numerics
compile with Inductor (docs/testing.md)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def global_batches(global_batch: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` global batches of real text from the built-in corpus, read by one single-rank loader."""
    from engine.config import parse_args
    from engine.data.loader import build_dataloader
    from engine.data.tokenizer import build_tokenizer

    cfg = parse_args([*BASE, "--training.local_batch_size", str(global_batch)])
    it = iter(build_dataloader(cfg, build_tokenizer(cfg), 0, 1))
    return [next(it) for _ in range(steps)]


def _strip(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


_LOADERS: dict = {}
"""This process's training data loaders by what they read (``_reused_dataloader``)."""


def _reused_dataloader(cfg, tokenizer, dp_rank: int = 0, dp_world_size: int = 1, num_shards: int = -1, **kwargs):
    """``build_dataloader`` for the Trainers of ``build_trainer``, whose training loader nobody reads (the harness
    gives each step its batches): one loader per configuration it depends on, kept for the next layout of this
    rank, unless it has been read (a reading caller gets a fresh one). Building one reads and tokenizes the
    data's first document, for every rank of every layout."""
    from engine.data.loader import build_dataloader

    if num_shards != -1 or kwargs:  # a validation loader (it reads batches when built), or a resume's
        return build_dataloader(cfg, tokenizer, dp_rank, dp_world_size, num_shards, **kwargs)
    key = (repr(cfg.data), repr(cfg.validation), cfg.training.seq_len, cfg.training.local_batch_size,
           cfg.debug.seed, tokenizer.path, dp_rank, dp_world_size)
    loader = _LOADERS.get(key)
    if loader is None or any(shard.samples_produced for shard in loader.shards.values()):
        loader = _LOADERS[key] = build_dataloader(cfg, tokenizer, dp_rank, dp_world_size)
    return loader


def build_trainer(args: list[str], world_size: int, rank: int, steps: int, dump: str):
    """The Trainer of ``BASE + args`` for ``steps`` steps, as this process's rank of ``world_size`` (CPU). Its
    training data loader is not for reading: ``run_layout`` feeds the steps."""
    from engine import trainer as trainer_module
    from engine.config import parse_args
    from engine.config.validation import validate
    from engine.distributed import World
    from engine.trainer import Trainer

    cfg = parse_args([*BASE, *args, "--training.steps", str(steps), "--job.dump_folder", dump])
    plan = validate(cfg, world_size)
    world = World(rank=rank, local_rank=rank, world_size=world_size, device=torch.device("cpu"))
    build = trainer_module.build_dataloader
    trainer_module.build_dataloader = _reused_dataloader
    try:
        return Trainer(cfg, world, plan)
    finally:
        trainer_module.build_dataloader = build


def run_layout(args: list[str], world_size: int, rank: int, batches, dump: str,
               probe: Optional[Callable] = None) -> dict | None:
    """Train ``len(batches)`` steps with ``args`` in this process (one rank of ``world_size``). ``probe`` (a
    module-level function, if given) is called as ``probe(trainer)`` on every rank right after the first step
    (it may run collectives); rank 0's return value is the result's ``probe``."""
    from torch.distributed.tensor import DTensor

    trainer = build_trainer(args, world_size, rank, len(batches), dump)
    seen = _record_shapes(trainer)
    probed = None
    cfg = trainer.cfg
    dp_rank, dp = trainer.dp_rank, trainer.dp_size
    accum = trainer.grad_accum
    local = cfg.training.local_batch_size
    losses, norms, grads = [], [], {}

    def record_grads():  # the first step's gradients, complete and clipped (training.max_norm clips them)
        for part in trainer.model_parts:  # with pipeline stages: only this rank's stages
            for name, p in part.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[_strip(name)] = g.detach().clone()
        if trainer.dims.pp_enabled:  # every stage's, to rank 0, from the first rank holding each stage
            import torch.distributed as dist

            # The other ranks of a stage hold the same full gradients: sending them all (16 ranks x 27 MB on
            # 2 cores) cost more than the 4-D run's five steps.
            first_of_stage = all(trainer.dims.coordinate(view)[0] == 0 for view in ("dp_replicate", "dp_shard",
                                                                                     "cp", "tp"))
            by_rank: list = [None] * dist.get_world_size() if rank == 0 else None
            dist.gather_object(grads if first_of_stage else {}, by_rank, dst=0)
            for theirs in by_rank or []:
                for name, g in theirs.items():
                    grads.setdefault(name, g)

    # HSDP/DDP: FSDP's all-reduces of gradients over dp_replicate, counted per step (the engine defers them to
    # a step's last gradient-accumulation microbatch: parallelize.fsdp.set_replica_all_reduce).
    import torch.distributed as dist

    replica_all_reduces, all_reduce = [], dist.all_reduce
    replicate = trainer.dims.group("dp_replicate") if trainer.dims.dp_replicate > 1 else None

    def counting_all_reduce(tensor, *a, group=None, **k):
        caller = sys._getframe(1).f_globals.get("__name__", "")  # FSDP's, not the loss's over the same ranks
        if replicate is not None and caller.startswith("torch.distributed.fsdp") and group is not None \
                and group.group_name == replicate.group_name:
            replica_all_reduces[-1] += 1
        return all_reduce(tensor, *a, group=group, **k)

    dist.all_reduce = counting_all_reduce
    for step, batch in enumerate(batches):
        replica_all_reduces.append(0)
        rows = batch["input_ids"].shape[0]
        assert rows == local * dp * accum, (rows, local, dp, accum)
        # Microbatch k of dp rank r: rows [(k * dp + r) * local, ... + local).
        micro = [
            {key: v[(k * dp + dp_rank) * local:(k * dp + dp_rank + 1) * local] for key, v in batch.items()}
            for k in range(accum)
        ]
        loss, norm = trainer.train_step(micro, after_clip=record_grads if step == 0 else None)
        losses.append(float(loss))
        norms.append(float(norm))
        if step == 0 and probe is not None:
            probed = probe(trainer)
    dist.all_reduce = all_reduce
    trainer.metrics.close()
    if rank != 0:
        return None
    built = {**built_features(trainer), "replica_all_reduces": replica_all_reduces,
             **{key: sorted(values) for key, values in seen.items()}}
    return {"losses": losses, "grad_norms": norms, "grads": grads, "built": built, "probe": probed}


def _record_shapes(trainer) -> dict[str, set]:
    """Forward hooks on this rank's model parts that record, for ``built_features``' checks, what the layout
    really ran on (a flag the plan ignored leaves the losses right: see ``built_features``):
    ``tokens_seq``, the sequence length of the token ids a first stage receives (context parallelism: this
    rank's chunks); ``block_seq`` and ``attn_seq``, those of the hidden state each block and its attention
    receive (sequence parallelism shards the former over TP; the attention gets the all-gathered sequence,
    still this rank's CP chunks); ``logits``, the layout of the output projection's result (a DTensor sharded on
    the vocabulary under loss parallel, a plain tensor otherwise; empty when the output is fused with the loss
    or on another stage). Code that Dynamo compiles (the blocks under ``compile.enable``) runs no hook
    eagerly, so it records no block shapes; ``tokens_seq`` is recorded either way."""
    from torch.distributed.tensor import DTensor

    seen: dict[str, set] = {"tokens_seq": set(), "block_seq": set(), "attn_seq": set(), "logits": set()}

    def seq_of(key):
        def hook(module, args):
            if not torch.compiler.is_compiling():
                seen[key].add(int(args[0].shape[1]))
        return hook

    def logits(module, args, out):
        seen["logits"].add(",".join(map(placement_name, out.placements)) if isinstance(out, DTensor) else "tensor")

    for part in trainer.model_parts:
        if part.tok_embeddings is not None:
            part.register_forward_pre_hook(seq_of("tokens_seq"))
        if part.output is not None:
            part.output.register_forward_hook(logits)
        for block in part.layers.values():
            inner = getattr(block, "_checkpoint_wrapped_module", block)
            inner.register_forward_pre_hook(seq_of("block_seq"))
            inner.attention.register_forward_pre_hook(seq_of("attn_seq"))
    return seen


def _holds_own_parameters(module, unit_type) -> bool:
    """Whether ``module`` holds parameters outside its submodules of ``unit_type`` (a pipeline stage's root
    unit holds none when the embedding, the final norm and the output are on other stages)."""
    inner = {id(p) for m in module.modules() if m is not module and isinstance(m, unit_type) for p in m.parameters()}
    return any(id(p) not in inner for p in module.parameters())


def placement_name(p) -> str:
    """``Shard(0)``, ``Replicate``, ``Partial``, ``_StridedShard(0)``: a placement by its class (and dimension),
    the same on every torch release (their str() changed from ``Shard(dim=0)`` to ``S(0)``)."""
    dim = getattr(p, "dim", None)
    return type(p).__name__ + (f"({dim})" if dim is not None else "")


def _placements(weight) -> Optional[dict[str, str]]:
    """A DTensor parameter's placement on each named mesh dimension; None for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(weight, DTensor):
        return None
    return {name: placement_name(p) for name, p in zip(weight.device_mesh.mesh_dim_names, weight.placements)}


def _attn_fn(block) -> Optional[tuple]:
    """The attention kernel a parallel plan set on ``block`` (``Attention.attn_fn``): (function's qualified name,
    its CP group's size, its rotate method) for a ``functools.partial``; None when the block runs its own."""
    import functools

    import torch.distributed as dist

    fn = getattr(block, "_checkpoint_wrapped_module", block).attention.attn_fn
    if fn is None:
        return None
    if not isinstance(fn, functools.partial):
        return (repr(fn), None, None)
    group = fn.keywords.get("cp_group")
    return (f"{fn.func.__module__}.{fn.func.__name__}", dist.get_world_size(group) if group is not None else None,
            fn.keywords.get("rotate"))


def built_features(trainer) -> dict:
    """What the plan did to rank 0's model parts, so that a test can tell a feature applied from a flag ignored
    (the losses of an ignored AC, compile, CSV schedule, context parallelism, CP rotate method or loss parallel
    would match the reference too; CP ignored, each rank computes the whole sequences' losses and the target
    count summed over dp_cp doubles with them): blocks held, checkpoint-wrapped (and the per-op policies' matmul
    choices), compiled; Float8Linear modules; DTensor parameters; the pipeline schedule's class; each block's
    attention kernel (ring attention, its CP group size and rotate method); the placements of the first block's
    wq and wo weights per mesh dimension (TP: colwise Shard(0) and rowwise Shard(1) on "tp"); whether the trainer
    computes the loss under loss parallel. ``run_layout`` adds the shapes the hooks of ``_record_shapes`` saw."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    blocks = [b for part in trainer.model_parts for b in part.layers.values()]
    modules = [m for part in trainer.model_parts for m in part.modules()]
    attention = getattr(blocks[0], "_checkpoint_wrapped_module", blocks[0]).attention if blocks else None
    return {
        "seq_len": trainer.cfg.training.seq_len,
        "attn_fns": [_attn_fn(b) for b in blocks],
        "wq": _placements(attention.wq.weight) if attention is not None else None,
        "wo": _placements(attention.wo.weight) if attention is not None else None,
        "loss_parallel": trainer.loss_parallel,
        # fully_shard units holding parameters of their own: each reduces their gradients in one collective
        "fsdp_units": sum(isinstance(m, FSDPModule) and _holds_own_parameters(m, FSDPModule) for m in modules),
        "blocks": len(blocks),
        "checkpointed": sum(isinstance(b, CheckpointWrapper) for b in blocks),
        "op_matmuls": sorted({b.op_matmuls for b in blocks if hasattr(b, "op_matmuls")}),
        # the block, or under full / every-N AC the block inside its checkpoint wrapper
        "compiled": sum(getattr(getattr(b, "_checkpoint_wrapped_module", b), "_compiled_call_impl", None) is not None
                        or getattr(b, "_compiled_call_impl", None) is not None for b in blocks),
        "float8": sum(type(m).__name__ == "Float8Linear" for m in modules),
        "dtensor_params": all(isinstance(p, DTensor) for part in trainer.model_parts for p in part.parameters()),
        "schedule": type(trainer.pp_schedule).__name__ if trainer.dims.pp_enabled else None,
        "plan": trainer.stages.describe(trainer.device),  # the trainer's plan line, read from the modules
    }


def _worker(rank: int, world_size: int, port: int, fn, jobs: dict[str, tuple], out: str):
    import faulthandler
    import gc

    import torch.distributed as dist

    faulthandler.enable(all_threads=True)  # a rank that dies of a signal prints where it was
    # What the forkserver preloaded (torch, the engine) to the permanent generation: the rank's collections do not
    # scan it again, nor copy its pages from the forkserver's by touching them (a tenth of a 4-rank world's CPU).
    gc.freeze()
    os.chdir(ROOT)
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if world_size > 1:
        # A deadlocked collective fails after 5 minutes instead of gloo's default 30 (a Trainer sets every group's
        # timeout to comm.init_timeout_seconds, also 300 s; other jobs keep this one).
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    try:
        for name, job in jobs.items():
            try:
                result = fn(world_size, rank, *job)
            except Exception:
                result = {"error": traceback.format_exc()}
                if rank == 0:
                    torch.save(result, os.path.join(out, f"{name}.pt"))
                raise
            if rank == 0:
                torch.save(result, os.path.join(out, f"{name}.pt"))
            if world_size > 1:
                dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Modules every rank imports. A forkserver (one per test session) imports them once, and each rank is forked from
# it ready to run, instead of every spawned rank importing torch and the engine again (seconds per rank on 2 cores).
# datasets (the loader's), torch._dynamo (torch.use_deterministic_algorithms imports it), Inductor (for the ranks
# that compile) and the plots' matplotlib are imported lazily by the engine, so they are named here too.
PRELOAD = ["torch", "torch.distributed.tensor", "torch._dynamo", "torch._inductor.compile_fx", "datasets",
           "engine.trainer", "engine.data.loader", "engine.plot", "tests.parallel_harness"]


_FORKSERVER_READY: list[bool] = []


def start_method(ranks: int) -> str:
    """``forkserver`` with the engine preloaded (one thread per rank: the ranks share few cores), for starting
    ``ranks`` processes; more than one hold the machine alone (tests/workers.py) once the forkserver is ready
    (its start, once per test process, imports the engine on one core for seconds)."""
    import multiprocessing
    import time

    from tests import workers

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    if not _FORKSERVER_READY:  # the first process it forks waits for its imports
        first = ctx.Process(target=time.sleep, args=(0,))
        first.start()
        first.join()
        _FORKSERVER_READY.append(True)
    if ranks > 1:
        workers.hold_alone()
    return "forkserver"


def run_jobs(world_size: int, fn, jobs: dict[str, tuple], out: str) -> dict:
    """Run ``fn(world_size, rank, *job)`` for every job in turn on ``world_size`` gloo ranks (one process group,
    processes forked from the preloaded forkserver); returns rank 0's results by job name. ``fn`` must be a
    module-level function of an importable module (the ranks import it by name)."""
    os.makedirs(out, exist_ok=True)
    mp.start_processes(_worker, args=(world_size, free_port(), fn, jobs, out), nprocs=world_size, join=True,
                       start_method=start_method(world_size))
    return {name: torch.load(os.path.join(out, f"{name}.pt"), weights_only=False) for name in jobs}


def train_job(world_size: int, rank: int, argv: list[str], env: Optional[dict[str, str]] = None) -> str:
    """A whole training run (``Trainer.train``) of ``argv`` on this rank, as ``./run_train.sh`` runs it: the debug
    config unless ``argv`` names another; metrics.jsonl, checkpoints and plots in the run's dump folder.
    ``env`` sets (or, with an empty value, removes) environment variables first: the ranks inherit the
    forkserver's environment, not the test's. Returns what the run printed."""
    from engine.config import parse_args
    from engine.config.validation import validate
    from engine.checkpoint.resume import plan_resume
    from engine.distributed import defer_sigterm, forget_sigterm, init_distributed
    from engine.faults import install_from_env
    from engine.train import finished_already
    from engine.trainer import Trainer

    for key, value in (env or {}).items():
        if value:
            os.environ[key] = value
        else:
            os.environ.pop(key, None)
    install_from_env()  # as engine.train.main does
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", "train_configs/debug_model.toml", *argv]
    cfg = parse_args(argv)
    plan = validate(cfg, world_size)
    forget_sigterm()  # (an earlier run in this process may have got one)
    if cfg.checkpoint.enable:  # as engine.train.run does
        defer_sigterm()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        world = init_distributed()
        plan = dataclasses.replace(plan, resume=plan_resume(cfg))
        if not finished_already(cfg, world, plan.resume):
            Trainer(cfg, world, plan).train()
    return printed.getvalue()


def _run_layout_job(world_size: int, rank: int, args: list[str], batches, dump: str, probe=None):
    return run_layout(args, world_size, rank, batches, dump, probe)


def run_world(world_size: int, layouts: dict[str, list[str]], batches_by_name: dict, out: str,
              probe: Optional[Callable] = None) -> dict[str, dict]:
    """Train every layout on ``world_size`` gloo ranks; returns rank 0's results by layout name. ``probe``: see
    ``run_layout`` (a module-level function: the ranks import it by name)."""
    jobs = {name: (args, batches_by_name[name], os.path.join(out, name), probe) for name, args in layouts.items()}
    return run_jobs(world_size, _run_layout_job, jobs, out)
