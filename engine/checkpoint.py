"""Checkpoints on torch.distributed.checkpoint (DCP): save, resume on any mesh, survive any crash.

Layout of one checkpoint, ``<checkpoint.folder>/step-000100/``:

- ``.metadata`` and ``__<rank>_<n>.distcp``: DCP's files. They hold the model (``model.<fqn>``) and the
  optimizer state (``optim.<fqn>.<exp_avg|exp_avg_sq|step>``) as sharded tensors, named by the full model's
  parameter names whatever the layout (FSDP/TP shards are DTensors, pipeline stages keep the whole model's
  names), so DCP reshards them on load to any mesh. Nothing else goes into DCP: no pickled Python object.
- ``train_state.json``: step, lr schedule, model name and flavor, the layout it was saved on.
- ``dataloader/dp-00003.json``: the data position of each data-parallel rank (every logical data shard's
  position; engine/data/loader.py), so a run resumes on another dp degree without repeating or skipping.
- ``rng/rank-00005.json``: each rank's random generators (restored when the layout is the same).
- ``COMMITTED.json``: written last, by rank 0, once every rank has written everything; it lists every file
  with its size. A folder without it is incomplete: never loaded, never counted by keep_latest_k.

Loading never unpickles arbitrary objects: DCP's ``.metadata`` (a pickle) is read with an unpickler that
only accepts DCP's metadata classes and torch sizes/dtypes, a checkpoint with byte (pickled) entries is
refused, and tensors are read with ``torch.load(weights_only=True)`` by DCP itself.

Async save (checkpoint.async_mode): the state is staged (copied; through pinned memory on CUDA with
async_with_pinned_mem) and written by a background thread over a separate gloo process group while
training goes on; the commit follows once every rank's write has finished (voted on at each step boundary).
Everything else (sync saves, loads, votes, barriers) runs on the default process group.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import queue
import random
import re
import shutil
import signal
import threading
import time
import traceback
import warnings
import zipfile
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from engine.config import Config, ConfigError, check_shard_split, is_hf_folder, read_json_object
from engine.distributed import agree_on_user_errors, keep_own_timeout, log_ranks, longer_collective_timeout
from engine.hf import EXPORT_DTYPES
from engine.optim import load_lr_scheduler_state

COMMIT_FILE = "COMMITTED.json"
TRAIN_STATE_FILE = "train_state.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_REMOVING_DIR = re.compile(r"^step-(\d+)\.removing(\.\d+)?$")  # let go by keep_latest_k; deleted in the background
_HF_DIR = re.compile(r"^step-(\d+)-hf$")
# DCP warns on every single-process save and load, even when asked for one (no_dist=True): a one-process run
# means it, so the warning would only clutter the console at every checkpoint.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized, assuming")


def step_folder(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:06d}")


def hf_export_folder(root: str, step: int) -> str:
    """Where checkpoint.last_save_hf writes the Hugging Face folder of ``step`` (not a step-N folder: never
    resumed from, never removed by keep_latest_k)."""
    return step_folder(root, step) + "-hf"


def export_last_hf(cfg: Config, step: int, tokenizer_path: str, rank: int, world_size: int) -> None:
    """checkpoint.last_save_hf: the ranks write the committed checkpoint of ``step`` as a Hugging Face folder
    together, each output shard by one rank, one rank per node first (``engine.hf.export_checkpoint_hf``), unless
    the folder exists (the export is atomic: it is complete). Rank 0 finishes the folder once every shard is there;
    the ranks coordinate through the files alone (the export may take longer than a collective's timeout)."""
    from engine.hf import export_checkpoint_hf

    root = checkpoint_root(cfg)
    out = hf_export_folder(root, step)
    if os.path.exists(out):
        if rank == 0:
            print(f"checkpoint: {out} already exists; left as it is", flush=True)
        return
    t0 = time.perf_counter()
    node_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    what = export_checkpoint_hf(step_folder(root, step), out, EXPORT_DTYPES[cfg.checkpoint.export_dtype],
                                tokenizer_path, field="checkpoint.last_save_hf", rank=rank, world_size=world_size,
                                node_size=node_size)
    if rank == 0:
        shards = sum(name.endswith(".safetensors") for name in os.listdir(out))
        print(f"checkpoint: Hugging Face folder of {what} ({cfg.checkpoint.export_dtype}) written in "
              f"{time.perf_counter() - t0:.1f}s, {shards} shard(s) by {min(world_size, shards)} rank(s) -> {out}",
              flush=True)


def checkpoint_root(cfg: Config) -> str:
    folder = cfg.checkpoint.folder
    return folder if os.path.isabs(folder) else os.path.join(cfg.job.dump_folder, folder)


def fault_point(step: int, point: str) -> None:
    """Fault injection for tests: TESSERA_FAULT_AT=<step>:<point> kills this process with SIGKILL there
    (with SIGTERM for the point "sigterm", which the trainer passes in the middle of every step);
    <step>:<point>:stall stops the thread there for good instead, and once the last stall of a comma-separated
    list is reached it creates the file TESSERA_FAULT_STALLED names (a test then kills the launcher)."""
    faults = os.environ.get("TESSERA_FAULT_AT", "").split(",")
    if f"{step}:{point}" in faults:
        os.kill(os.getpid(), signal.SIGTERM if point == "sigterm" else signal.SIGKILL)
    elif f"{step}:{point}:stall" in faults:
        if faults[-1] == f"{step}:{point}:stall":
            open(os.environ["TESSERA_FAULT_STALLED"], "a").close()
        while True:
            time.sleep(1)


_fault = fault_point


# ------------------------------------------------------------------------------------------------------------
# Reading checkpoints safely
# ------------------------------------------------------------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata and nothing else: the classes of DCP's metadata module (plain dataclasses and
    enums) and the storage info of its file system writer, torch sizes, dtypes and layouts, paths. A name is
    one attribute of its module (no dotted paths, which would reach anything the module imports)."""

    _CLASS_MODULES = ("torch.distributed.checkpoint.metadata",)
    _GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath")}

    def find_class(self, module: str, name: str):
        if "." not in name:
            if (module, name) in self._GLOBALS:
                return super().find_class(module, name)
            if module in self._CLASS_MODULES:
                obj = super().find_class(module, name)
                if isinstance(obj, type) and obj.__module__ == module:  # defined there, not imported
                    return obj
            if module == "torch" and isinstance(getattr(torch, name, None),
                                                (torch.dtype, torch.layout, torch.memory_format)):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


def _undecodable(e: BaseException) -> bool:
    """Whether ``e``, raised by DCP's read_data, says that a data file's bytes do not decode: torch.load (its zip
    reader or its weights-only unpickler) failed on them, or DCP found the decoded tensor of another size than
    the saved one. Not an OSError (the file could not be read), nor anything raised elsewhere (a device error, a
    bug)."""
    if isinstance(e, OSError):
        return False
    if isinstance(e, (pickle.UnpicklingError, zipfile.BadZipFile)):
        return True
    if isinstance(e, AssertionError) and "mismatch sizes" in str(e):  # DCP's check of the decoded tensor
        return True
    return any(os.path.basename(frame.filename) == "serialization.py" and
               os.path.basename(os.path.dirname(frame.filename)) == "torch"
               for frame in traceback.extract_tb(e.__traceback__))  # inside torch.load


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with a restricted unpickler for the metadata, whose decoding errors (a file damaged after
    its commit marker was written: the sizes match, the bytes do not) are ConfigErrors naming ``field``. A file that
    cannot be read (OSError: a failing disk, a stale network mount) is an OSError naming it; other errors are
    DCP's, with their tracebacks."""

    def __init__(self, path: str, field: str = "checkpoint.folder"):
        super().__init__(path)
        self.field = field

    def read_data(self, *args: Any, **kwargs: Any):
        try:
            return super().read_data(*args, **kwargs)
        except OSError as e:  # the disk or the mount (maybe briefly), not the checkpoint: no "pick another step"
            where = f"'{e.filename}'" if e.filename else f"a data file of '{self.path}'"
            message = f"{self.field}: cannot read {where}: {e.strerror or e}"
            raise (OSError(e.errno, message) if e.errno is not None else OSError(message)) from e
        except Exception as e:
            if not _undecodable(e):
                raise
            reason = f"{type(e).__name__}: {str(e).split(chr(10))[0].split('. ')[0]}"[:200]
            raise ConfigError(
                f"{self.field}: a data file of '{self.path}' is damaged (its size is as saved, its bytes are not: "
                f"{reason}); " + ("pick another step with checkpoint.load_step" if self.field == "checkpoint.folder"
                                  else f"use another step folder for {self.field}")
            ) from None

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = os.path.join(str(self.path), ".metadata")
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def dcp_load(state: dict, folder: str, field: str, no_dist: bool) -> None:
    """``dcp.load`` of ``state`` from the step folder ``folder``; a damaged data file (on any rank) is the
    ConfigError naming ``field`` on every rank, not DCP's exception with each rank's traceback, and a file that
    cannot be read is the OSError naming it (DCP's exception, with the tracebacks, chained)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(folder, field), no_dist=no_dist)
    except CheckpointException as e:
        errors = [exc for exc, _ in e.failures.values() if isinstance(exc, ConfigError)]
        if errors:
            raise errors[0] from None
        unreadable = [exc for exc, _ in e.failures.values() if isinstance(exc, OSError)]
        if unreadable:  # the reader's OSError naming the file (its traceback is DCP's exception's, chained)
            raise unreadable[0] from e
        raise


def write_json(path: str, data: dict) -> None:
    """Write atomically: a reader sees the old file or the whole new one."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_commit_marker(folder: str, step: int) -> dict[str, int]:
    """Mark the step folder ``folder`` complete, once everything else in it is written: the marker lists every
    file with its size, which inspect_checkpoint compares. Returns that list."""
    files = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            files[os.path.relpath(path, folder)] = os.path.getsize(path)
    write_json(os.path.join(folder, COMMIT_FILE), {"step": step, "files": files, "time": time.time()})
    return files


def is_complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, COMMIT_FILE))


def _set_aside(folder: str, suffix: str) -> str:
    """Rename ``folder`` to the first free name of ``folder + suffix``, ``folder + suffix + ".1"``, ...; returns
    it. Nothing is overwritten."""
    aside, n = folder + suffix, 1
    while os.path.exists(aside):
        aside, n = f"{folder}{suffix}.{n}", n + 1
    os.replace(folder, aside)
    return aside


def is_model_only(folder: str) -> bool:
    try:
        with open(os.path.join(folder, TRAIN_STATE_FILE)) as f:
            return bool(json.load(f).get("model_only"))
    except (OSError, ValueError, AttributeError):
        return False


def list_steps(root: str) -> list[tuple[int, str, bool]]:
    """(step, folder, complete) of every step-N folder in ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path):
            found.append((int(m.group(1)), path, is_complete(path)))
    return sorted(found)


@dataclass
class CheckpointInfo:
    """A complete checkpoint, checked: its folder, step and train_state.json."""

    folder: str
    step: int
    train_state: dict
    tensors: dict[str, TensorStorageMetadata]
    """DCP's entries: name -> global shape and dtype."""

    @property
    def model_only(self) -> bool:
        return bool(self.train_state.get("model_only"))


def inspect_checkpoint(folder: str, field: str, cfg: Optional[Config] = None) -> CheckpointInfo:
    """Check a checkpoint folder without loading its tensors; raises ConfigError naming ``field``.

    Checks: the commit marker, every listed file present with its size (a truncated shard is caught
    here), DCP's metadata readable without pickled objects, and train_state.json naming the same model and
    flavor as ``cfg``.
    """
    # A run's own checkpoints are chosen with checkpoint.load_step; any other folder is given by path.
    another = ("pick another step with checkpoint.load_step" if field in ("checkpoint.load_step", "checkpoint.folder")
               else f"use another step folder for {field}")
    if not os.path.isdir(folder):
        raise ConfigError(f"{field}: checkpoint folder {folder} not found")
    if not os.listdir(folder):
        raise ConfigError(f"{field}: checkpoint folder {folder} is empty")
    if not is_complete(folder):
        complete = [path for _, path, ok in list_steps(folder) if ok]
        if complete:  # the folder of a run's checkpoints, not one of them
            raise ConfigError(f"{field}: {folder} holds step folders, not a checkpoint; give one of them, e.g. the "
                              f"newest complete one, {complete[-1]}")
        if not any(n in (".metadata", TRAIN_STATE_FILE) or n.endswith(".distcp") for n in os.listdir(folder)):
            # nothing a save writes: not a checkpoint at all
            want = (f"a Tessera step folder (with {COMMIT_FILE}) or a Hugging Face folder (with config.json)"
                    if field == "checkpoint.initial_load_path" else f"a Tessera step folder (with {COMMIT_FILE})")
            raise ConfigError(f"{field}: {folder} is not a checkpoint (no {COMMIT_FILE}, no DCP files); give {want}")
        raise ConfigError(f"{field}: {folder} is an incomplete checkpoint (no {COMMIT_FILE}: the save did not "
                          f"finish); {another}")

    def read_small_file(name: str) -> dict:
        try:
            return read_json_object(os.path.join(folder, name), field)
        except ConfigError as e:  # damaged or edited
            raise ConfigError(f"{e}; {another}") from None

    commit = read_small_file(COMMIT_FILE)
    for rel, size in dict(commit.get("files", {})).items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            raise ConfigError(f"{field}: {folder} is damaged: {rel} is missing; {another}")
        actual = os.path.getsize(path)
        if actual != size:
            raise ConfigError(f"{field}: {folder} is damaged: {rel} has {actual} bytes, {size} were written "
                              f"(truncated or overwritten); {another}")
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise ConfigError(f"{field}: {folder} has no DCP .metadata file; it is not a Tessera checkpoint")
    try:
        metadata = SafeFileSystemReader(folder).read_metadata()
    except Exception as e:  # corrupt, or holding objects we refuse to unpickle
        raise ConfigError(f"{field}: {folder}/.metadata is unreadable or unsafe ({str(e)[:200]}); {another}") from None
    tensors = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            raise ConfigError(f"{field}: {folder} holds a pickled object ({key}); Tessera does not load those")
        tensors[key] = md
    state = read_small_file(TRAIN_STATE_FILE)
    if state.get("format") != FORMAT_VERSION:
        raise ConfigError(f"{field}: {folder}/{TRAIN_STATE_FILE} has format {state.get('format')}, expected {FORMAT_VERSION}")
    if cfg is not None and (state.get("model"), state.get("flavor")) != (cfg.model.name, cfg.model.flavor):
        raise ConfigError(
            f"{field}: {folder} was saved for model {state.get('model')}/{state.get('flavor')}, this run is "
            f"{cfg.model.name}/{cfg.model.flavor}; set model.flavor to match or use another checkpoint folder"
        )
    bad = _train_state_problems(state)
    if bad:
        raise ConfigError(f"{field}: {folder}/{TRAIN_STATE_FILE} has no valid {', '.join(bad)} (edited or damaged); "
                          f"{another}")
    return CheckpointInfo(folder, int(state["step"]), state, tensors)


def _train_state_problems(state: dict) -> list[str]:
    """The train_state.json entries that loading reads and that are missing or of the wrong type."""
    def count(value, least: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= least

    bad = [] if count(state.get("step"), 0) else ["step"]
    if not state.get("model_only"):
        sched = state.get("lr_scheduler")
        if not (isinstance(sched, dict) and count(sched.get("last_epoch"), 0)):
            bad.append("lr_scheduler.last_epoch")
        bad += [key for key in ("dp", "num_shards") if not count(state.get(key), 1)]
    return bad


def check_data_source(info: CheckpointInfo, source, cfg: Config, tokenizer=None) -> None:
    """The data position in checkpoint ``info`` belongs to the data this run reads (``source``, a
    engine.data.datasets.DataSource, framed by ``tokenizer``'s BOS/EOS when given); raises ConfigError naming the
    data field otherwise."""
    from engine.data.loader import READING_FIELDS, reading_options, source_id

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
        info = inspect_checkpoint(match[0][1], "checkpoint.load_step", cfg)
        if info.model_only:
            raise ConfigError(f"checkpoint.load_step: step {c.load_step} holds the model only (no optimizer or data "
                              "state); give it as checkpoint.initial_load_path to start a new run from it")
        return info
    for step, folder, complete in reversed(steps):
        if not complete:
            continue
        info = inspect_checkpoint(folder, "checkpoint.folder", cfg)
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


def check_fits_model(cfg: Config, model: nn.Module, model_args: Any, resume_from: Optional[CheckpointInfo]) -> None:
    """Before anything is written or allocated: the checkpoint this run resumes from, or its initial weights
    (checkpoint.initial_load_path: a Tessera step folder or a Hugging Face folder), holds every tensor of
    ``model`` (the whole model, on the meta device) with its shape. Loading checks the same again for the tensors
    each rank holds. (A resumed data position is checked before: load_data_position.)"""
    init_path = cfg.checkpoint.initial_load_path
    if resume_from is not None:
        field, info = "checkpoint.folder", resume_from
    elif init_path and is_hf_folder(init_path):
        from engine.hf import check_hf

        check_hf(init_path, model_args, model_label=f"model.flavor {cfg.model.flavor}")
        return
    elif init_path:
        field, info = "checkpoint.initial_load_path", inspect_checkpoint(init_path, "checkpoint.initial_load_path", cfg)
    else:
        return
    Checkpointer._check_entries(info, {f"model.{k}": v for k, v in model.state_dict().items()}, field)


def load_data_position(info: CheckpointInfo, trainer: Any) -> None:
    """The data position of checkpoint ``info`` into ``trainer``'s loader (nothing with checkpoint.exclude_from_loading
    = ["dataloader"]): every shard of this rank's loader from the file of the dp rank that held it when saved. On the
    same dp degree, that rank's turn goes on; on another, the loader derives this rank's turn from its shards'
    positions (ShardedDataLoader.load_state_dict). Cheap (no data is read), so the trainer does it among its set-up
    checks, whose errors every rank agrees on: a position past the end of data that has changed since is a
    ConfigError naming the data field, on every rank, before the model is built."""
    if "dataloader" in trainer.cfg.checkpoint.exclude_from_loading:
        return
    num_shards, old_dp = int(info.train_state["num_shards"]), int(info.train_state["dp"])
    if num_shards != trainer.dataloader.num_shards:
        check_shard_split(num_shards, trainer.dp_size, f"the checkpoint of step {info.step} holds a data position in",
                          f"resume on a dp degree that divides {num_shards}, or set "
                          "checkpoint.exclude_from_loading = [\"dataloader\"]")
        trainer.rebuild_dataloader(num_shards)
    loader = trainer.dataloader
    state: dict = {"version": 1, "num_shards": num_shards, "shards": {}}
    for old_rank in sorted({s % old_dp for s in loader.shard_ids}):
        saved = read_json_object(os.path.join(info.folder, "dataloader", f"dp-{old_rank:05d}.json"),
                                 "checkpoint.folder")
        state["shards"].update(saved["shards"])
        if old_dp == loader.dp_world_size:  # the same shards, read in the same round robin
            state["turn"] = saved.get("turn", 0)
    loader.load_state_dict(state)


# ------------------------------------------------------------------------------------------------------------
# State dicts
# ------------------------------------------------------------------------------------------------------------


def _encode_tensor(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _decode_tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": _encode_tensor(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = _encode_tensor(torch.cuda.get_rng_state())
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(_decode_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_decode_tensor(state["cuda"]))


def async_save_group(async_mode: str, timeout_seconds: float = 1800):
    """The process group an async save's background writer uses: a gloo group of every rank when the run has a
    process group (a world of one included: on CUDA its default group is NCCL's alone, which DCP's async save
    refuses), None when it has none (DCP then saves without collectives) or saves are synchronous. Its
    collectives wait for every rank's writes: they keep ``timeout_seconds`` (comm.checkpoint_timeout_seconds),
    not the training's timeout."""
    if not dist.is_initialized() or async_mode == "disabled":
        return None
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))
    keep_own_timeout(group)
    return group


def _purge_loop(folders: "queue.Queue[Optional[str]]") -> None:
    """The purge thread: delete each folder put in ``folders`` until None comes."""
    while (folder := folders.get()) is not None:
        shutil.rmtree(folder, ignore_errors=True)


class Checkpointer:
    """Saves and loads one run's training state. Every rank calls every method (they are collective)."""

    def __init__(self, cfg: Config, trainer: Any):
        self.cfg = cfg
        self.trainer = trainer
        self.root = checkpoint_root(cfg)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.is_main = self.rank == 0
        c = cfg.checkpoint
        self.async_mode = c.async_mode if c.enable else "disabled"
        # Saves, loads, votes and barriers run on the default process group, from the training thread, at the
        # same points on every rank. Only an async save's background writer needs a group of its own (gloo:
        # its collectives run beside the training's), as torchtitan's: a gloo group connects every pair of
        # ranks at creation, which takes long at thousands of ranks. A world of one rank needs it too when it has
        # a process group (fsdp_single_rank): DCP's async save refuses a default group without a CPU backend, as
        # NCCL's is.
        self.distributed = dist.is_initialized() and self.world_size > 1
        self.pg = async_save_group(self.async_mode, cfg.comm.checkpoint_timeout_seconds)
        self.stop_vote = _Vote(trainer.world.device) if self.distributed else None
        self.commit_vote = _Vote(trainer.world.device) if self.distributed else None
        self.stager = None
        if self.async_mode == "async_with_pinned_mem" and torch.cuda.is_available():
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                       use_async_staging=False, use_non_blocking_copy=True))
        self.pending: Optional[dict] = None  # an async save being written: step, future, start time, steps
        self._purge_thread: Optional[threading.Thread] = None  # deleting checkpoints that keep_latest_k let go
        self._purge_queue: Optional[queue.Queue] = None
        self._purge_queued: set[str] = set()
        self.preempted = False

    # -- state dicts -------------------------------------------------------------------------------------------
    def _parts(self) -> list[nn.Module]:
        return self.trainer.model_parts

    def model_state(self, parts: Optional[list[dict[str, torch.Tensor]]] = None) -> dict[str, torch.Tensor]:
        """``model.<fqn>`` -> tensor (DTensor when sharded) for every part (pipeline stages) of this rank, from
        ``parts`` (``_part_states``) when given."""
        parts = self._part_states() if parts is None else parts
        return {f"model.{k}": v for part_state in parts for k, v in part_state.items()}

    def _part_states(self) -> list[dict[str, torch.Tensor]]:
        """Each part's state dict (fqn -> tensor). With split bf16 weights every call builds the fp32 weights
        anew, so a load reads the parts' keys from the same dicts it loads into (``_set_model``)."""
        return [get_model_state_dict(part) for part in self._parts()]

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(``optim.<fqn>.<state>`` -> tensor, the full flattened optimizer state dict as torch returns it)."""
        flat = get_optimizer_state_dict(self.trainer.model, self.trainer.optimizer,
                                        options=StateDictOptions(flatten_optimizer_state_dict=True))
        pp = isinstance(self.trainer.model, nn.ModuleList)
        out = {}
        for key, value in flat.items():
            if not key.startswith("state."):
                continue  # param_groups: hyperparameters, from the config
            assert isinstance(value, torch.Tensor), key
            name = key[len("state."):]
            if pp:
                name = name.split(".", 1)[1]  # drop the part index: parts keep the whole model's names
            out[f"optim.{name}"] = value
        return out, flat

    # -- save ------------------------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        c = self.cfg.checkpoint
        return c.enable and (step % c.interval == 0 or step == self.cfg.training.steps)

    def save(self, step: int, model_only: bool = False, force_sync: bool = False, dtype: str = "") -> None:
        """Save the state after ``step`` optimizer steps (collective). ``model_only``: the weights alone, in
        ``dtype`` (default checkpoint.export_dtype). Its collectives wait for every rank's writes: they take
        comm.checkpoint_timeout_seconds."""
        with longer_collective_timeout(self.cfg.comm.checkpoint_timeout_seconds):
            self._save(step, model_only, force_sync, dtype)

    def _save(self, step: int, model_only: bool, force_sync: bool, dtype: str) -> None:
        dtype = dtype or self.cfg.checkpoint.export_dtype
        self.wait()  # one save at a time
        folder = step_folder(self.root, step)
        if self.is_main:
            os.makedirs(self.root, exist_ok=True)
            if os.path.exists(folder) and not is_complete(folder):  # our own leftover: an unfinished save
                if os.path.exists(folder + ".incomplete"):
                    shutil.rmtree(folder + ".incomplete")
                os.replace(folder, folder + ".incomplete")
            elif os.path.exists(folder):  # committed by this run before a rollback (checkpoint.load_step): kept
                self._log(f"checkpoint: an earlier checkpoint of step {step} is set aside as "
                          f"{_set_aside(folder, '.replaced')}")
                export = hf_export_folder(self.root, step)
                if os.path.exists(export):  # its export would pass for this run's
                    self._log(f"checkpoint: its Hugging Face folder is set aside as {_set_aside(export, '.replaced')}")
        self._barrier()
        _fault(step, "begin")
        t0 = time.perf_counter()
        if model_only:  # each tensor cast in turn: a temporary fp32 weight (split bf16 weights) goes at once
            state = self.model_state()
            for k in list(state):
                state[k] = state[k].detach().to(EXPORT_DTYPES[dtype])
        else:
            state = {**self.model_state(), **self.optimizer_state()[0]}
        self._write_small_files(folder, step, model_only, dtype)
        _fault(step, "small_files")
        use_async = self.async_mode != "disabled" and not force_sync and not model_only
        writer = step_writer(folder, step, background=use_async)
        if use_async:
            future = dcp.async_save(state, storage_writer=writer, process_group=self.pg,
                                    async_stager=self.stager) if self.stager is not None else \
                dcp.async_save(state, storage_writer=writer, process_group=self.pg)
            future = getattr(future, "upload_completion", future)
            self.pending = {"step": step, "future": future, "t0": t0, "staged": time.perf_counter() - t0,
                            "steps": 0}
            self._log(f"checkpoint: step {step} staged in {self.pending['staged']:.2f}s; writing in the background")
            return
        dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())
        _fault(step, "dcp_done")
        self._commit(step, folder, time.perf_counter() - t0, model_only)

    def _write_small_files(self, folder: str, step: int, model_only: bool, dtype: str) -> None:
        t = self.trainer
        if self.is_main:
            write_json(os.path.join(folder, TRAIN_STATE_FILE), {
                "format": FORMAT_VERSION,
                "step": step,
                "model_only": model_only,
                "model": self.cfg.model.name,
                "flavor": self.cfg.model.flavor,
                "max_seq_len": t.model_args.max_seq_len,  # the flavor's, or the longer seq_len trained at
                "dtype": dtype if model_only else "float32",
                "world_size": self.world_size,
                "layout": t.dims.describe(),
                "dp": t.dp_size,
                "num_shards": t.dataloader.num_shards,
                "tokenizer": os.path.abspath(t.tokenizer.path),  # what convert_hf to-hf copies by default
                "lr_scheduler": t.lr_scheduler.state_dict(),
            })
        if model_only:
            return
        if t.dims.is_dp_leader():  # one copy per data-parallel rank
            write_json(os.path.join(folder, "dataloader", f"dp-{t.dp_rank:05d}.json"), t.data_state())
        write_json(os.path.join(folder, "rng", f"rank-{self.rank:05d}.json"), rng_state())

    def _commit(self, step: int, folder: str, seconds: float, model_only: bool, overlapped: int = 0) -> None:
        """Every rank has written everything: rank 0 writes the marker listing every file, then retention."""
        with longer_collective_timeout(self.cfg.comm.checkpoint_timeout_seconds):  # the ranks wait for rank 0
            self._commit_files(step, folder, seconds, model_only, overlapped)

    def _commit_files(self, step: int, folder: str, seconds: float, model_only: bool, overlapped: int) -> None:
        self._barrier()
        if self.is_main:
            self._write_commit(step, folder, seconds, model_only, overlapped)
        self._barrier()
        _fault(step, "committed")

    def _write_commit(self, step: int, folder: str, seconds: float, model_only: bool, overlapped: int) -> None:
        """Rank 0, once every rank's files of ``step`` are written: the marker, then retention."""
        _fault(step, "before_commit")
        files = write_commit_marker(folder, step)
        size = sum(files.values()) / 2**20
        how = f"in the background over {overlapped} training steps, " if overlapped else ""
        self._log(f"checkpoint: step {step} committed ({'model only, ' if model_only else ''}{size:.1f} MiB "
                  f"written {how}in {seconds:.2f}s) -> {folder}")
        if not self.cfg.checkpoint.create_seed_checkpoint:  # a last save of the model only commits the run too
            self._set_aside_later_steps(step)
        self._retention()

    def _set_aside_later_steps(self, step: int) -> None:
        """This run went back to an earlier step (checkpoint.load_step) and has now committed ``step``: the
        checkpoints after it belong to the abandoned continuation. Renamed (not deleted), so that neither a
        resume nor keep_latest_k takes them for this run's."""
        for later, folder, _ in list_steps(self.root):
            if later > step:
                self._log(f"checkpoint: step {later} belongs to the continuation this run went back from; set "
                          f"aside as {_set_aside(folder, '.abandoned')}")
        for name in sorted(os.listdir(self.root)):
            m = _HF_DIR.match(name)
            if m and int(m.group(1)) > step:
                self._log(f"checkpoint: the Hugging Face folder of step {int(m.group(1))} belongs to that "
                          f"continuation too; set aside as {_set_aside(os.path.join(self.root, name), '.abandoned')}")

    def _retention(self) -> None:
        """checkpoint.keep_latest_k: remove all but the newest k complete full checkpoints. Incomplete ones never
        count; model-only ones (the last save's export, a seed) neither count nor are removed, so the newest
        resumable checkpoint always stays."""
        k = self.cfg.checkpoint.keep_latest_k
        if k <= 0:
            return
        full = [(s, f) for s, f, ok in list_steps(self.root) if ok and not is_model_only(f)]
        removing = [os.path.join(self.root, name) for name in os.listdir(self.root) if _REMOVING_DIR.match(name)]
        for step, folder in full[:-k]:  # out of the way at once (a rename), deleted in the background
            try:
                removing.append(_set_aside(folder, ".removing"))
            except OSError:  # a filesystem that cannot rename folders: deleted here
                shutil.rmtree(folder, ignore_errors=True)
        if removing:
            self._purge(removing)

    def _purge(self, folders: list[str]) -> None:
        """Delete ``folders`` in a background thread: a large checkpoint's files on a shared filesystem take long
        to delete, and neither rank 0's training nor the ranks waiting for it at the commit should. One thread
        deletes them in turn, however many commits hand it folders before it is done."""
        if self._purge_thread is None:
            self._purge_queue = queue.Queue()
            self._purge_thread = threading.Thread(target=_purge_loop, args=(self._purge_queue,),
                                                  name="checkpoint-purge", daemon=True)
            self._purge_thread.start()
        for folder in folders:
            if folder not in self._purge_queued:  # (a folder still being deleted is listed again meanwhile)
                self._purge_queued.add(folder)
                self._purge_queue.put(folder)

    def wait_purge(self) -> None:
        """Wait for the checkpoints being deleted (keep_latest_k) to be gone."""
        thread, self._purge_thread = self._purge_thread, None
        if thread is not None:
            self._purge_queue.put(None)
            thread.join()

    def poll(self) -> None:
        """At a step boundary: commit a finished async save once every rank has finished writing it (with
        several ranks, as the vote of the previous boundary says: the vote runs during a step)."""
        if self.pending is None:
            return
        self.pending["steps"] += 1
        writing = int(not self.pending["future"].done())
        if self.commit_vote is None:
            if not writing:
                self._finish_pending()
            return
        if self.commit_vote.collect() == 0:  # the previous boundary's vote (none at the first after the save)
            self._finish_pending()
        else:
            self.commit_vote.start(writing)

    def wait(self) -> None:
        """Block until an async save has been written and committed."""
        if self.pending is not None:
            self.pending["future"].result()
            self._finish_pending()

    def _finish_pending(self) -> None:
        if self.commit_vote is not None:
            self.commit_vote.collect()  # a vote on this save still in flight (wait() came first): spent
        p, self.pending = self.pending, None
        p["future"].result()  # raises the writer's error, if any
        _fault(p["step"], "dcp_done")
        self._commit(p["step"], step_folder(self.root, p["step"]), time.perf_counter() - p["t0"], False,
                     overlapped=max(p["steps"], 1) if p["steps"] else 0)

    def export_hf(self, step: int, tokenizer_path: str) -> None:
        """checkpoint.last_save_hf (``export_last_hf``): every rank calls it."""
        rank = dist.get_rank() if self.distributed else 0
        export_last_hf(self.cfg, step, tokenizer_path, rank, self.world_size if self.distributed else 1)

    # -- preemption -------------------------------------------------------------------------------------------
    def install_sigterm_handler(self) -> None:
        def handler(signum, frame):
            self.preempted = True

        signal.signal(signal.SIGTERM, handler)

    def stop_requested(self) -> bool:
        """Whether any rank got SIGTERM; called by every rank at every step boundary. All ranks agree, so they
        stop at the same step boundary: with several ranks, the one after the vote that saw the signal (the
        vote runs during a step, see ``_Vote``)."""
        if self.stop_vote is None:
            return self.preempted
        stop = self.stop_vote.collect()  # the previous boundary's vote (none at the first)
        self.stop_vote.start(int(self.preempted))
        return bool(stop)

    # -- load ------------------------------------------------------------------------------------------------
    def load(self, info: CheckpointInfo) -> int:
        """Load the whole training state of ``info`` (any layout) but the data position, which the trainer loads
        among its set-up checks (load_data_position); returns its step."""
        t0 = time.perf_counter()
        parts = self._part_states()
        model = self.model_state(parts)
        optim, flat = self.optimizer_state()
        self._check_entries(info, {**model, **optim}, "checkpoint.folder")
        state = {**model, **optim}
        dcp_load(state, info.folder, "checkpoint.folder", no_dist=not dist.is_initialized())
        self._set_model(state, parts)
        pp = isinstance(self.trainer.model, nn.ModuleList)
        for key in flat:
            if key.startswith("state."):
                name = key[len("state."):]
                flat[key] = state["optim." + (name.split(".", 1)[1] if pp else name)]
        set_optimizer_state_dict(self.trainer.model, self.trainer.optimizer, flat,
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))
        # The optimizer's hyperparameters and the schedule come from the config; the saved step places it.
        saved_lr = info.train_state["lr_scheduler"].get("base_lrs", [None])[0]
        load_lr_scheduler_state(self.trainer.lr_scheduler, info.train_state["lr_scheduler"])
        if saved_lr is not None and saved_lr != self.trainer.lr_scheduler.base_lrs[0]:
            self._log(f"checkpoint: optimizer.lr {self.trainer.lr_scheduler.base_lrs[0]:g} (the checkpoint's run "
                      f"used {saved_lr:g}): the schedule goes on from step {info.step} with the new peak")
        if "dataloader" in self.cfg.checkpoint.exclude_from_loading:
            self._log("checkpoint: data position not loaded (checkpoint.exclude_from_loading): the data starts "
                      "from its beginning")
        saved_layout = (info.train_state.get("world_size"), info.train_state.get("layout"))
        if saved_layout == (self.world_size, self.trainer.dims.describe()):
            rng_file = os.path.join(info.folder, "rng", f"rank-{self.rank:05d}.json")
            set_rng_state(read_json_object(rng_file, "checkpoint.folder"))
        self._log(f"checkpoint: resumed from step {info.step} ({info.folder}, saved on {saved_layout[1]}) in "
                  f"{time.perf_counter() - t0:.2f}s")
        return info.step

    def load_model_only(self, path: str) -> None:
        """Initial weights from a Tessera step folder or a Hugging Face folder (checkpoint.initial_load_path)."""
        field = "checkpoint.initial_load_path"
        t0 = time.perf_counter()
        if is_hf_folder(path):
            from engine.hf import load_hf_into

            read, total = load_hf_into(self._parts(), path, self.trainer.model_args)
            self._log(f"checkpoint: initial weights from Hugging Face folder {path} in {time.perf_counter() - t0:.2f}s "
                      f"(this rank read {read / 2**20:,.1f} MiB of its {total / 2**20:,.1f} MiB)")
            return
        info = inspect_checkpoint(path, field, self.cfg)
        parts = self._part_states()
        model = self.model_state(parts)
        self._check_entries(info, model, field)
        dtype = EXPORT_DTYPES.get(info.train_state.get("dtype", "float32"), torch.float32)
        if dtype != torch.float32:  # a model-only export in another dtype: load, then cast into place
            state = {k: v.detach().to(dtype) for k, v in model.items()}
            dcp_load(state, path, field, no_dist=not dist.is_initialized())
            with torch.no_grad():
                for k, v in model.items():
                    v.copy_(state[k])
        else:
            dcp_load(model, path, field, no_dist=not dist.is_initialized())
        self._set_model(model, parts)
        self._log(f"checkpoint: initial weights from {path} (step {info.step}) in {time.perf_counter() - t0:.2f}s")

    def _set_model(self, state: dict[str, torch.Tensor], parts: list[dict[str, torch.Tensor]]) -> None:
        """Each part takes its entries of ``state`` (``parts``: the parts' state dicts, for their keys)."""
        for part, part_state in zip(self._parts(), parts):
            mine = {k: state[f"model.{k}"] for k in part_state}
            set_model_state_dict(part, mine)

    @staticmethod
    def _check_entries(info: CheckpointInfo, wanted: dict[str, torch.Tensor], field: str) -> None:
        """Every tensor this rank needs is in the checkpoint, with its global shape."""
        for key, value in wanted.items():
            md = info.tensors.get(key)
            if md is None:
                raise ConfigError(f"{field}: {info.folder} has no entry {key}; was it saved for another model?")
            shape = tuple(value.shape)
            if tuple(md.size) != shape:
                raise ConfigError(f"{field}: {info.folder} has {key} of shape {tuple(md.size)}, this model's is "
                                  f"{shape}; was it saved for another flavor or vocabulary?")

    # -- helpers -----------------------------------------------------------------------------------------------
    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _log(self, message: str) -> None:
        if self.rank in log_ranks():
            print(message, flush=True)

    def close_alone(self) -> None:
        """``close`` without collectives, for a rank that stops while others may be inside a training collective
        (a user error in its own data shard, or a peer's): an async save being written is finished, since
        its background writer has a process group of its own, then committed by rank 0. DCP's coordinator
        (rank 0) completes the save only once every rank has written its files, so rank 0's finished save is
        whole: the last save before the error commits, as with synchronous saves, when rank 0 gets here (it
        is the failing rank, or its collective failed when the failing rank left, as on gloo; a NCCL collective
        may instead wait until the launcher kills it, and the save then stays incomplete, never loaded). Every
        rank waits for its own writer before leaving, or rank 0's would fail."""
        p, self.pending = self.pending, None
        if p is not None:
            try:
                p["future"].result()
            except Exception as e:  # another rank left mid-write: the save stays incomplete, never loaded
                self._log(f"checkpoint: the save of step {p['step']} did not finish ({type(e).__name__}); it is "
                          "left incomplete")
            else:
                if self.is_main:
                    self._write_commit(p["step"], step_folder(self.root, p["step"]), time.perf_counter() - p["t0"],
                                       False, p["steps"])
        self.wait_purge()

    def close(self) -> None:
        self.wait()
        self.wait_purge()
        for vote in (self.stop_vote, self.commit_vote):  # every rank started it: let it finish
            if vote is not None:
                vote.collect()
        if self.stager is not None:
            self.stager.close()


class _Vote:
    """A vote of every rank at a step boundary that never stalls training: ``start(value)`` begins an
    all-reduce (MAX) of one integer per rank over the default process group, and ``collect()`` at the next
    boundary returns its result, so the collective runs while a training step does. On CUDA the result is
    copied to pinned host memory behind an event, so collecting waits for the vote alone, never for the step
    queued after it (no host sync of the step)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.in_flight: Optional[tuple] = None  # (work, result tensor on the host, CUDA event or None)

    def start(self, value: int) -> None:
        assert self.in_flight is None, "collect the vote in flight first"
        flag = torch.full((1,), value, dtype=torch.int32, device=self.device)  # a fill: no host-to-device copy
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        event = None
        if flag.is_cuda:
            work.wait()  # orders the copy after the collective on the GPU; the host does not wait
            host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            work, flag = None, host
        self.in_flight = (work, flag, event)

    def collect(self) -> Optional[int]:
        """The result of the vote in flight (waiting for it to finish), or None when none is."""
        if self.in_flight is None:
            return None
        (work, flag, event), self.in_flight = self.in_flight, None
        if work is not None:
            work.wait()
        if event is not None:
            event.synchronize()
        return int(flag.item())


def step_writer(folder: str, step: int, background: bool) -> FileSystemWriter:
    """DCP's writer of a step folder. A ``background`` (async) save's writer copies nothing ahead from the GPU: the
    state is staged in host memory already, and DCP's copy-ahead loader, on a machine with CUDA, would take the
    writer thread's current CUDA device, which is GPU 0 whatever this rank's (a thread's device is its own): every
    rank of a node would open a CUDA context on GPU 0 and synchronize its stream there."""
    copy_ahead = {"per_thread_copy_ahead": 0} if background else {}
    if os.environ.get("TESSERA_FAULT_AT"):
        return _FaultyWriter(folder, step, **copy_ahead)
    return FileSystemWriter(folder, **copy_ahead)


class _FaultyWriter(FileSystemWriter):
    """FileSystemWriter with fault-injection points inside DCP's write (tests only)."""

    def __init__(self, path: str, step: int, **kwargs):
        super().__init__(path, **kwargs)
        self._step = step

    def write_data(self, plan, planner):
        _fault(self._step, "dcp_write")
        fut = super().write_data(plan, planner)
        fut.wait()
        _fault(self._step, "dcp_data_written")
        return fut

    def finish(self, metadata, results):
        _fault(self._step, "dcp_before_metadata")
        super().finish(metadata, results)


def read_full(folder: str, prefix: str = "", field: str = "checkpoint",
              info: Optional[CheckpointInfo] = None) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint whose name starts with ``prefix``, whole, in one process (CPU); ``info``:
    the folder's inspect_checkpoint result when the caller has it already."""
    info = info or inspect_checkpoint(folder, field)
    return read_tensors(folder, [k for k in info.tensors if k.startswith(prefix)], info)


def read_tensors(folder: str, names: list[str], info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the checkpoint ``folder`` (``info``: its inspect_checkpoint result), whole, in
    their saved dtype, in one process (CPU); DCP reads only their bytes."""
    state = {k: torch.empty(tuple(info.tensors[k].size), dtype=info.tensors[k].properties.dtype) for k in names}
    dcp_load(state, folder, "checkpoint", no_dist=True)
    return state


class _FetchingPlanner(DefaultSavePlanner):
    """A save plan made from shapes alone (meta tensors), whose data ``fetch(name)`` returns when DCP writes it."""

    def __init__(self, fetch: Callable[[str], torch.Tensor]):
        super().__init__()
        self._fetch = fetch

    def lookup_object(self, index):  # DefaultSavePlanner's extension point: the data of one write item
        return self._fetch(index.fqn)


def write_tensors(folder: str, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  fetch: Callable[[str], torch.Tensor]) -> None:
    """Save the tensors ``shapes`` names (``{name: (shape, dtype)}``) to the new checkpoint folder ``folder``, in
    one process (CPU), asking ``fetch(name)`` for each one's data only as DCP writes it, so that memory holds one
    tensor at a time whatever the size of the whole (read_tensors' counterpart). One file per tensor: DCP keeps
    every tensor of a file until the file is written."""
    state = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}

    def checked(name: str) -> torch.Tensor:
        tensor = fetch(name)
        assert (tuple(tensor.shape), tensor.dtype) == shapes[name], (name, tensor.shape, tensor.dtype)
        return tensor

    writer = FileSystemWriter(folder, single_file_per_rank=False, thread_count=1)
    dcp.save(state, storage_writer=writer, planner=_FetchingPlanner(checked), no_dist=True)
