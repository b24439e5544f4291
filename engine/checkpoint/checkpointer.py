"""The Checkpointer: saves (sync or async) and loads one run's training state, votes on commits and SIGTERM,
keeps checkpoint.keep_latest_k, and writes the last step's Hugging Face folder.

Async save (checkpoint.async_mode): the state is staged (copied; through pinned memory on CUDA with
async_with_pinned_mem) and written by a background thread over a separate gloo process group while
training goes on; the commit follows once every rank's write has finished (voted on at each step boundary).
Everything else (sync saves, loads, votes, barriers) runs on the default process group.
"""

from __future__ import annotations

import base64
import contextlib
import os
import queue
import random
import shutil
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from engine import events
from engine.checkpoint.files import (FORMAT_VERSION, HF_EXPORT_DIR, REMOVING_DIR, TRAIN_STATE_FILE, CheckpointInfo,
                                     StorageFull, check_entries, dcp_load, folder_bytes, free_bytes,
                                     hf_export_folder, is_complete, is_full, list_steps,
                                     out_of_space, set_aside, step_folder, write_commit_marker, write_json,
                                     write_own_checksums)
from engine.config import Config, changed_settings, checkpoint_root, read_json_object, resume_settings
from engine.distributed import keep_own_timeout, log_ranks, longer_collective_timeout, sigterm_received
from engine.hf import EXPORT_DTYPES, export_checkpoint_hf, load_hf_into
from engine.optim import load_lr_scheduler_state
from parallelize.mesh import ParallelDims


def export_last_hf(cfg: Config, step: int, tokenizer_path: str, rank: int, world_size: int) -> None:
    """checkpoint.last_save_hf: the ranks write the committed checkpoint of ``step`` as a Hugging Face folder
    together, each output shard by one rank, one rank per node first (``engine.hf.export_checkpoint_hf``), unless
    the folder exists (the export is atomic: it is complete). Rank 0 finishes the folder once every shard is there;
    the ranks coordinate through the files alone (the export may take longer than a collective's timeout)."""
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

    def __init__(self, cfg: Config, model_parts: list[nn.Module], optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any, data_position: Callable[[], dict], num_shards: int, dims: ParallelDims,
                 device: torch.device, model_args: Any, tokenizer_path: str):
        """The state saved and loaded: ``model_parts`` (this rank's pipeline stages, or the whole model),
        ``optimizer`` (built on them), ``lr_scheduler``, and ``data_position()``, the data position after the last
        step trained, of a loader over ``num_shards`` logical shards. Recorded with it: the layout ``dims``, the
        model's ``model_args`` and the run's tokenizer, ``tokenizer_path``. ``device``: where votes run."""
        self.cfg = cfg
        self.model_parts = model_parts
        self.model = model_parts[0] if len(model_parts) == 1 else nn.ModuleList(model_parts)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.data_position = data_position
        self.num_shards = num_shards
        self.dims = dims
        self.model_args = model_args
        self.tokenizer_path = tokenizer_path
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
        self.stop_vote = _Vote(device) if self.distributed else None
        self.commit_vote = _Vote(device) if self.distributed else None
        self.stager = None
        if self.async_mode == "async_with_pinned_mem" and torch.cuda.is_available():
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                       use_async_staging=False, use_non_blocking_copy=True))
        self.pending: Optional[dict] = None  # an async save being written: step, future, start time, steps
        self._purge_thread: Optional[threading.Thread] = None  # deleting checkpoints that keep_latest_k let go
        self._purge_queue: Optional[queue.Queue] = None
        self._purge_queued: set[str] = set()
        # The step this run went on from (0: a fresh start). Until its first commit, the steps after it in the
        # folder are another continuation's (a rollback by checkpoint.load_step, a restart by load_step = 0).
        self.resumed_step = 0
        self.claimed = False

    # -- state dicts -------------------------------------------------------------------------------------------
    def model_state(self, parts: Optional[list[dict[str, torch.Tensor]]] = None) -> dict[str, torch.Tensor]:
        """``model.<fqn>`` -> tensor (DTensor when sharded) for every part (pipeline stages) of this rank, from
        ``parts`` (``_part_states``) when given."""
        parts = self._part_states() if parts is None else parts
        return {f"model.{k}": v for part_state in parts for k, v in part_state.items()}

    def _part_states(self) -> list[dict[str, torch.Tensor]]:
        """Each part's state dict (fqn -> tensor). With split bf16 weights every call builds the fp32 weights
        anew, so a load reads the parts' keys from the same dicts it loads into (``_set_model``)."""
        return [get_model_state_dict(part) for part in self.model_parts]

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(``optim.<fqn>.<state>`` -> tensor, the full flattened optimizer state dict as torch returns it)."""
        flat = get_optimizer_state_dict(self.model, self.optimizer,
                                        options=StateDictOptions(flatten_optimizer_state_dict=True))
        out = {}
        for key, value in flat.items():
            if not key.startswith("state."):
                continue  # param_groups: hyperparameters, from the config
            assert isinstance(value, torch.Tensor), key
            out[self._optim_name(key)] = value  # a tied copy's: the same values as the embedding's entry
        return out, flat

    def _optim_name(self, key: str) -> str:
        """The checkpoint entry of the flattened optimizer state's ``key`` (``state.<fqn>.<state>``). Parts keep the
        whole model's names (the part index is dropped), and a pipeline's copy of a tied embedding (the last
        stage's output projection) has the embedding's state, under the embedding's name as one process has it."""
        name = key[len("state."):]
        if isinstance(self.model, nn.ModuleList):
            name = name.split(".", 1)[1]
        if getattr(self.model_args, "tie_embeddings", False) and name.startswith("output.weight."):
            name = "tok_embeddings.weight." + name[len("output.weight."):]
        return f"optim.{name}"

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
                          f"{set_aside(folder, '.replaced')}")
                export = hf_export_folder(self.root, step)
                if os.path.exists(export):  # its export would pass for this run's
                    self._log(f"checkpoint: its Hugging Face folder is set aside as {set_aside(export, '.replaced')}")
        self._barrier()
        events.point(step, "begin")
        t0 = time.perf_counter()
        if model_only:  # each tensor cast in turn: a temporary fp32 weight (split bf16 weights) goes at once
            state = self.model_state()
            for k in list(state):
                state[k] = state[k].detach().to(EXPORT_DTYPES[dtype])
        else:
            state = {**self.model_state(), **self.optimizer_state()[0]}
        with self._full_storage_named(step):
            self._write_small_files(folder, step, model_only, dtype)
        events.point(step, "small_files")
        use_async = self.async_mode != "disabled" and not force_sync and not model_only
        writer = step_writer(folder, step, background=use_async)
        if use_async:
            future = dcp.async_save(state, storage_writer=writer, process_group=self.pg,
                                    async_stager=self.stager) if self.stager is not None else \
                dcp.async_save(state, storage_writer=writer, process_group=self.pg)
            future = getattr(future, "upload_completion", future)
            if self.cfg.checkpoint.checksums:
                future = _then(future, lambda: write_own_checksums(folder, self.rank))
            self.pending = {"step": step, "future": future, "t0": t0, "staged": time.perf_counter() - t0,
                            "steps": 0}
            self._log(f"checkpoint: step {step} staged in {self.pending['staged']:.2f}s; writing in the background")
            return
        with self._full_storage_named(step):
            dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())
            if self.cfg.checkpoint.checksums:
                write_own_checksums(folder, self.rank)
        events.point(step, "dcp_done")
        self._commit(step, folder, time.perf_counter() - t0, model_only)

    @contextlib.contextmanager
    def _full_storage_named(self, step: int):
        """Writing the save of ``step``: a failure for want of space becomes ``StorageFull`` (one error line), and
        rank 0 removes the step's incomplete folder, so that the space it took is free again. The committed
        checkpoints stay as they are."""
        try:
            yield
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)) or not out_of_space(self.root, e):
                raise
            folder = step_folder(self.root, step)
            if self.is_main:
                shutil.rmtree(folder, ignore_errors=True)
            committed = [(s, f) for s, f, ok in list_steps(self.root) if ok and is_full(f)]
            free = free_bytes(self.root)
            last = (f"the last committed checkpoint is step {committed[-1][0]} "
                    f"({folder_bytes(committed[-1][1]) / 2**20:,.1f} MiB)" if committed
                    else "no checkpoint of this run is committed yet")
            raise StorageFull(
                f"checkpoint.folder: no space left on the device of {self.root} while saving step {step}"
                + (f" ({free / 2**20:,.1f} MiB free)" if free is not None else "")
                + f"; {'its incomplete folder is removed' if self.is_main else 'its folder is left incomplete'} and "
                f"{last}. Free space there, keep fewer checkpoints (checkpoint.keep_latest_k) or set "
                "checkpoint.folder on a larger disk, then run the same command again: it resumes from that checkpoint"
            ) from e

    def _write_small_files(self, folder: str, step: int, model_only: bool, dtype: str) -> None:
        if self.is_main:
            write_json(os.path.join(folder, TRAIN_STATE_FILE), {
                "format": FORMAT_VERSION,
                "step": step,
                "model_only": model_only,
                "model": self.cfg.model.name,
                "flavor": self.cfg.model.flavor,
                "max_seq_len": self.model_args.max_seq_len,  # the flavor's, or the longer seq_len trained at
                "dtype": dtype if model_only else "float32",
                "world_size": self.world_size,
                "layout": self.dims.describe(),
                "dp": self.dims.coordinate("dp")[1],
                "num_shards": self.num_shards,
                "tokenizer": os.path.abspath(self.tokenizer_path),  # what convert_hf to-hf copies by default
                "lr_scheduler": self.lr_scheduler.state_dict(),
                "settings": resume_settings(self.cfg),  # what a resumed run with other settings names as changed
            })
        if model_only:
            return
        if self.dims.is_dp_leader():  # one copy per data-parallel rank
            dp_rank = self.dims.coordinate("dp")[0]
            write_json(os.path.join(folder, "dataloader", f"dp-{dp_rank:05d}.json"), self.data_position())
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
        events.point(step, "committed")

    def _write_commit(self, step: int, folder: str, seconds: float, model_only: bool, overlapped: int) -> None:
        """Rank 0, once every rank's files of ``step`` are written: the marker, then retention."""
        if not self.claimed and not self.cfg.checkpoint.create_seed_checkpoint:  # a last model-only save claims too
            self._set_aside_other_continuation(step)
            self.claimed = True
        events.point(step, "before_commit")
        files = write_commit_marker(folder, step, checksums=self.cfg.checkpoint.checksums)
        size = sum(files.values()) / 2**20
        how = f"in the background over {overlapped} training steps, " if overlapped else ""
        self._log(f"checkpoint: step {step} committed ({'model only, ' if model_only else ''}{size:.1f} MiB "
                  f"written {how}in {seconds:.2f}s) -> {folder}")
        self._retention()

    def _set_aside_other_continuation(self, step: int) -> None:
        """Before this run's first commit (of ``step``): the checkpoints after the step it went on from, but
        ``step``'s own folder, belong to a continuation it went back from. Renamed (not deleted), so that neither a
        resume nor keep_latest_k takes them for this run's; before the marker, so that a kill between the two
        leaves the step this run went on from as the newest."""
        for later, folder, _ in list_steps(self.root):
            if later > self.resumed_step and later != step:
                self._log(f"checkpoint: step {later} belongs to the continuation this run went back from; set "
                          f"aside as {set_aside(folder, '.abandoned')}")
        for name in sorted(os.listdir(self.root)):
            m = HF_EXPORT_DIR.match(name)
            if m and int(m.group(1)) > self.resumed_step:
                self._log(f"checkpoint: the Hugging Face folder of step {int(m.group(1))} belongs to that "
                          f"continuation too; set aside as {set_aside(os.path.join(self.root, name), '.abandoned')}")

    def _retention(self) -> None:
        """checkpoint.keep_latest_k: remove all but the newest k complete full checkpoints. Incomplete ones never
        count; model-only ones (the last save's export, a seed) neither count nor are removed, nor are those whose
        train_state.json cannot be read now, so the newest resumable checkpoint always stays."""
        k = self.cfg.checkpoint.keep_latest_k
        if k <= 0:
            return
        full = [(s, f) for s, f, ok in list_steps(self.root) if ok and is_full(f)]
        removing = [os.path.join(self.root, name) for name in os.listdir(self.root) if REMOVING_DIR.match(name)]
        for step, folder in full[:-k]:  # out of the way at once (a rename), deleted in the background
            try:
                removing.append(set_aside(folder, ".removing"))
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
            with self._full_storage_named(self.pending["step"]):
                try:
                    self.pending["future"].result()
                except BaseException:
                    self.pending = None  # spent: nothing to commit
                    raise
            self._finish_pending()

    def _finish_pending(self) -> None:
        if self.commit_vote is not None:
            self.commit_vote.collect()  # a vote on this save still in flight (wait() came first): spent
        p, self.pending = self.pending, None
        with self._full_storage_named(p["step"]):
            p["future"].result()  # raises the writer's error, if any
        events.point(p["step"], "dcp_done")
        self._commit(p["step"], step_folder(self.root, p["step"]), time.perf_counter() - p["t0"], False,
                     overlapped=max(p["steps"], 1) if p["steps"] else 0)

    def export_hf(self, step: int, tokenizer_path: str) -> None:
        """checkpoint.last_save_hf (``export_last_hf``): every rank calls it."""
        rank = dist.get_rank() if self.distributed else 0
        export_last_hf(self.cfg, step, tokenizer_path, rank, self.world_size if self.distributed else 1)

    # -- preemption -------------------------------------------------------------------------------------------
    def stop_requested(self) -> bool:
        """Whether any rank got SIGTERM (engine.distributed.defer_sigterm); called by every rank at every step
        boundary. All ranks agree, so they stop at the same step boundary: with several ranks, the one after the
        vote that saw the signal (the vote runs during a step, see ``_Vote``)."""
        if self.stop_vote is None:
            return sigterm_received()
        stop = self.stop_vote.collect()  # the previous boundary's vote (none at the first)
        self.stop_vote.start(int(sigterm_received()))
        return bool(stop)

    def stopped_in_set_up(self) -> bool:
        """Whether any rank got SIGTERM before the first step (every rank calls it then, and waits for the vote)."""
        if self.stop_vote is None:
            return sigterm_received()
        self.stop_vote.start(int(sigterm_received()))
        return bool(self.stop_vote.collect())

    # -- load ------------------------------------------------------------------------------------------------
    def load(self, info: CheckpointInfo, data_position_loaded: bool) -> int:
        """Load the whole training state of ``info`` (any layout) but the data position, which the trainer loads
        among its set-up checks (load_data_position) unless ``data_position_loaded`` is False; returns its step."""
        t0 = time.perf_counter()
        parts = self._part_states()
        model = self.model_state(parts)
        optim, flat = self.optimizer_state()
        check_entries(info, {**model, **optim}, "checkpoint.folder")
        state = {**model, **optim}
        dcp_load(state, info.folder, "checkpoint.folder", no_dist=not dist.is_initialized())
        self._set_model(state, parts)
        taken = set()
        for key in flat:
            if key.startswith("state."):
                name = self._optim_name(key)
                # A tied embedding and its copy (a V schedule's first and last stages) never share a tensor.
                flat[key] = state[name].clone() if name in taken else state[name]
                taken.add(name)
        set_optimizer_state_dict(self.model, self.optimizer, flat,
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))
        # The optimizer's hyperparameters and the schedule come from the config; the saved step places it.
        saved_lr = info.train_state["lr_scheduler"].get("base_lrs", [None])[0]
        load_lr_scheduler_state(self.lr_scheduler, info.train_state["lr_scheduler"])
        saved_settings = info.train_state.get("settings")
        if isinstance(saved_settings, dict):
            changes = changed_settings(saved_settings, self.cfg)
            if changes:
                self._log(f"checkpoint: settings changed since step {info.step} was saved: {', '.join(changes)}; "
                          f"the run goes on from step {info.step} with the new values (the lr schedule too)")
        elif saved_lr is not None and saved_lr != self.lr_scheduler.base_lrs[0]:  # saved without its settings
            self._log(f"checkpoint: optimizer.lr {self.lr_scheduler.base_lrs[0]:g} (the checkpoint's run "
                      f"used {saved_lr:g}): the schedule goes on from step {info.step} with the new peak")
        if not data_position_loaded:
            self._log("checkpoint: data position not loaded (checkpoint.exclude_from_loading): the data starts "
                      "from its beginning")
        saved_layout = (info.train_state.get("world_size"), info.train_state.get("layout"))
        if saved_layout == (self.world_size, self.dims.describe()):
            rng_file = os.path.join(info.folder, "rng", f"rank-{self.rank:05d}.json")
            set_rng_state(read_json_object(rng_file, "checkpoint.folder"))
        self.resumed_step = info.step
        self._log(f"checkpoint: resumed from step {info.step} ({info.folder}, saved on {saved_layout[1]}) in "
                  f"{time.perf_counter() - t0:.2f}s{_verified(info)}")
        return info.step

    def load_model_only(self, path: str, from_hf: bool, info: Optional[CheckpointInfo] = None) -> None:
        """Initial weights from a Tessera step folder or, ``from_hf``, a Hugging Face folder
        (checkpoint.initial_load_path); ``info``: the step folder as plan_resume checked it."""
        field = "checkpoint.initial_load_path"
        t0 = time.perf_counter()
        if from_hf:
            read, total = load_hf_into(self.model_parts, path, self.model_args)
            self._log(f"checkpoint: initial weights from Hugging Face folder {path} in {time.perf_counter() - t0:.2f}s "
                      f"(this rank read {read / 2**20:,.1f} MiB of its {total / 2**20:,.1f} MiB)")
            return
        assert info is not None, "plan_resume checks a step folder given as initial weights"
        parts = self._part_states()
        model = self.model_state(parts)
        check_entries(info, model, field)
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
        self._log(f"checkpoint: initial weights from {path} (step {info.step}) in {time.perf_counter() - t0:.2f}s"
                  f"{_verified(info)}")

    def _set_model(self, state: dict[str, torch.Tensor], parts: list[dict[str, torch.Tensor]]) -> None:
        """Each part takes its entries of ``state`` (``parts``: the parts' state dicts, for their keys)."""
        for part, part_state in zip(self.model_parts, parts):
            mine = {k: state[f"model.{k}"] for k in part_state}
            set_model_state_dict(part, mine)

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


def _verified(info: CheckpointInfo) -> str:
    """What the load log line says of the checkpoint's checksums, checked before anything was built."""
    if not info.checksums:
        return "; saved without checksums, so its bytes were not checked"
    if info.verified is None:  # (checkpoint.checksums is off in this run)
        return ""
    files, seconds = info.verified
    return f"; its {files} files matched their checksums (checked in {seconds:.2f}s)"


def _then(future: Future, work: Callable[[], None]) -> Future:
    """A future done once ``future`` is and then ``work()`` has run, in a thread of its own; it holds either's
    error."""
    after: Future = Future()

    def run() -> None:
        try:
            future.result()
            work()
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            after.set_exception(e)
        else:
            after.set_result(None)

    threading.Thread(target=run, name="checkpoint-checksums", daemon=True).start()
    return after


def step_writer(folder: str, step: int, background: bool) -> FileSystemWriter:
    """DCP's writer of a step folder. A ``background`` (async) save's writer copies nothing ahead from the GPU: the
    state is staged in host memory already, and DCP's copy-ahead loader, on a machine with CUDA, would take the
    writer thread's current CUDA device, which is GPU 0 whatever this rank's (a thread's device is its own): every
    rank of a node would open a CUDA context on GPU 0 and synchronize its stream there."""
    copy_ahead = {"per_thread_copy_ahead": 0} if background else {}
    make = events.writer_hook()  # the tests' fault injection (engine/faults.py), when installed
    if make is not None:
        return make(folder, step, **copy_ahead)
    return FileSystemWriter(folder, **copy_ahead)

