"""Hugging Face checkpoint folders: export a Tessera model to one, load one into Tessera.

A Hugging Face folder holds ``config.json`` and the weights in safetensors: ``model.safetensors``, or shards
``model-0000i-of-0000n.safetensors`` listed by ``model.safetensors.index.json``; optionally ``tokenizer.json``.
transformers' ``LlamaForCausalLM.from_pretrained(folder)`` loads what ``export_hf`` writes.

The model-specific part (names, the RoPE permutation, config.json) is the model family's state-dict adapter
(``ModelSpec.state_dict_adapter``, found from the class of ``args``), which provides ``names``, ``hf_name``,
``hf_shapes``, ``to_hf``/``tensor_to_hf``, ``from_hf``/``read_from_hf``, ``hf_config`` and ``check_hf_config``
(see ``models.llama3.hf_adapter``).

Loading reads JSON and safetensors only (never pickle): a folder with ``pytorch_model.bin`` alone is refused.
Every problem with a folder is a ``ValueError`` starting with the config field that named it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from engine.checkpoint.files import COMMIT_FILE, fsync_path, inspect_checkpoint, read_tensors
from engine.config import read_json_object
from engine.data.tokenizer import Tokenizer
from models.registry import get_model_spec, model_names

__all__ = ["export_hf", "export_checkpoint_hf", "load_hf", "load_hf_into", "open_hf", "model_args_for",
           "MAX_SHARD_BYTES"]

MAX_SHARD_BYTES = 5 * 10**9
"""Above this many bytes of weights the export is split into shards of at most this size (as transformers does)."""

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# The dtypes a checkpoint is exported (or saved model-only) in, by their config names (checkpoint.export_dtype).
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# safetensors dtype names of the floating-point tensors a checkpoint may hold (all are loaded as float32).
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Tensors some older Hugging Face Llama checkpoints hold that are recomputed, not loaded.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _adapter_for(args: Any) -> Any:
    """The state-dict adapter of the registered model family whose ``args_cls`` is the class of ``args`` (each
    family has its own: qwen3's Qwen3ModelArgs is a TransformerModelArgs, llama3's)."""
    for name in model_names():
        spec = get_model_spec(name)
        if type(args) is spec.args_cls:
            if spec.state_dict_adapter is None:
                raise ValueError(f"model.name: model {name!r} has no Hugging Face state-dict adapter")
            return spec.state_dict_adapter
    raise ValueError(f"model.name: no registered model family takes {type(args).__name__}")


# ----------------------------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------------------------


def _plan_shards(numels: dict[str, int], dtype: torch.dtype, max_shard_bytes: int) -> list[list[str]]:
    """Tensor names (with their element counts) grouped into consecutive shards of at most ``max_shard_bytes``
    each (stored in ``dtype``); a tensor larger than that gets a shard of its own."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name, numel in numels.items():
        nbytes = numel * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards



def _shard_filename(i: int, n: int) -> str:
    return SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _write_shard(path: str, names: list[str], fetch: Callable[[list[str]], dict[str, Tensor]],
                 dtype: torch.dtype) -> None:
    """Write the tensors ``names`` (``fetch(names)`` returns them) in ``dtype`` as the safetensors file ``path``:
    written beside it, flushed, then renamed, so that ``path`` exists only complete."""
    fetched = fetch(names)
    # .to() copies when the dtype or device changes; clone() otherwise, so that no two entries share storage
    # (safetensors refuses that) and views of larger tensors are written alone.
    tensors = {}
    for name in names:
        tensor = fetched[name].detach()
        converted = tensor.to(device="cpu", dtype=dtype)
        tensors[name] = converted.contiguous() if converted is not tensor else tensor.clone().contiguous()
    del fetched
    partial = f"{path}.partial"
    save_file(tensors, partial, metadata={"format": "pt"})
    os.chmod(partial, 0o666 & ~_umask())  # safetensors creates its files readable by their owner alone
    fsync_path(partial)
    os.replace(partial, path)


def _umask() -> int:
    """This process's umask (reading it means setting it: set it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _finish_folder(
    tmp: str,
    shards: list[list[str]],
    numels: dict[str, int],
    config: dict[str, Any],
    dtype: torch.dtype,
    tokenizer_files: dict[str, str],
) -> None:
    """Write the index (several shards), config.json and the tokenizer files beside the shards in ``tmp``, and
    flush them all."""
    n = len(shards)
    if n > 1:
        itemsize = torch.empty((), dtype=dtype).element_size()
        weight_map = {name: _shard_filename(i, n) for i, names in enumerate(shards) for name in names}
        index = {"metadata": {"total_size": sum(numels.values()) * itemsize}, "weight_map": weight_map}
        with open(os.path.join(tmp, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    for name, path in tokenizer_files.items():
        shutil.copyfile(path, os.path.join(tmp, name))
    for name in os.listdir(tmp):
        fsync_path(os.path.join(tmp, name))


def shard_writer(i: int, world_size: int, node_size: int) -> int:
    """The rank that writes output shard ``i`` when ``world_size`` ranks (``node_size`` per node, ranks numbered
    node by node as torchrun does) export together: one per node first, so that the nodes share the reading,
    converting and writing before any node runs two."""
    if node_size <= 0 or world_size % node_size:
        node_size = 1
    nodes = world_size // node_size
    return (i % nodes) * node_size + (i // nodes) % node_size


def export_hf(
    full_state_dict: dict[str, Tensor],
    args: Any,
    folder: str,
    dtype: torch.dtype = torch.bfloat16,
    tokenizer_path: Optional[str] = None,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    field: str = "folder",
) -> None:
    """Write ``full_state_dict`` (the whole model's state dict in Tessera names, plain tensors, as built from
    ``args``) as a Hugging Face checkpoint folder ``folder``, weights in ``dtype``.

    With ``tokenizer_path`` (a tokenizer.json), the file is copied in, with the ``tokenizer_config.json`` beside it
    if there is one, and its BOS/EOS ids go into config.json. Weights above ``max_shard_bytes`` are sharded.

    Everything is written to a temporary folder next to ``folder`` and renamed to ``folder`` at the end, so
    ``folder`` either does not exist or is complete. ``folder`` must not exist or be empty: an existing non-empty
    folder is refused with a ``ValueError`` naming ``field`` (nothing is deleted or overwritten).
    """
    hf_state_dict = _adapter_for(args).to_hf(full_state_dict, args)
    _export(args, {k: v.numel() for k, v in hf_state_dict.items()}, lambda names: {k: hf_state_dict[k] for k in names},
            folder, dtype, tokenizer_path, max_shard_bytes, field)


def check_new_folder(folder: str, field: str) -> None:
    """``folder`` can be written as a new folder: it does not exist or is an empty folder, and the nearest of its
    parents that exists is a folder; else a ``ValueError`` naming ``field`` (before anything is written)."""
    if os.path.exists(folder) and not (os.path.isdir(folder) and not os.listdir(folder)):
        raise ValueError(f"{field}: '{folder}' already exists and is not an empty folder; choose a new folder")
    parent = os.path.dirname(os.path.abspath(folder))
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{field}: '{parent}' is a file, so '{folder}' cannot be made; choose a folder elsewhere")


def _export(
    args: Any,
    numels: dict[str, int],
    fetch: Callable[[list[str]], dict[str, Tensor]],
    folder: str,
    dtype: torch.dtype,
    tokenizer_path: Optional[str],
    max_shard_bytes: int,
    field: str,
    rank: int = 0,
    world_size: int = 1,
    node_size: int = 1,
    source_tag: str = "",
) -> None:
    """``export_hf``'s folder rules, for weights that ``fetch`` returns a shard at a time.

    With ``world_size`` > 1 every rank calls it: each writes the shards ``shard_writer`` gives it into a temporary
    folder whose name the ranks agree on, and rank 0, once every shard is there, writes the rest and renames the
    folder. No collective is involved (the export may outlast a collective's timeout): rank 0 waits for the files,
    and a shard left complete by an interrupted export of the same source (``source_tag`` names it: the same
    save of the step) is used as it is."""
    if dtype not in EXPORT_DTYPES.values():
        raise ValueError(f"dtype: cannot export in {dtype}; choose one of {', '.join(EXPORT_DTYPES)}")
    folder = os.path.abspath(folder)
    parent = os.path.dirname(folder)
    shards = _plan_shards(numels, dtype, max_shard_bytes)
    files = [_shard_filename(i, len(shards)) for i in range(len(shards))]
    if world_size > 1:
        dtype_name = next(k for k, v in EXPORT_DTYPES.items() if v == dtype)
        tmp = os.path.join(parent, f".{os.path.basename(folder)}.tmp-{source_tag}-{dtype_name}-{len(shards)}")
        if rank != 0:  # a writer: its shards that are not there yet (while any is missing, rank 0 waits)
            mine = [i for i in range(len(shards)) if shard_writer(i, world_size, node_size) == rank]
            pending = [i for i in mine if not os.path.exists(os.path.join(tmp, files[i]))]
            if pending and not (os.path.isdir(folder) and os.listdir(folder)):  # not done (rank 0 checks the rest)
                os.makedirs(tmp, exist_ok=True)
                for i in pending:
                    _write_shard(os.path.join(tmp, files[i]), shards[i], fetch, dtype)
            return
    check_new_folder(folder, field)
    bos_id = eos_id = None
    tokenizer_files: dict[str, str] = {}  # name in the folder -> the file copied there
    if tokenizer_path is not None:
        tokenizer = Tokenizer(tokenizer_path)
        bos_id, eos_id = tokenizer.bos_id, tokenizer.eos_id
        tokenizer_files["tokenizer.json"] = tokenizer_path  # the name from_pretrained reads, whatever the file's
        beside = os.path.join(os.path.dirname(tokenizer_path), "tokenizer_config.json")
        if os.path.isfile(beside):
            tokenizer_files["tokenizer_config.json"] = beside
    config = _adapter_for(args).hf_config(args, dtype=dtype, bos_token_id=bos_id, eos_token_id=eos_id)
    if tokenizer_path is not None and bos_id is None:  # a tokenizer without BOS: say so (transformers' default is 1)
        config["bos_token_id"] = None

    os.makedirs(parent, exist_ok=True)
    if world_size > 1:  # rank 0: its own shards, then the rest of the folder once every shard is there
        os.makedirs(tmp, exist_ok=True)
        for i, names in enumerate(shards):
            path = os.path.join(tmp, files[i])
            if shard_writer(i, world_size, node_size) == 0 and not os.path.exists(path):
                _write_shard(path, names, fetch, dtype)
        while missing := [f for f in files if not os.path.exists(os.path.join(tmp, f))]:
            time.sleep(min(5.0, 0.05 * len(missing)))
        _finish_folder(tmp, shards, numels, config, dtype, tokenizer_files)
        _rename_folder(tmp, folder, field)
        return
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.tmp-", dir=parent)
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the folder is for everyone the umask allows
    try:
        for path, names in zip(files, shards):
            _write_shard(os.path.join(tmp, path), names, fetch, dtype)
        _finish_folder(tmp, shards, numels, config, dtype, tokenizer_files)
        _rename_folder(tmp, folder, field)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _rename_folder(tmp: str, folder: str, field: str) -> None:
    """Rename the finished ``tmp`` to ``folder`` (rename() replaces an empty folder and fails on a non-empty one,
    one that appeared meanwhile), and flush the parent folder."""
    try:
        os.rename(tmp, folder)
    except OSError as e:
        raise ValueError(f"{field}: cannot create '{folder}' ({e.strerror}); choose a new folder") from None
    fsync_path(os.path.dirname(folder))


def model_args_for(name: str, flavor: str, vocab_size: int, field: str = "flavor", model_field: str = "model") -> Any:
    """The model arguments of ``name``/``flavor`` with ``vocab_size`` (a checkpoint's, which the tokenizer set);
    an unknown flavor or model is a ``ValueError`` naming ``field`` or ``model_field``."""
    spec = get_model_spec(name, field=model_field)
    if flavor not in spec.flavors:
        raise ValueError(f"{field}: unknown flavor {flavor!r} of {name}; known: {', '.join(spec.flavors)}")
    return dataclasses.replace(spec.flavors[flavor], vocab_size=vocab_size)


def export_checkpoint_hf(
    step_folder: str,
    folder: str,
    dtype: torch.dtype = torch.bfloat16,
    tokenizer_path: Optional[str] = None,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    field: str = "folder",
    rank: int = 0,
    world_size: int = 1,
    node_size: int = 1,
) -> str:
    """Write the model of the Tessera step folder ``step_folder`` (saved on any layout: DCP reassembles the
    whole tensors) as the Hugging Face folder ``folder`` (``export_hf``'s rules); returns what it wrote
    (model/flavor, step).

    A process reads the model one output shard (at most ``max_shard_bytes`` in ``dtype``) at a time, so its
    memory holds at most one shard's tensors in their saved dtype (float32 for a full checkpoint) and in ``dtype``,
    whatever the size of the model. With ``world_size`` > 1, every rank of a job calls it (``node_size`` ranks per
    node) and the shards are shared out, one rank per node first (``_export``); rank 0 returns last, once the
    folder is complete."""
    info = inspect_checkpoint(step_folder, "checkpoint")
    name, flavor = info.train_state["model"], info.train_state["flavor"]
    args = model_args_for(name, flavor, info.tensors["model.tok_embeddings.weight"].size[0])
    trained_at = info.train_state.get("max_seq_len")  # the run's context (config.json's max_position_embeddings)
    if isinstance(trained_at, int) and trained_at > 0:
        args = dataclasses.replace(args, max_seq_len=trained_at)
    adapter = _adapter_for(args)
    # Hugging Face name -> the Tessera tensor holding it (an expert stack holds several; a tied output none)
    tessera = {hf: k[len("model."):] for k in info.tensors if k.startswith("model.")
               for hf in adapter.hf_names(k[len("model."):], args)}
    shapes = adapter.hf_shapes(args)  # every tensor, in the model's order
    assert set(tessera) == set(shapes), f"{step_folder}: not a whole {name}/{flavor} model"

    def fetch(names: list[str]) -> dict[str, Tensor]:
        wanted = list(dict.fromkeys(tessera[k] for k in names))  # each Tessera tensor read once
        state = read_tensors(step_folder, [f"model.{t}" for t in wanted], info)
        converted: dict[str, Tensor] = {}
        for t in wanted:
            converted.update(adapter.tensors_to_hf(t, state.pop(f"model.{t}"), args))
        return {k: converted[k] for k in names}

    with open(os.path.join(step_folder, COMMIT_FILE), "rb") as f:  # this save of the step (its time, its files)
        source_tag = hashlib.sha1(f.read()).hexdigest()[:12]
    _export(args, {k: math.prod(shape) for k, shape in shapes.items()}, fetch, folder, dtype, tokenizer_path,
            max_shard_bytes, field, rank, world_size, node_size, source_tag)
    return f"{name}/{flavor}, step {info.step}"


# ----------------------------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------------------------


def _weight_files(folder: str, field: str) -> dict[str, Optional[list[str]]]:
    """The safetensors files of the checkpoint in ``folder``, each with the tensor names the index puts in it
    (None without an index: the single ``model.safetensors``)."""
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        index = read_json_object(index_path, field)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{field}: '{index_path}' has no weight_map object of tensor names to file names")
        files: dict[str, Optional[list[str]]] = {}
        for name, filename in weight_map.items():
            if os.path.basename(filename) != filename or not filename.endswith(".safetensors"):
                raise ValueError(f"{field}: '{index_path}' names '{filename}', not a .safetensors file in the folder")
            files.setdefault(filename, []).append(name)
        return files
    if os.path.isfile(os.path.join(folder, SINGLE_FILE)):
        return {SINGLE_FILE: None}
    pickles = [name for name in sorted(os.listdir(folder)) if name.endswith((".bin", ".pt", ".pth"))]
    hint = ""
    if pickles:
        hint = f" (it holds {', '.join(pickles)}: pickle files, which Tessera never loads; convert them to safetensors)"
    raise ValueError(f"{field}: '{folder}' has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")


def _safetensors_error(path: str, field: str, error: Exception) -> ValueError:
    """The ``ValueError`` for a safetensors file that cannot be read (safetensors raises its own error type)."""
    reason = " ".join(str(error).split()) or type(error).__name__
    return ValueError(f"{field}: '{path}' is not a readable safetensors file ({reason})")


def _read_header(path: str, field: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{tensor name: (shape, safetensors dtype name)}`` of the safetensors file ``path``.

    Opening the file checks its header, and that the file is as long as the header says (not truncated)."""
    try:
        with safe_open(path, framework="pt") as f:
            return {
                name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()
            }
    except Exception as e:
        raise _safetensors_error(path, field, e) from None


def check_hf(
    folder: str,
    args: Any,
    *,
    model_label: Optional[str] = None,
    field: str = "checkpoint.initial_load_path",
) -> dict[str, list[str]]:
    """Check the Hugging Face checkpoint in ``folder`` against the model ``args`` builds, from its config.json and
    the safetensors headers alone (no tensor data is read); returns ``{file path: its tensor names}``.

    Checks, each failure a ``ValueError`` starting with ``field``: the folder exists and holds config.json and
    safetensors weights (an index's files all present); config.json describes the model ``args`` builds (``model_label``
    names it in the message); every tensor is there, none is unexpected, each has the expected shape and a
    floating-point dtype, and every file is as long as its header says (not truncated).
    """
    if not os.path.isdir(folder):
        raise ValueError(f"{field}: folder '{folder}' not found")
    config_path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(
            f"{field}: '{folder}' has no {CONFIG_FILE}; a Hugging Face checkpoint folder holds {CONFIG_FILE} and "
            f"{SINGLE_FILE} (or {INDEX_FILE} and its shards)"
        )
    config = read_json_object(config_path, field)
    if not isinstance(config, dict):
        raise ValueError(f"{field}: '{config_path}' is not a JSON object")
    adapter = _adapter_for(args)
    adapter.check_hf_config(config, args, field, model_label)
    expected = adapter.hf_shapes(args)

    plan: dict[str, list[str]] = {}
    found: set[str] = set()
    for filename, listed in _weight_files(folder, field).items():
        path = os.path.join(folder, filename)
        if not os.path.isfile(path):
            raise ValueError(f"{field}: '{folder}' lacks {filename}, which {INDEX_FILE} lists")
        header = _read_header(path, field)
        for name in listed or []:
            if name not in header:
                raise ValueError(f"{field}: {INDEX_FILE} puts {name} in {filename}, which does not hold it")
        names = [name for name in header if not name.endswith(IGNORED_SUFFIXES)]
        for name in names:
            shape, dtype = header[name]
            if name in found:
                raise ValueError(f"{field}: tensor {name} is stored twice (again in {filename})")
            if name not in expected:
                raise ValueError(f"{field}: {filename} holds {name}, which the configured model does not have")
            if shape != expected[name]:
                raise ValueError(
                    f"{field}: {name} in {filename} has shape {list(shape)}, expected {list(expected[name])}"
                )
            if dtype not in FLOAT_DTYPES:
                raise ValueError(f"{field}: {name} in {filename} has dtype {dtype}, not floating point")
            found.add(name)
        plan[path] = names
    missing = [name for name in expected if name not in found]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"{field}: the checkpoint in '{folder}' lacks {', '.join(missing[:3])}{more}")
    return plan


class HFReader:
    """Reads the Tessera tensors of a checked Hugging Face folder, or parts of them, from its safetensors files
    (``open_hf`` makes one). ``bytes_read`` counts the tensor data read so far; ``total_bytes`` is the size of the
    folder's weight files."""

    def __init__(self, adapter: Any, args: Any, files: dict[str, tuple[str, Any]], total_bytes: int, field: str):
        self._adapter, self._args, self._files, self._field = adapter, args, files, field
        self.bytes_read, self.total_bytes = 0, total_bytes

    def _read_stored(self, hf_name: str, box: tuple[slice, ...]) -> Tensor:
        path, handle = self._files[hf_name]
        try:
            block = handle.get_slice(hf_name)[box]
        except Exception as e:
            raise _safetensors_error(path, self._field, e) from None
        self.bytes_read += block.numel() * block.element_size()
        return block

    def read(self, name: str, box: Optional[tuple[slice, ...]] = None) -> Tensor:
        """The part ``box`` (one slice per dimension; all of it by default) of the Tessera tensor ``name``, in the
        dtype it is stored in; only that part's rows (whole RoPE heads for wq/wk) are read."""
        if box is None:
            box = tuple(slice(0, n) for n in self.shapes[name])
        return self._adapter.read_from_hf(name, box, self._read_stored, self._args)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, by Tessera name, in the model's order."""
        return self._adapter.shapes(self._args)


@contextmanager
def open_hf(
    folder: str,
    args: Any,
    *,
    model_label: Optional[str] = None,
    field: str = "checkpoint.initial_load_path",
) -> Iterator[HFReader]:
    """Check the Hugging Face checkpoint in ``folder`` (``check_hf``: same arguments, same errors), then open its
    files for an ``HFReader``, which reads tensors one at a time, or the parts of them a rank holds."""
    plan = check_hf(folder, args, model_label=model_label, field=field)
    with ExitStack() as stack:
        files = {}
        for path, names in plan.items():
            try:
                handle = stack.enter_context(safe_open(path, framework="pt"))
            except Exception as e:
                raise _safetensors_error(path, field, e) from None
            files.update({name: (path, handle) for name in names})
        yield HFReader(_adapter_for(args), args, files, sum(os.path.getsize(path) for path in plan), field)


def load_hf_into(
    parts: list[torch.nn.Module],
    folder: str,
    args: Any,
    *,
    field: str = "checkpoint.initial_load_path",
) -> tuple[int, int]:
    """Copy the Hugging Face checkpoint in ``folder`` (after ``check_hf``'s checks) into the parameters of
    ``parts`` (this rank's model parts: pipeline stages, sharded by FSDP/TP or not) in place.

    Each rank reads only the parts of the tensors it holds (safetensors slices, through the adapter's
    ``read_from_hf``), one at a time, so neither host memory nor the reads grow with the number of ranks.
    Returns ``(bytes of tensor data read, bytes of the checkpoint's files)``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor import DTensor

    with open_hf(folder, args, field=field) as reader:
        for part in parts:
            state = get_model_state_dict(part)
            with torch.no_grad():
                for name, tensor in state.items():
                    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                    block = reader.read(name, _local_box(tensor))
                    assert block.shape == local.shape, (name, tuple(block.shape), tuple(local.shape))
                    local.copy_(block)
            set_model_state_dict(part, state)
        return reader.bytes_read, reader.total_bytes


def _local_box(tensor: Tensor) -> tuple[slice, ...]:
    """The part of the whole tensor that this rank's ``tensor`` holds, one slice per dimension: a DTensor's
    local shard (FSDP and TP shards are boxes of the whole tensor), else all of it."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape)
    # The chunk protocol torch.distributed.checkpoint reads DTensors with (offsets and sizes of the local shard).
    (chunk,) = tensor.__create_chunk_list__()
    return tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))


def load_hf(
    folder: str,
    args: Any,
    *,
    model_label: Optional[str] = None,
    field: str = "checkpoint.initial_load_path",
) -> dict[str, Tensor]:
    """The weights of the Hugging Face checkpoint in ``folder`` as a Tessera state dict of full float32 tensors,
    after ``check_hf``'s checks (same arguments, same errors): the whole model in memory, for small models and
    tests (``open_hf`` reads one tensor at a time)."""
    with open_hf(folder, args, model_label=model_label, field=field) as reader:
        return {name: reader.read(name).to(torch.float32) for name in reader.shapes}
