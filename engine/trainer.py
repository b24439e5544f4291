"""The training loop: tokenizer and data, model (meta -> device), optimizer, then steps with metrics.

Loss convention: every microbatch contributes the SUM of its token cross-entropies divided by the number of
target tokens in the whole optimizer step (all microbatches, all data-parallel ranks), so gradient
accumulation and data parallelism give exactly the gradient of the mean loss over the global batch.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Optional

import torch
from torch import nn

import torch.distributed as dist

from engine import events
from engine.checkpoint.checkpointer import Checkpointer
from engine.checkpoint.files import StorageFull, out_of_space
from engine.checkpoint.resume import check_data_source, check_fits_model, load_data_position, plan_resume
from engine.config import Config, dump, to_toml
from engine.build import build_model_parts, check_host_memory
from engine.config.validation import Plan
from engine.data.datasets import DataError, validation_data
from engine.data.loader import build_dataloader
from engine.data.tokenizer import build_tokenizer
from engine.load_balance import LoadBalance
from engine.distributed import (World, agree_on_user_errors, announce_user_error, comm_trace_prefix, defer_sigterm,
                                longer_collective_timeout, process_group_backend, set_collective_timeout,
                                set_determinism)
from engine.metrics import MetricsLogger
from engine.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, describe_optimizer
from engine.profiling import StepProfiler
from engine.step_guards import TrainingDiverged, check_finite, release_cached_memory, scheduled_gc
from models.registry import get_model_spec
from models.attention import select_sdpa_backend
from models.loss import IGNORE_INDEX, cross_entropy_sum
from models.moe import MoE
from parallelize import pipeline_parallel as pipeline
from parallelize.bf16_weights import bf16_weights_apply, split_fsdp_weights, split_matmul_weights
from parallelize.compile import compile_loss, tag_compile_caches
from parallelize.context_parallel import shard_sequence
from parallelize.fsdp import gradient_divide_factor, mixed_precision_policy, set_replica_all_reduce
from parallelize.float8 import float8_after_optimizer_step
from parallelize.tensor_parallel import loss_context, reduce_partial_grads, to_local_scalar


def bf16_autocast(device: torch.device, mixed_precision_param: str, data_parallel: bool) -> bool:
    """Whether the compute runs under bf16 autocast: on CUDA, unless FSDP2's mixed precision casts the
    parameters already (on CPU training runs in fp32; tests patch this to run autocast there)."""
    return device.type == "cuda" and mixed_precision_param == "bfloat16" and not data_parallel


class Trainer:
    def __init__(self, cfg: Config, world: World, plan: Plan):
        """``plan``: validate's resolved Plan for this world, used as it is. Its ``resume`` (plan_resume's answer)
        is decided by the caller, or here when it is None."""
        assert plan.dims.world_size == world.world_size, "the plan was validated for another world"
        self.cfg = cfg
        self.plan = plan
        self.world = world
        self.device = world.device
        set_determinism(cfg.debug.seed, cfg.debug.deterministic)

        # The mesh: which ranks share data, shards and tokens.
        self.dims = plan.dims
        if self.dims.distributed:
            self.dims.build_mesh(self.device.type,
                                 process_group_backend(self.device.type, cfg.parallelism.fsdp_cpu_offload))
            set_collective_timeout(cfg.comm.init_timeout_seconds)  # the mesh's new groups too, until step 1
            if cfg.compile.enable:
                tag_compile_caches(self.dims.group_names())
        self.dp_rank, self.dp_size = self.dims.coordinate("dp")
        self.grad_accum = plan.grad_accum
        self.loss_group = self.dims.group("dp_cp")  # ranks holding different tokens

        # The checkpoint to resume from, checked now: a bad one stops the run before anything is built (the initial
        # weights are checked against the model below, before anything is written). Then the
        # tokenizer and this rank's data shard (cheap to build; their errors are user errors), and the checkpoint's
        # data position in it (a position past data that has shrunk since fails on some ranks only). A rank's own
        # shard may fail where the others do not: the ranks agree before going on.
        self.resume_plan = resume = plan.resume if plan.resume is not None else plan_resume(cfg)
        self.resume_from = resume.checkpoint
        with agree_on_user_errors():
            self.tokenizer = build_tokenizer(cfg)
            self.dataloader = build_dataloader(cfg, self.tokenizer, self.dp_rank, self.dp_size)
            self._read_ahead_from: Optional[dict] = None  # see data_state
            if cfg.validation.enable:  # built now, so that its errors (naming validation.* fields) come now too
                vcfg, fields = validation_data(cfg)
                self._val_loader = build_dataloader(vcfg, self.tokenizer, self.dp_rank, self.dp_size, fields=fields)
                self._val_start = self._val_loader.state_dict()  # every validation reads from here
                val_fit = self._validation_batches_that_fit()  # reads them now: a bad record is a user error now
            if resume.load_data_position:  # it must belong to this data, and lie inside it
                check_data_source(resume.checkpoint, self.dataloader.source, cfg, self.tokenizer)
                self.dataloader = load_data_position(  # (the checkpoint's load below leaves it as it is)
                    resume.checkpoint, cfg, self.dataloader,
                    lambda num_shards: build_dataloader(cfg, self.tokenizer, self.dp_rank, self.dp_size, num_shards))
        if cfg.validation.enable:
            self._warn_small_validation_data(val_fit)

        # Model on the meta device: shapes and FLOPs without memory; the attention kernel SDPA may use.
        sdpa_choice = select_sdpa_backend(cfg.model.sdpa_backend)
        spec = get_model_spec(cfg.model.name)
        self.model_args = spec.flavors[cfg.model.flavor].update_from_config(
            cfg.model, self.tokenizer.vocab_size, cfg.training.seq_len
        )
        with torch.device("meta"):
            model = spec.model_cls(self.model_args)
        self.num_flops_per_token = spec.flops_per_token(self.model_args, cfg.training.seq_len)
        self.num_params = sum(p.numel() for p in model.parameters())
        moe_layers = sum(isinstance(m, MoE) for m in model.modules())  # on every pipeline stage
        if self.device.type == "cpu":
            check_host_memory(cfg.model.flavor, self.num_params, self.dims, world.world_size)
        with agree_on_user_errors():  # the checkpoint to load holds this model's tensors, with its shapes
            check_fits_model(cfg, model, self.model_args, resume)
            # The metrics sinks start (wandb may refuse) before anything is written. A resumed run appends to the
            # run's metrics.jsonl (engine.plot reads its segments).
            self.metrics = MetricsLogger(cfg, world.rank, world.world_size, self.num_flops_per_token, self.device,
                                         fresh=resume.checkpoint is None, first_step=resume.step + 1)

        # Every check has passed: from here on the run writes to its dump folder.
        if world.is_main:
            dump(cfg, cfg.job.dump_folder, resume.step if resume.checkpoint is not None else None)
            if cfg.job.print_config:
                print(to_toml(cfg), flush=True)
        if cfg.comm.trace_buf_size > 0 and dist.is_initialized() and "nccl" in dist.get_backend():  # cuda:nccl,cpu:gloo
            os.makedirs(os.path.dirname(comm_trace_prefix(cfg.job.dump_folder)), exist_ok=True)

        # Pipeline stages (this rank's parts of the model), then each part's parallel plan, then materialize
        # and initialize.
        self.stages = build_model_parts(cfg, self.dims, spec, model, self.device)
        parts = self.stages.parts
        self.pp_stage_ids, self.pp_stage_count = self.stages.stage_ids, self.stages.stage_count
        self.pp_has_first, self.pp_has_last = self.stages.has_first, self.stages.has_last
        self.model_parts = parts
        self.model = parts[0] if len(parts) == 1 else nn.ModuleList(parts)
        # An output projection tied to the embedding, the two on different stages: their gradients are summed.
        self.tied = pipeline.TiedEmbedding(
            parts, pipeline.stage_owners(self.dims.pp, cfg.parallelism.pp_schedule, cfg.parallelism.pp_virtual_stages),
            self.dims.mesh("root"), self.device,
        ) if self.dims.pp_enabled and getattr(self.model_args, "tie_embeddings", False) else None
        self.loss_parallel = self.dims.tp_enabled and not cfg.parallelism.disable_loss_parallel
        # The loss is divided by the global token count, so data-parallel gradients must be summed; FSDP2
        # averages them (a sum with a pre-multiplier, which gloo lacks), so backward runs on the loss times
        # the divisor.
        self.backward_scale = gradient_divide_factor(self.dims.mesh("fsdp")) if self.dims.data_parallel else 1
        self.loss_fn = compile_loss(cross_entropy_sum, cfg.compile.backend) if cfg.compile.enable else cross_entropy_sum
        # Under TP each rank runs the MoE layers on its own sequence shard: their counts add up over tp too.
        token_groups = [g for g in (self.loss_group, self.dims.group("tp") if self.dims.tp_enabled else None)
                        if g is not None]
        # Forwards per optimizer step: the accumulation microbatches, each split again by a pipeline.
        self.forwards_per_step = self.grad_accum * (self.plan.pp_microbatches if self.dims.pp_enabled else 1)
        self.balance = LoadBalance(parts, cfg.model.moe_aux_loss_coeff, token_groups, self.device, moe_layers,
                                   self.forwards_per_step, self.backward_scale,
                                   self.dims.group("pp") if self.dims.pp_enabled else None)
        self._num_targets = 1  # the current step's global target count, for the pipeline's loss function
        if self.dims.pp_enabled:
            self.pp_schedule = self._pipeline_schedule()

        # bf16 compute: autocast on CUDA unless FSDP2's mixed precision casts the parameters already; on one GPU,
        # with the matmul weights stored in bf16 and their fp32 masters split in two (parallelize/bf16_weights.py).
        use_bf16 = bf16_autocast(self.device, cfg.training.mixed_precision_param, self.dims.data_parallel)
        self.autocast = (
            (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
        )
        self.bf16_weights = use_bf16 and bf16_weights_apply(cfg.training.bf16_weights, self.dims.distributed,
                                                            self.grad_accum)
        # Under FSDP2 with bf16 parameters (CUDA): every shard stored as bf16 + low half, when asked for.
        self.fsdp_bf16_weights = cfg.training.fsdp_bf16_weights and self.dims.data_parallel and mixed_precision_policy(
            cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce, self.device.type
        ).param_dtype == torch.bfloat16
        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.device,
                                         bf16_weights=self.bf16_weights or self.fsdp_bf16_weights)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        # The training state so far: a checkpoint of this run, or initial weights, or a fresh start.
        self.step = 0
        self.checkpointer = Checkpointer(cfg, self.model_parts, self.optimizer, self.lr_scheduler, self.data_state,
                                         self.dataloader.num_shards, self.dims, self.device, self.model_args,
                                         self.tokenizer.path)
        if resume.checkpoint is not None:  # (its data position: loaded above)
            self.step = self.checkpointer.load(resume.checkpoint, resume.load_data_position)
        elif resume.initial_load_path:
            self.checkpointer.load_model_only(resume.initial_load_path, resume.initial_from_hf, resume.initial)

        if self.bf16_weights:  # from the final weights (initialized or loaded), before the first forward
            self.optimizer.set_low_halves(split_matmul_weights(self.model_parts))
        elif self.fsdp_bf16_weights:
            self.optimizer.set_low_halves(split_fsdp_weights(self.model_parts))
        self.doc_masking = cfg.model.attn_mask == "block_causal"
        events.point(self.step, "set_up")
        if world.logs:
            print(
                f"model {cfg.model.name}/{cfg.model.flavor}: {self.num_params:,} parameters, "
                f"{self.num_flops_per_token / 1e9:.3f} GFLOP per token; device {self.device}; "
                f"grad accumulation {self.grad_accum}; layout {self.dims.describe()}; attention {cfg.model.attn}"
                + (f" ({sdpa_choice})" if cfg.model.attn == "sdpa" else "")
                + ("; bf16 autocast" + (" on bf16 weights (fp32 masters split in two)" if self.bf16_weights
                                        else "") if use_bf16 else "")
                + ("; FSDP2 on bf16 weights (fp32 masters split in two)" if self.fsdp_bf16_weights else "")
                + (f"; float8 {cfg.float8.recipe}{' (emulated)' if cfg.float8.emulate else ''}: "
                   f"{plan.float8_layers[0]} of {plan.float8_layers[1]} linear layers" if cfg.float8.enable else ""),
                flush=True,
            )
            chunk = cfg.training.loss_chunk_tokens
            backend = cfg.compile.backend
            print(f"plan: {self.stages.describe(self.device)}"
                  + (f"; compile backend {backend}" if cfg.compile.enable and backend != "inductor" else "")
                  + (f"; output loss fused in {chunk}-token chunks" if chunk else "")
                  + f"; optimizer {describe_optimizer(self.optimizer)}", flush=True)
            source = self.dataloader.source
            ignored = (f"; {len(source.ignored)} file(s) of another format not read: "
                       f"{', '.join(os.path.basename(p) for p in source.ignored[:3])}"
                       f"{', ...' if len(source.ignored) > 3 else ''}") if source.ignored else ""
            print(f"data: {source.describe()}{ignored}{self.dataloader.split_note}; tokenizer {self.tokenizer.path} "
                  f"({self.tokenizer.vocab_size:,} tokens)", flush=True)
            if resume.passed_over:  # checkpoints found and not resumed from
                print(resume.passed_over, flush=True)

    # ----------------------------------------------------------------------------------------------------
    def data_state(self) -> dict:
        """The data position after the last step trained (what a checkpoint saves): the loader's, unless the
        loop has read the next step's batches ahead (before a log's host sync), then the position before them."""
        return self._read_ahead_from if self._read_ahead_from is not None else self.dataloader.state_dict()

    def _pipeline_schedule(self):
        p = self.cfg.parallelism

        def loss_fn(out, labels):
            # The last stage's output: its logits, or with the fused loss already its sum of token losses.
            loss_sum = out if self.cfg.training.loss_chunk_tokens else self.loss_fn(out, labels)
            return loss_sum / self._num_targets * self.backward_scale

        stages = pipeline.build_stages(
            self.model_parts, self.pp_stage_ids, self.pp_stage_count, self.dims.group("pp"), self.device
        )
        # One schedule step per optimizer step: every gradient-accumulation batch's microbatches go through it.
        return pipeline.build_schedule(stages, p.pp_schedule, self.forwards_per_step, loss_fn, p.pp_schedule_csv)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        non_blocking = self.device.type == "cuda"
        return {k: v.to(self.device, non_blocking=non_blocking) for k, v in batch.items()}

    def _global_num_targets(self, microbatches: list[dict[str, torch.Tensor]]) -> int | torch.Tensor:
        """Target tokens of the whole optimizer step: every microbatch on every rank holding other tokens. Summed
        over ranks it stays a device tensor, never read on the host: the losses are divided by it on the device,
        so the host goes on queuing the step's work instead of waiting for the GPU at every step."""
        local = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in microbatches)  # CPU batches: no sync
        assert local > 0, "microbatches without target tokens"
        if self.loss_group is None:
            return local
        count = torch.tensor(local, dtype=torch.int64, device=self.device)
        dist.all_reduce(count, group=self.loss_group)
        return count

    def _shard_context(self, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Context parallelism: this rank's load-balanced chunks of every sequence of the batch. The document
        ids stay whole: the ring attention masks each chunk pair with both chunks' documents."""
        if not self.dims.cp_enabled:
            return mb
        cp_rank, cp = self.dims.coordinate("cp")
        return {k: v if k == "doc_ids" else shard_sequence(v, 1, cp_rank, cp) for k, v in mb.items()}

    def forward_backward(self, microbatches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Gradients of the step's mean loss; returns this rank's share of that loss (a device scalar)."""
        microbatches = [self._shard_context({k: v for k, v in mb.items() if k != "sample_ids"})
                        for mb in microbatches]
        num_targets = self._global_num_targets(microbatches)
        if self.dims.pp_enabled:
            # The gradient-accumulation batches go through the pipeline as one batch, in one schedule step of
            # pp_microbatches x accumulation microbatches: the pipeline fills and drains once per optimizer step
            # (not once per batch), and FSDP/HSDP reduce each stage's gradients once, at the step's end.
            self._num_targets = num_targets
            batch = {k: torch.cat([mb[k] for mb in microbatches]) for k in microbatches[0]}
            return self._pipeline_step(self._to_device(batch))
        total_loss = torch.zeros((), device=self.device)
        for i, mb in enumerate(microbatches):
            if self.dims.dp_replicate > 1 and len(microbatches) > 1:  # HSDP/DDP: all-reduced in the last backward
                set_replica_all_reduce(self.model_parts, i == len(microbatches) - 1)
            mb = self._to_device(mb)
            with self.autocast():
                out = self._forward(mb)
            with loss_context(self.loss_parallel):
                loss = self._loss_sum(out, mb) / num_targets
                del out
                # A MoE layer's auxiliary loss trains through the layer's output in this backward (models/moe.py).
                (loss * self.backward_scale if self.backward_scale != 1 else loss).backward()
            total_loss += to_local_scalar(loss.detach())
        return total_loss

    def _forward_kwargs(self, mb: dict[str, torch.Tensor]) -> dict:
        """What the model's forward takes besides the tokens: the document ids under document masking, and
        with training.loss_chunk_tokens the labels (the output projection is then fused with the loss inside
        the forward, which returns the sum of the token losses). A pipeline hands them to every stage; only
        the stages holding attention layers or the output use them."""
        kwargs = {}
        if self.doc_masking:
            kwargs["doc_ids"] = mb["doc_ids"]
        if self.cfg.training.loss_chunk_tokens:
            kwargs["labels"] = mb["labels"]
        return kwargs

    def _forward(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """The unpipelined model on one microbatch: its logits, or with training.loss_chunk_tokens the sum of
        its token losses."""
        return self.model(mb["input_ids"], **self._forward_kwargs(mb))

    def _loss_sum(self, out: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """The sum of the token losses of what ``_forward`` (or the pipeline's evaluation) returned."""
        return out if self.cfg.training.loss_chunk_tokens else self.loss_fn(out, mb["labels"])

    def _pipeline_step(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and backward of one batch through the pipeline; the last stage's share of the loss."""
        losses: list[torch.Tensor] = []
        inputs = (mb["input_ids"],) if self.pp_has_first else ()
        target = mb["labels"] if self.pp_has_last else None
        with self.autocast(), loss_context(self.loss_parallel):
            # return_outputs=False: the last stage keeps no microbatch's output (logits) once its loss is taken.
            self.pp_schedule.step(*inputs, target=target, losses=losses, return_outputs=False,
                                  **self._forward_kwargs(mb))
        if not self.pp_has_last:
            return torch.zeros((), device=self.device)
        return sum(to_local_scalar(loss.detach()) for loss in losses) / self.backward_scale

    def train_step(self, microbatches: list[dict[str, torch.Tensor]],
                   after_clip: Optional[Callable[[], None]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over ``microbatches``; returns (mean loss, grad norm before clipping) as device
        tensors. ``after_clip`` (if given) is called once the gradients are complete and clipped, before the
        optimizer reads them: a place to read or record them."""
        loss = self.forward_backward(microbatches)
        if self.dims.tp_enabled and not self.dims.data_parallel:
            reduce_partial_grads(self.model.parameters())  # once, not in every op that reads them
        if self.tied is not None:
            self.tied.sum_gradients()
        events.point(self.step, "mid_step")
        # With the fused optimizer the clip factor is applied inside its kernel (engine/optim.py), unless
        # ``after_clip`` reads the clipped gradients before it runs.
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.training.max_norm, self.dims.group("pp")
                                    if self.dims.pp_enabled else None,
                                    optimizer=self.optimizer, scale_in_optimizer=after_clip is None,
                                    uncounted=self.tied.uncounted if self.tied is not None else ())
        # On this rank's device, as the loss: under FSDP's CPU offload the gradients, so their norm, are in host
        # memory, and the log step stacks the two.
        grad_norm = grad_norm.to(self.device, non_blocking=True)
        if after_clip is not None:
            after_clip()
        self.optimizer.step()
        self.balance.after_step()
        float8_after_optimizer_step(self.model_parts, self.cfg.float8)  # precomputed float8 scales for FSDP
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.dims.pp_enabled:
            dist.all_reduce(loss, group=self.dims.group("pp"))  # only the last stage holds the loss
        if self.loss_group is not None:
            dist.all_reduce(loss, group=self.loss_group)  # the shares add up to the global mean
        return loss, grad_norm

    @torch.no_grad()
    def evaluate(self, microbatches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The mean loss over the target tokens of ``microbatches`` (every data-parallel rank's), without
        gradients; with PP the batches go through every stage in turn. A device scalar, the same on every rank."""
        microbatches = [self._shard_context({k: v for k, v in mb.items() if k != "sample_ids"})
                        for mb in microbatches]
        num_targets = self._global_num_targets(microbatches)
        total = torch.zeros((), device=self.device)
        p = self.cfg.parallelism
        for mb in microbatches:
            mb = self._to_device(mb)
            with self.autocast(), loss_context(self.loss_parallel):
                if self.dims.pp_enabled:
                    owners = pipeline.stage_owners(self.dims.pp, p.pp_schedule, p.pp_virtual_stages)
                    logits = pipeline.forward_only(self.model_parts, self.pp_stage_ids, self.pp_stage_count, owners,
                                                   self.dims.coordinate("pp")[0], self.dims.group("pp"),
                                                   mb["input_ids"], self._forward_kwargs(mb))
                else:
                    logits = self._forward(mb)
                if logits is not None:
                    total += to_local_scalar(self._loss_sum(logits, mb))
        if self.dims.pp_enabled:
            dist.all_reduce(total, group=self.dims.group("pp"))
        if self.loss_group is not None:
            dist.all_reduce(total, group=self.loss_group)
        self.balance.discard_counts()  # the experts' load is the training steps'
        return total / num_targets

    def _validate(self) -> float:
        """validation.steps batches of the validation data, the same ones each time."""
        self._val_loader.load_state_dict(self._val_start)
        batches = [next(self._val_loader) for _ in range(self.cfg.validation.steps)]
        events.point(self.step, "validation")
        return float(self.evaluate(batches))

    def _validation_batches_that_fit(self) -> int:
        """How many of the validation.steps batches this rank draws before its validation data runs out and is
        read again from its start (the loader goes on into a second epoch): validation.steps when it never does."""
        steps = self.cfg.validation.steps
        start = {s: state["epoch"] for s, state in self._val_start["shards"].items()}
        self._val_loader.load_state_dict(self._val_start)
        for i in range(steps):
            next(self._val_loader)
            shards = self._val_loader.state_dict()["shards"]
            if any(shards[s]["epoch"] > epoch for s, epoch in start.items()):
                return i
        return steps

    def _warn_small_validation_data(self, fit: int) -> None:
        """One warning line when some rank's validation data holds fewer than validation.steps batches (``fit``:
        this rank's count): the loader would read it again, and validation_loss would count those documents twice."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            fewest = torch.tensor(fit, dtype=torch.int64, device=self.device)
            dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
            fit = int(fewest)
        steps = self.cfg.validation.steps
        if fit >= steps or not self.world.logs:
            return
        source = self._val_loader.source
        holds = (f"only {fit} whole batch{'es' if fit != 1 else ''}" if fit else
                 "less than one batch (training.local_batch_size samples of training.seq_len tokens)")
        advice = f"set validation.steps to at most {fit}, or give" if fit else "give"
        print(f"warning: validation.steps: {steps} batches per validation, but the validation data, {source.field} = "
              f"{source.describe()}, holds {holds} per data-parallel rank, so it is read again from its start and "
              f"validation_loss counts those documents twice; {advice} more validation data", flush=True)

    def _should_log(self, step: int) -> bool:
        """Every metrics.log_freq steps, the last step, and a run's first step (alone: compile and warm-up)."""
        return (step == self._first_step or step % self.cfg.metrics.log_freq == 0
                or step == self.cfg.training.steps)

    def train(self) -> list[dict]:
        """Run to training.steps; returns the logged metrics (rank 0's view)."""
        cfg = self.cfg
        ckpt = self.checkpointer
        if cfg.checkpoint.create_seed_checkpoint:
            ckpt.save(0, model_only=True, dtype="float32")
            ckpt.close()
            return []
        if cfg.checkpoint.enable:
            defer_sigterm()  # (engine.train installs it first, as soon as it has read the configuration)
            if ckpt.stopped_in_set_up():
                if self.world.logs:
                    print(f"SIGTERM during set-up: nothing trained since step {self.step}, nothing to save; exiting",
                          flush=True)
                ckpt.close()
                self.metrics.close()
                return []
        tokens_per_step = cfg.training.local_batch_size * cfg.training.seq_len * self.grad_accum * self.dp_size
        data_iter = iter(self.dataloader)

        start_epoch = self.dataloader.epoch

        def read_step(step: int) -> tuple[list, int]:
            """The microbatches of optimizer step ``step`` and the latest epoch (pass over this rank's data) they come
            from; a line the first time that is a pass after the run's first."""
            nonlocal start_epoch
            microbatches = [next(data_iter) for _ in range(self.grad_accum)]
            epoch = self.dataloader.epoch
            if start_epoch is not None and epoch > start_epoch:
                start_epoch = None
                if self.world.logs:
                    print(f"data: rank {self.world.rank} has read its shard of {self.dataloader.source.describe()} "
                          f"through; from step {step} it reads it again (epoch {epoch}), so documents repeat",
                          flush=True)
            return microbatches, epoch

        read_ahead: Any = None  # the next step's read_step (or its DataError), read before a log's sync
        logged = []
        # A logged loss is the mean over the steps since the previous multiple of metrics.log_freq (as Megatron-LM
        # logs it): one step's loss swings with the content of its batch; the window mean shows the trend. A run's
        # first step is also logged alone (its throughput holds compile and warm-up), without ending the loss
        # window: a run resumed at a multiple of log_freq logs the same losses as an uninterrupted one.
        window_start = time.perf_counter()
        window_tokens, window_data_wait, window_steps = 0, 0.0, 0
        window_loss = torch.zeros((), device=self.device)
        window_nonfinite = torch.zeros((), device=self.device)  # steps whose gradient norm was nan or inf
        first_step = self._first_step = self.step + 1
        validated = False  # whether this process has run a validation yet

        def window_values() -> list[float]:
            """The loss window's mean, the step's gradient norm (grad_norm, set by the loop) and the window's steps
            with a nan or inf one: the one host sync per log (and per checkpoint, which nan or inf must not
            reach)."""
            return torch.stack([window_loss / window_steps, grad_norm.float(), window_nonfinite]).tolist()

        try:
            with StepProfiler(cfg, self.world.rank, self.step, self.device) as profiler, \
                    scheduled_gc(cfg.training.gc_freq) as collect_garbage:
                while self.step < cfg.training.steps:
                    self.step += 1
                    collect_garbage(self.step)
                    t0 = time.perf_counter()
                    if read_ahead is None:
                        microbatches, data_epoch = read_step(self.step)
                    elif isinstance(read_ahead, DataError):  # raised by the read-ahead: this step's, so now
                        raise read_ahead
                    else:
                        (microbatches, data_epoch), read_ahead, self._read_ahead_from = read_ahead, None, None
                    window_data_wait += time.perf_counter() - t0

                    lr = self.lr_scheduler.get_last_lr()[0]
                    loss, grad_norm = self.train_step(microbatches)
                    if self.step == first_step:  # compilation and set-up are behind: hangs now fail fast
                        set_collective_timeout(cfg.comm.train_timeout_seconds)
                        if cfg.training.empty_cache_after_first_step:  # before the log starts the next window
                            release_cached_memory(self.device)
                    window_tokens += tokens_per_step
                    window_loss += loss
                    window_nonfinite += ~torch.isfinite(grad_norm)
                    window_steps += 1

                    logging_now, saving_now = self._should_log(self.step), ckpt.should_save(self.step)
                    last = self.step == cfg.training.steps
                    if logging_now and not saving_now and not last:
                        # The log's host sync below drains the GPU's queue: the next step's batches are read
                        # now, while the GPU still works on this step, not in the idle time after the sync.
                        # (A checkpoint of this step, on SIGTERM, saves the data position before them.)
                        # (A bad record in them stops the run at the next step, as it would without reading
                        # ahead: this step is logged, validated and, on SIGTERM, saved first.)
                        t0 = time.perf_counter()
                        self._read_ahead_from = self.dataloader.state_dict()
                        try:
                            read_ahead = read_step(self.step + 1)
                        except DataError as e:
                            read_ahead = e
                        window_data_wait += time.perf_counter() - t0
                    if logging_now or saving_now:
                        loss_value, grad_norm_value, nonfinite = window_values()
                        if logging_now:
                            elapsed = time.perf_counter() - window_start
                            logged.append(
                                self.metrics.log(
                                    self.step, loss_value, grad_norm_value, lr, window_tokens, elapsed,
                                    window_data_wait,
                                    extra={"data_epoch": data_epoch, **self.balance.log_values()},
                                )
                            )
                            window_start = time.perf_counter()
                            window_tokens, window_data_wait = 0, 0.0
                        check_finite(self.step, loss_value, grad_norm_value, nonfinite)
                        if logging_now and (self.step % cfg.metrics.log_freq == 0 or last):  # the loss window ends
                            window_steps = 0
                            window_loss.zero_()
                            window_nonfinite.zero_()

                    # Validation, recorded at its own step (after the step's training record); not training time.
                    if cfg.validation.enable and self.step % cfg.validation.freq == 0:
                        t_val = time.perf_counter()
                        # The first one (under no_grad) compiles the model and the loss anew, and with PP the last
                        # stage waits for every earlier stage's compile: it gets the set-up's timeout.
                        with longer_collective_timeout(cfg.comm.init_timeout_seconds) if not validated else \
                                contextlib.nullcontext():
                            val_loss = self._validate()
                        validated = True
                        self.metrics.log_validation(self.step, val_loss, time.perf_counter() - t_val)
                        window_start += time.perf_counter() - t_val

                    # Checkpoints: commit a finished background save; save on the interval; on SIGTERM save, stop.
                    # Not training time: the window's clock skips it (the save logs its own timing).
                    t_ckpt = time.perf_counter()
                    ckpt.poll()
                    if saving_now:
                        ckpt.save(self.step, model_only=last and cfg.checkpoint.last_save_model_only)
                    # A SIGTERM (agreed by every rank) saves this step and stops, unless the step is the last.
                    if cfg.checkpoint.enable and not last and ckpt.stop_requested():
                        if not saving_now:
                            if not logging_now:  # this step's window was not checked: no nan or inf is saved
                                check_finite(self.step, *window_values())
                            ckpt.save(self.step, force_sync=True)
                        ckpt.wait()
                        if self.world.logs:
                            print(f"SIGTERM: checkpoint of step {self.step} saved; exiting", flush=True)
                        profiler.step(self.step)  # this step done: a trace window ending here is named for it
                        break
                    window_start += time.perf_counter() - t_ckpt
                    profiler.step(self.step)
        except TrainingDiverged:  # every rank sees it at the same step: the saves so far commit, then it stops
            ckpt.close()
            self.metrics.close()
            raise
        except DataError as e:  # this rank's data shard alone: the others may be inside a collective of the step
            announce_user_error(str(e), 2)  # first: a rank whose collective fails now reports this error
            ckpt.close_alone()  # the saves so far commit, without a collective
            self.metrics.close()
            raise
        except StorageFull as e:  # a save's (every rank of it), or a rank's own files'
            announce_user_error(str(e), 2)
            with contextlib.suppress(OSError):
                self.metrics.close()
            raise
        except OSError as e:
            if not out_of_space(cfg.job.dump_folder, e):
                raise
            again = ("it resumes from the last committed checkpoint" if cfg.checkpoint.enable
                     else "without checkpoint.enable it starts over")
            full = StorageFull(f"job.dump_folder: no space left on the device of {cfg.job.dump_folder} while writing "
                               f"{e.filename or 'the run folder'}; free space there, then run the same command again "
                               f"({again})")
            announce_user_error(str(full), 2)
            raise full from e
        ckpt.close()
        if cfg.checkpoint.last_save_hf and self.step == cfg.training.steps:
            try:
                ckpt.export_hf(self.step, self.tokenizer.path)
            except Exception as e:
                if not out_of_space(ckpt.root, e):
                    raise
                full = StorageFull(f"checkpoint.last_save_hf: no space left on the device of {ckpt.root} while "
                                   f"exporting step {self.step}, whose checkpoint is committed; free space there, then "
                                   "run the same command again: it writes the Hugging Face folder")
                announce_user_error(str(full), 2)
                raise full from e
        self.metrics.close()
        if self.world.is_main and cfg.metrics.plots:
            self._plot()
        return logged

    def _plot(self) -> None:
        from engine.plot import plot_run

        plot_run(self.cfg.job.dump_folder)  # a failure is a warning line: the run's work is done
