"""Convert between Tessera checkpoints and Hugging Face folders (safetensors + config.json).

    python -m tools.convert_hf to-hf   CHECKPOINT_STEP_FOLDER OUT_FOLDER [--dtype bfloat16]
                                              [--tokenizer FILE | --no-tokenizer]
    python -m tools.convert_hf from-hf HF_FOLDER OUT_STEP_FOLDER --flavor FLAVOR [--model llama3]

to-hf reads the model of a Tessera step folder (any layout it was saved on; the model name, flavor and
vocabulary come from the checkpoint) and writes a folder that transformers' LlamaForCausalLM.from_pretrained
loads, with the run's tokenizer.json (recorded in the checkpoint) unless told otherwise. from-hf writes a
model-only Tessera step folder for checkpoint.initial_load_path (which also takes a Hugging Face folder
directly, reading only each rank's slices). One process, CPU: to-hf holds one output shard (at most 5 GB in the
export dtype) and its float32 source at a time; from-hf holds one tensor at a time (the largest: the embedding or
the output, vocabulary x dim in float32, 8.4 GB for 405B) and writes one file per tensor.
"""

from __future__ import annotations

import os
import sys

from engine.checkpoint.files import (FORMAT_VERSION, TRAIN_STATE_FILE, inspect_checkpoint, verify_checksums,
                                     write_commit_marker, write_json, write_tensors)
from engine.hf import EXPORT_DTYPES, export_checkpoint_hf
from engine.config import ArgumentParser


def recorded_tokenizer(step_folder: str) -> tuple[str, str]:
    """(the tokenizer.json the checkpoint's run trained with, or "", what to tell the user about it)."""
    path = inspect_checkpoint(step_folder, "checkpoint").train_state.get("tokenizer")
    if not isinstance(path, str) or not path:
        return "", "no tokenizer copied: the checkpoint does not name its run's (give --tokenizer FILE)"
    if not os.path.isfile(path):
        return "", f"no tokenizer copied: the run's {path} is gone (give --tokenizer FILE)"
    return path, f"tokenizer: the run's {path}"


def check_tokenizer_fits(path: str, step_folder: str) -> None:
    """--tokenizer: a tokenizer.json whose token ids the checkpoint's model has (no more tokens than its
    vocabulary; a vocabulary may be padded past the tokenizer's size)."""
    from engine.data.tokenizer import Tokenizer

    vocab = inspect_checkpoint(step_folder, "checkpoint").tensors["model.tok_embeddings.weight"].size[0]
    size = Tokenizer(path, "--tokenizer").vocab_size
    if size > vocab:
        raise ValueError(f"--tokenizer: '{path}' has {size:,} tokens, more than the checkpoint's vocabulary of "
                         f"{vocab:,}; give the tokenizer the run trained with")


def to_hf(step_folder: str, out: str, dtype: str = "bfloat16", tokenizer: str = "",
          copy_tokenizer: bool = True) -> None:
    """``tokenizer``: a tokenizer.json to copy in; by default (with ``copy_tokenizer``) the one the run trained
    with, as the checkpoint records it, when it is still there."""
    if tokenizer:
        check_tokenizer_fits(tokenizer, step_folder)
        told = f"tokenizer: {tokenizer}"
    elif copy_tokenizer:
        tokenizer, told = recorded_tokenizer(step_folder)
    else:
        told = "no tokenizer copied (--no-tokenizer)"
    verify_checksums(inspect_checkpoint(step_folder, "checkpoint"), "checkpoint")  # a damaged file: not exported
    what = export_checkpoint_hf(step_folder, out, EXPORT_DTYPES[dtype], tokenizer or None, field="out")
    print(f"wrote {out} ({what}, {dtype}); {told}")


def from_hf(hf_folder: str, out: str, flavor: str, model_name: str = "llama3") -> None:
    """Write the Hugging Face folder ``hf_folder`` (checked first) as a model-only float32 step folder ``out``,
    reading and writing one tensor at a time."""
    import torch

    from engine.config import read_json_object
    from engine.hf import check_new_folder, model_args_for, open_hf

    check_new_folder(out, "out")
    vocab = read_json_object(os.path.join(hf_folder, "config.json"), "hf_folder").get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise ValueError(f"hf_folder: {hf_folder}/config.json has no positive integer vocab_size")
    args = model_args_for(model_name, flavor, vocab, field="--flavor", model_field="--model")
    with open_hf(hf_folder, args, model_label=f"--flavor {flavor}", field="hf_folder") as reader:
        shapes = {f"model.{name}": (shape, torch.float32) for name, shape in reader.shapes.items()}
        write_tensors(out, shapes, lambda key: reader.read(key[len("model."):]).to(torch.float32))
    tokenizer = os.path.join(hf_folder, "tokenizer.json")
    write_json(os.path.join(out, TRAIN_STATE_FILE), {
        "format": FORMAT_VERSION, "step": 0, "model_only": True, "model": model_name, "flavor": flavor,
        "dtype": "float32", "world_size": 1, "layout": "converted from Hugging Face", "source": hf_folder,
        **({"tokenizer": os.path.abspath(tokenizer)} if os.path.isfile(tokenizer) else {}),
    })
    write_commit_marker(out, 0)
    print(f"wrote {out} ({model_name}/{flavor}, model only, float32)")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m tools.convert_hf", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("to-hf", help="Tessera step folder -> Hugging Face folder")
    a.add_argument("checkpoint", help="a committed step folder (checkpoint/step-NNNNNN), saved on any layout")
    a.add_argument("out", help="the Hugging Face folder to write (new or empty)")
    a.add_argument("--dtype", choices=list(EXPORT_DTYPES), default="bfloat16",
                   help="the weights' dtype in model.safetensors (default: bfloat16)")
    tok = a.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", default="", help="a tokenizer.json to copy into the folder (default: the one "
                     "the run trained with, which the checkpoint records, when the file is still there)")
    tok.add_argument("--no-tokenizer", action="store_true", help="copy no tokenizer")
    b = sub.add_parser("from-hf", help="Hugging Face folder -> Tessera model-only step folder")
    b.add_argument("hf_folder", help="a folder with config.json and *.safetensors (e.g. Llama-3.1-8B)")
    b.add_argument("out", help="the step folder to write (new or empty), for checkpoint.initial_load_path")
    b.add_argument("--flavor", required=True, help="the model flavor these weights are (e.g. 8B)")
    b.add_argument("--model", default="llama3", help="the model name (default: llama3)")
    ns = parser.parse_args(argv)
    try:
        if ns.direction == "to-hf":
            to_hf(ns.checkpoint, ns.out, ns.dtype, ns.tokenizer, copy_tokenizer=not ns.no_tokenizer)
        else:
            from_hf(ns.hf_folder, ns.out, ns.flavor, ns.model)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from engine.lifetime import exit_now

    exit_now(main())  # without the interpreter's slow teardown of torch
