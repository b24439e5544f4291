"""Where a run starts: the checkpoint it resumes from, its initial weights, or a fresh start.

``plan_resume`` decides it once, before anything is built (every rank agrees on it), and returns a ResumePlan that
the trainer carries out; the checks here stop a run whose checkpoint does not fit its model or its data with one
error line, before anything is written or allocated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist
from torch import nn

from engine.checkpoint.files import (CheckpointInfo, check_entries, inspect_checkpoint, is_model_only, list_steps,
                                     verify_checksums)
from engine.config import Config, ConfigError, check_shard_split, checkpoint_root, is_hf_folder, read_json_object
from engine.data.loader import READING_FIELDS, reading_options, source_id
from engine.distributed import agree_on_user_errors
from engine.hf import check_hf


@dataclass
class ResumePlan:
    """How a run starts, as plan_resume decided it: the trainer carries it out."""

    checkpoint: Optional[CheckpointInfo] = None
    """The checkpoint to resume from (checked): its model, optimizer, lr schedule and random generators are loaded."""
    load_data_position: bool = False
    """Whether the checkpoint's data position is loaded too (not with checkpoint.exclude_from_loading)."""
    initial_load_path: str = ""
    """Without a checkpoint to resume from: the initial weights (checkpoint.initial_load_path); "" for none."""
    initial_from_hf: bool = False
    """Whether initial_load_path is a Hugging Face folder (else a Tessera step folder)."""
    initial: Optional[CheckpointInfo] = None
    """initial_load_path as a Tessera step folder, checked (every rank its share of the files); None otherwise."""
    finished_at: Optional[int] = None
    """The newest step when it has reached training.steps already: nothing to train, nothing to build."""
    passed_over: str = ""
    """A line for the log about checkpoints found and not resumed from; "" when there are none."""

    @property
    def step(self) -> int:
        """The step the run goes on from."""
        return 0 if self.checkpoint is None else self.checkpoint.step


def plan_resume(cfg: Config) -> ResumePlan:
    """Decide how this run starts: the checkpoint it resumes from (agreed_resume_point), else its initial weights
    or a fresh start; whether it has reached training.steps already; what to say about checkpoints it passes over.
    Collective when there are several ranks (every rank gets the same plan, or the same error)."""
    c = cfg.checkpoint
    info = agreed_resume_point(cfg)
    plan = ResumePlan(info, load_data_position=info is not None and "dataloader" not in c.exclude_from_loading)
    if info is None and c.initial_load_path:
        plan.initial_load_path = c.initial_load_path
        plan.initial_from_hf = is_hf_folder(c.initial_load_path)
        if not plan.initial_from_hf:
            with agree_on_user_errors():
                plan.initial = inspect_checkpoint(c.initial_load_path, "checkpoint.initial_load_path", cfg, *_share())
    root = checkpoint_root(cfg)
    saved = [(step, folder) for step, folder, complete in list_steps(root) if complete]
    if c.enable and c.load_step != 0 and not c.create_seed_checkpoint:
        newest = plan.step
        if c.load_step < 0:  # the newest: a last save of the model only (last_save_model_only) ends a run too
            newest = max([newest] + [step for step, _ in saved])
            check_ranks_see_the_same_step(cfg, newest, "as the newest")
        if newest >= cfg.training.steps:
            plan.finished_at = newest
    newest, newest_folder = saved[-1] if saved else (0, "")
    if saved and not c.enable:
        plan.passed_over = (
            f"checkpoint: checkpoint.enable is off, so the {len(saved)} checkpoint(s) in {root} (newest: step "
            f"{newest}) are not resumed from and this run starts at step 0 (add --checkpoint.enable to resume)")
    elif newest > plan.step and c.load_step == -1 and not c.create_seed_checkpoint and is_model_only(newest_folder):
        plan.passed_over = (
            f"checkpoint: step {newest} in {root} holds the model only (no optimizer or data state), so it is not "
            f"resumed from and this run starts at step {plan.step}; to start from its weights instead, give its "
            "folder as checkpoint.initial_load_path in a new job.dump_folder")
    if c.checksums and plan.finished_at is None:
        verify_start(cfg, plan)
    return plan


def verify_start(cfg: Config, plan: ResumePlan) -> None:
    """Every rank reads its share of the files of the checkpoint the run resumes from, or of its initial weights
    (a Tessera step folder), against the checksums written with them (collective when there are several ranks): a
    damaged file stops every rank with one error line, before anything is built."""
    if plan.checkpoint is not None:
        info, field = plan.checkpoint, "checkpoint.load_step" if cfg.checkpoint.load_step > 0 else "checkpoint.folder"
    elif plan.initial is not None:
        info, field = plan.initial, "checkpoint.initial_load_path"
    else:
        return
    with agree_on_user_errors():
        verify_checksums(info, field, *_share())


def _share() -> tuple[int, int]:
    """This process's rank and the world size, for the checks the ranks split (1 rank outside a process group)."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def find_resume_point(cfg: Config) -> Optional[CheckpointInfo]:
    """The checkpoint this run resumes from (checked), or None to start fresh. Called before anything is
    built, so a bad checkpoint stops the run with one error line and nothing else happens."""
    c = cfg.checkpoint
    if not c.enable or c.load_step == 0 or c.create_seed_checkpoint:  # a seed is the freshly initialized model
        return None
    root = checkpoint_root(cfg)
    steps = list_steps(root)
    if c.load_step > 0:
        match = [s for s in steps if s[0] == c.load_step]
        if not match:
            have = ", ".join(str(s[0]) for s in steps if s[2]) or "none"
            raise ConfigError(f"checkpoint.load_step: no checkpoint of step {c.load_step} in {root} "
                              f"(complete steps: {have})")
        info = inspect_checkpoint(match[0][1], "checkpoint.load_step", cfg, *_share())
        if info.model_only:
            raise ConfigError(f"checkpoint.load_step: step {c.load_step} holds the model only (no optimizer or data "
                              "state); give it as checkpoint.initial_load_path to start a new run from it")
        return info
    for step, folder, complete in reversed(steps):
        if not complete:
            continue
        info = inspect_checkpoint(folder, "checkpoint.folder", cfg, *_share())
        if not info.model_only:
            return info
    return None


def agreed_resume_point(cfg: Config) -> Optional[CheckpointInfo]:
    """find_resume_point on every rank, and the ranks agree on it (collective when there are several): a bad
    checkpoint seen by some rank stops every rank, and ranks that see different checkpoints stop with one error
    line instead of loading different steps (check_ranks_see_the_same_step)."""
    with agree_on_user_errors():
        info = find_resume_point(cfg)
    check_ranks_see_the_same_step(cfg, None if info is None else info.step, "to resume from")
    return info


def check_ranks_see_the_same_step(cfg: Config, step: Optional[int], what: str) -> None:
    """Every rank found ``step`` in the checkpoint folder (collective when there are several ranks), or a
    ConfigError naming checkpoint.folder on every rank: a checkpoint folder on each node's own disk, or a network
    filesystem that shows the nodes different folders."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    steps: list = [None] * dist.get_world_size()
    dist.all_gather_object(steps, step)
    if len(set(steps)) > 1:
        first_rank = {s: steps.index(s) for s in steps}
        views = ", ".join(f"rank {rank} {'none' if s is None else f'step {s}'}"
                          for s, rank in sorted(first_rank.items(), key=lambda kv: kv[1]))
        raise ConfigError(f"checkpoint.folder: the ranks see different checkpoints {what} in {checkpoint_root(cfg)} "
                          f"({views}); put it on a filesystem every node shares and sees alike")


def check_fits_model(cfg: Config, model: nn.Module, model_args: Any, plan: ResumePlan) -> None:
    """Before anything is written or allocated: the checkpoint this run resumes from, or its initial weights
    (checkpoint.initial_load_path: a Tessera step folder or a Hugging Face folder), holds every tensor of
    ``model`` (the whole model, on the meta device) with its shape. Loading checks the same again for the tensors
    each rank holds. (A resumed data position is checked before: load_data_position.)"""
    if plan.checkpoint is not None:
        field, info = "checkpoint.folder", plan.checkpoint
    elif plan.initial_from_hf:
        check_hf(plan.initial_load_path, model_args, model_label=f"model.flavor {cfg.model.flavor}")
        return
    elif plan.initial is not None:
        field, info = "checkpoint.initial_load_path", plan.initial
    else:
        return
    check_entries(info, {f"model.{k}": v for k, v in model.state_dict().items()}, field)


def check_data_source(info: CheckpointInfo, source, cfg: Config, tokenizer=None) -> None:
    """The data position in checkpoint ``info`` belongs to the data this run reads (``source``, a
    engine.data.datasets.DataSource, framed by ``tokenizer``'s BOS/EOS when given); raises ConfigError naming the
    data field otherwise."""
    if "dataloader" in cfg.checkpoint.exclude_from_loading:
        return
    saved = read_json_object(os.path.join(info.folder, "dataloader", "dp-00000.json"), "checkpoint.folder")
    here = source_id(source.kind, source.name)
    for shard in dict(saved.get("shards", {})).values():
        there = source_id(*str(shard.get("source", ":")).split(":", 1))  # older states kept a path as given
        if there != here:
            raise ConfigError(
                f"{source.field}: the checkpoint of step {info.step} holds a position in {there}, this run reads "
                f"{here}; resume with the same data, or set checkpoint.exclude_from_loading = [\"dataloader\"] to "
                "read the new data from its beginning"
            )
        saved_reading = shard.get("reading") if isinstance(shard.get("reading"), dict) else {}  # older states: none
        for key, value in reading_options(cfg, source.kind, tokenizer).items():
            if key in saved_reading and saved_reading[key] != value:
                what = f"data.{key} =" if READING_FIELDS[key] == f"data.{key}" else f"a tokenizer whose {key} is"
                raise ConfigError(
                    f"{READING_FIELDS[key]}: the checkpoint of step {info.step} holds a position in {here} read with "
                    f"{what} {saved_reading[key]!r}, this run has {value!r}; resume with that, or set "
                    "checkpoint.exclude_from_loading = [\"dataloader\"] to read the data from its beginning"
                )
        if "streaming" in shard and bool(shard["streaming"]) != cfg.data.streaming:
            raise ConfigError(
                f"data.streaming: the checkpoint of step {info.step} holds a position in the data read with "
                f"data.streaming = {str(bool(shard['streaming'])).lower()} (another order); resume with that, or set "
                "checkpoint.exclude_from_loading = [\"dataloader\"] to read the data from its beginning"
            )


def load_data_position(info: CheckpointInfo, cfg: Config, loader: Any, rebuild_loader: Callable[[int], Any]) -> Any:
    """The data position of checkpoint ``info`` into ``loader`` (a ShardedDataLoader; nothing with
    checkpoint.exclude_from_loading = ["dataloader"]): every shard of this rank's loader from the file of the dp rank
    that held it when saved. On the same dp degree, that rank's turn goes on; on another, the loader derives this
    rank's turn from its shards' positions (ShardedDataLoader.load_state_dict). A checkpoint of another count of
    logical shards is loaded into ``rebuild_loader(num_shards)``. Returns the loader that holds the position.
    Cheap (no data is read), so the trainer does it among its set-up checks, whose errors every rank agrees on: a
    position past the end of data that has changed since is a ConfigError naming the data field, on every rank,
    before the model is built."""
    if "dataloader" in cfg.checkpoint.exclude_from_loading:
        return loader
    num_shards, old_dp = int(info.train_state["num_shards"]), int(info.train_state["dp"])
    if num_shards != loader.num_shards:
        check_shard_split(num_shards, loader.dp_world_size, f"the checkpoint of step {info.step} holds a data "
                          f"position in", f"resume on a dp degree that divides {num_shards}, or set "
                          "checkpoint.exclude_from_loading = [\"dataloader\"]")
        loader = rebuild_loader(num_shards)
    state: dict = {"version": 1, "num_shards": num_shards, "shards": {}}
    for old_rank in sorted({s % old_dp for s in loader.shard_ids}):
        saved = read_json_object(os.path.join(info.folder, "dataloader", f"dp-{old_rank:05d}.json"),
                                 "checkpoint.folder")
        state["shards"].update(saved["shards"])
        if old_dp == loader.dp_world_size:  # the same shards, read in the same round robin
            state["turn"] = saved.get("turn", 0)
    loader.load_state_dict(state)
    return loader
