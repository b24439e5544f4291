"""A checkpoint's files: the step folders' layout, commit markers, checks without loading, and a safe reader.

Reading never unpickles arbitrary objects: DCP's ``.metadata`` (a pickle) is read with an unpickler that only
accepts DCP's metadata classes and torch sizes/dtypes, a checkpoint with byte (pickled) entries is refused, and
tensors are read with ``torch.load(weights_only=True)`` by DCP itself. Also one-process readers and writers of
whole tensors (the Hugging Face conversion's).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import time
import traceback
import warnings
import zipfile
from dataclasses import dataclass, field as dataclass_field
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta, TensorStorageMetadata

from engine.config import Config, ConfigError, read_json_object

COMMIT_FILE = "COMMITTED.json"
CHECKSUM_KEY = "xxh3"  # the commit marker's list of the files' checksums
CHECKSUM_DIR = "checksums"  # each rank's checksums of its data files, until rank 0 folds them into the commit marker
TRAIN_STATE_FILE = "train_state.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
REMOVING_DIR = re.compile(r"^step-(\d+)\.removing(\.\d+)?$")  # let go by keep_latest_k; deleted in the background
HF_EXPORT_DIR = re.compile(r"^step-(\d+)-hf$")

# DCP warns on every single-process save and load, even when asked for one (no_dist=True): a one-process run
# means it, so the warning would only clutter the console at every checkpoint.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized, assuming")


class StorageFull(ConfigError):
    """The filesystem a run writes to (its checkpoints, its metrics) is full, or the user's quota spent: found
    mid-run, reported as one line naming what to free (engine/train.py)."""


_FULL = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded")


def out_of_space(folder: str, error: BaseException) -> bool:
    """Whether ``error``, raised while writing under ``folder``, came from a full filesystem: ENOSPC or EDQUOT in it
    or in what it was raised from, their text in it (DCP's CheckpointException carries each rank's failure as
    text), or almost nothing free there now (torch's zip writer reports a short write without the errno)."""
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return True
        e = e.__cause__ or e.__context__
    if any(text in str(error) for text in _FULL_TEXTS):
        return True
    free = free_bytes(folder)
    return free is not None and free < 16 * 2**20


def free_bytes(folder: str) -> Optional[int]:
    """Bytes free to this user on the filesystem of ``folder`` (or of its nearest existing parent); None if unknown."""
    path = os.path.abspath(folder)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def folder_bytes(folder: str) -> int:
    """The bytes of the files under ``folder``."""
    total = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(parent, name))
            except OSError:
                pass
    return total


def step_folder(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:06d}")


def hf_export_folder(root: str, step: int) -> str:
    """Where checkpoint.last_save_hf writes the Hugging Face folder of ``step`` (not a step-N folder: never
    resumed from, never removed by keep_latest_k)."""
    return step_folder(root, step) + "-hf"


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
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def dcp_load(state: dict, folder: str, field: str, no_dist: bool) -> None:
    """``dcp.load`` of ``state`` from the step folder ``folder``; a damaged data file (on any rank) is the
    ConfigError naming ``field`` on every rank, not DCP's exception with each rank's traceback, and a file that
    cannot be read is the OSError naming it (DCP's exception, with the tracebacks, chained)."""
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


_TEMPORARY = re.compile(r"\.tmp\d+$")  # write_json's temporary files


def write_json(path: str, data: dict) -> None:
    """Write atomically: a reader sees the old file or the whole new one."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_path(path: str) -> None:
    """Flush ``path`` (a file or a folder: the names in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_checksum(path: str) -> int:
    """The 64-bit xxHash (XXH3) of a file's bytes, read 16 MiB at a time: about 12 GB/s on one core (zlib's CRC32:
    2.5), so reading the file costs more than checking it; it lets go of the GIL (a background thread checksums
    beside training)."""
    digest, buf = xxhash.xxh3_64(), bytearray(16 * 2**20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.intdigest()


def write_own_checksums(folder: str, rank: int) -> None:
    """Rank ``rank``, once DCP has written its data files of the step folder ``folder`` (__<rank>_*.distcp): their
    checksums, read back while the page cache holds them, to checksums/rank-<rank>.json for the commit marker.
    Nothing once the folder is committed already (a rank stopping alone: rank 0 computed them itself)."""
    if is_complete(folder):
        return
    names = sorted(n for n in os.listdir(folder) if n.startswith(f"__{rank}_") and n.endswith(".distcp"))
    write_json(os.path.join(folder, CHECKSUM_DIR, f"rank-{rank:05d}.json"),
               {n: file_checksum(os.path.join(folder, n)) for n in names})


def write_commit_marker(folder: str, step: int, checksums: bool = True) -> dict[str, int]:
    """Mark the step folder ``folder`` complete, once everything else in it is written: the marker lists every
    file with its size, which inspect_checkpoint compares, and (``checksums``) its checksum, which verify_checksums
    compares: the ranks' own (write_own_checksums), the rest (small files; a rank's data files when the ranks'
    checksums are missing) computed here. Returns the sizes."""
    sums: dict[str, int] = {}
    own = os.path.join(folder, CHECKSUM_DIR)
    if os.path.isdir(own):
        for name in sorted(os.listdir(own)):
            if checksums and name.endswith(".json"):  # (not a writer's temporary file)
                sums.update(read_json_object(os.path.join(own, name), "checkpoint.folder"))
        shutil.rmtree(own, ignore_errors=True)  # folded into the marker
    files = {}
    for dirpath, dirs, names in os.walk(folder):
        # Not checksums/ nor a writer's temporary file: a rank stopping alone may still be writing its checksums
        # (checkpointer.close_alone), and a listed file renamed away would read as missing.
        dirs[:] = [d for d in dirs if not (dirpath == folder and d == CHECKSUM_DIR)]
        for name in names:
            if not _TEMPORARY.search(name):
                path = os.path.join(dirpath, name)
                files[os.path.relpath(path, folder)] = os.path.getsize(path)
    marker: dict[str, Any] = {"step": step, "files": files, "time": time.time()}
    if checksums:
        marker[CHECKSUM_KEY] = {rel: sums[rel] if rel in sums else file_checksum(os.path.join(folder, rel))
                                for rel in files}
    write_json(os.path.join(folder, COMMIT_FILE), marker)
    for path in (folder, os.path.dirname(folder)):  # the marker's name, and the step's, on disk before retention
        fsync_path(path)
    return files


def is_complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, COMMIT_FILE))


def set_aside(folder: str, suffix: str) -> str:
    """Rename ``folder`` to the first free name of ``folder + suffix``, ``folder + suffix + ".1"``, ...; returns
    it. Nothing is overwritten."""
    aside, n = folder + suffix, 1
    while os.path.exists(aside):
        aside, n = f"{folder}{suffix}.{n}", n + 1
    os.replace(folder, aside)
    return aside


def is_model_only(folder: str) -> bool:
    return _saved_whole(folder) is False


def is_full(folder: str) -> bool:
    """Whether the step folder ``folder`` holds the whole training state (read from its train_state.json): False
    for a model-only save and for a folder whose train_state.json cannot be read now, which keep_latest_k then
    neither counts nor removes."""
    return _saved_whole(folder) is True


def _saved_whole(folder: str) -> Optional[bool]:
    """True: the whole training state; False: the model only; None: its train_state.json cannot be read."""
    try:
        with open(os.path.join(folder, TRAIN_STATE_FILE)) as f:
            return not json.load(f).get("model_only")
    except (OSError, ValueError, AttributeError):
        return None


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
    checksums: dict[str, int] = dataclass_field(default_factory=dict)
    """The commit marker's checksum (XXH3) of every file (none for a checkpoint saved without checkpoint.checksums)."""
    sizes: dict[str, int] = dataclass_field(default_factory=dict)
    """The commit marker's size of every file."""
    verified: Optional[tuple[int, float]] = None
    """Once verify_checksums has run: the files checked by all ranks, and the seconds this rank took."""

    @property
    def model_only(self) -> bool:
        return bool(self.train_state.get("model_only"))


def inspect_checkpoint(folder: str, field: str, cfg: Optional[Config] = None, rank: int = 0,
                       world_size: int = 1) -> CheckpointInfo:
    """Check a checkpoint folder without loading its tensors; raises ConfigError naming ``field``.

    Checks: the commit marker, every listed file present with its size (a truncated shard is caught
    here), DCP's metadata readable without pickled objects, and train_state.json naming the same model and
    flavor as ``cfg``. Rank ``rank`` of ``world_size`` looks at its share of the listed files only (each file is
    looked at by one rank: thousands of ranks do not each stat thousands of files); the caller agrees on errors.
    """
    another = _another(field)
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
    sizes = dict(commit.get("files", {}))
    for rel in sorted(sizes)[rank::world_size]:
        path, size = os.path.join(folder, rel), sizes[rel]
        if not os.path.isfile(path):
            raise ConfigError(f"{field}: {folder} is damaged: {rel} is missing; {another}")
        actual = os.path.getsize(path)
        if actual != size:
            raise ConfigError(f"{field}: {folder} is damaged: {rel} has {actual} bytes, {size} were written "
                              f"(truncated or overwritten); {another}")
    checksums = commit.get(CHECKSUM_KEY, {})
    if not (isinstance(checksums, dict) and all(isinstance(v, int) for v in checksums.values())
            and (not checksums or checksums.keys() == sizes.keys())):
        raise ConfigError(f"{field}: {folder}/{COMMIT_FILE} has no valid {CHECKSUM_KEY} list (edited or damaged); "
                          f"{another}")
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
    return CheckpointInfo(folder, int(state["step"]), state, tensors, checksums, sizes)


def _another(field: str) -> str:
    """What to do about a damaged checkpoint: a run's own checkpoints are chosen with checkpoint.load_step, any
    other folder is given by path."""
    return ("pick another step with checkpoint.load_step" if field in ("checkpoint.load_step", "checkpoint.folder")
            else f"use another step folder for {field}")


def verify_checksums(info: CheckpointInfo, field: str, rank: int = 0, world_size: int = 1) -> None:
    """Compare the files of checkpoint ``info`` with the checksums written with them: rank ``rank`` of ``world_size``
    takes its share (largest files first, dealt in turn), so every file is read once. A file whose bytes changed
    since its save (a failing disk, a bad copy: same size, other bytes) is a ConfigError naming ``field``. Sets
    ``info.verified``; a checkpoint saved without checksums has none to compare."""
    t0 = time.perf_counter()
    for rel in sorted(info.checksums, key=lambda rel: (-info.sizes[rel], rel))[rank::world_size]:
        actual = file_checksum(os.path.join(info.folder, rel))
        if actual != info.checksums[rel]:
            raise ConfigError(f"{field}: {info.folder} is damaged: {rel} has other bytes than were saved "
                              f"({CHECKSUM_KEY} {actual:016x}, {info.checksums[rel]:016x} when written); "
                              f"{_another(field)}")
    info.verified = (len(info.checksums), time.perf_counter() - t0)


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


def check_entries(info: CheckpointInfo, wanted: dict[str, torch.Tensor], field: str) -> None:
    """Every tensor of ``wanted`` (name -> tensor, for its global shape) is in the checkpoint ``info``, with that
    shape; raises ConfigError naming ``field``."""
    for key, value in wanted.items():
        md = info.tensors.get(key)
        if md is None:
            raise ConfigError(f"{field}: {info.folder} has no entry {key}; was it saved for another model?")
        shape = tuple(value.shape)
        if tuple(md.size) != shape:
            raise ConfigError(f"{field}: {info.folder} has {key} of shape {tuple(md.size)}, this model's is "
                              f"{shape}; was it saved for another flavor or vocabulary?")


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
