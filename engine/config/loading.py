"""Loading the configuration: the TOML file (``--config``), then ``--section.key value`` overrides from the command
line, with typed conversion, did-you-mean suggestions and torchtitan's names; ``--help``; the dump of a run's
config.toml.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import json
import math
import os
import sys
import textwrap
import typing
from functools import lru_cache

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from engine.config.errors import ConfigError, did_you_mean
from engine.config.schema import SECTIONS, Config

__all__ = ["ArgumentParser", "field_docs", "help_text", "TORCHTITAN_NAMES", "PATH_FIELDS", "set_value", "load_toml", "parse_args",
           "to_toml", "dump", "resume_settings", "changed_settings", "tomllib"]

# --------------------------------------------------------------------------------------------------------
# Field documentation (attribute docstrings, read from the source)
# --------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Map each field of a dataclass to the string literal that follows it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _field_type(cls: type, name: str) -> type:
    return typing.get_type_hints(cls)[name]


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (list, typing.List):
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def help_text() -> str:
    lines = [
        "usage: ./run_train.sh [--config FILE] [--section.key VALUE | --section.key=VALUE ...]",
        "",
        "Booleans also take --section.key (true) and --section.no-key (false). Lists are comma-separated.",
        "Environment (run_train.sh):",
        "  NGPU             processes on this node (default 1; gloo on a CPU-only machine)",
        "  LOG_RANK         comma-separated ranks whose output is shown (default 0)",
        "  CONFIG_FILE      the TOML file when no --config is given (default train_configs/debug_model.toml)",
        "  PYTHON           the interpreter (default python3)",
        "  TESSERA_BACKEND  the process-group backend instead of nccl (CUDA) / gloo (CPU): gloo or nccl",
        "  DRY_RUN          1: build for NGPU simulated ranks on the meta device, print the per-rank memory, train",
        "                   nothing; 0 (default): train",
        "  GPU_MEMORY_GIB   with DRY_RUN=1: the memory of one GPU in GiB (default 80)",
        "",
    ]
    defaults = Config()
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, section), f.name)
            lines.append(f"  --{section}.{f.name} ({_type_name(_field_type(cls, f.name))}, default {default!r})")
            lines.append(textwrap.fill(docs.get(f.name, ""), width=100, initial_indent=" " * 6, subsequent_indent=" " * 6))
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------
# Value conversion
# --------------------------------------------------------------------------------------------------------

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _toml_text(value) -> str:
    """A TOML value as a TOML file writes it."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_text(v) for v in value) + "]"
    return str(value)


def _shown(value, from_cli: bool) -> str:
    """A value in an error message: a command-line string quoted; a TOML value as the file writes it, a string
    as the string "..." (its quotes are what make it one)."""
    if from_cli:
        return repr(value)
    if isinstance(value, dict):
        return "a table"
    return f"the string {_toml_text(value)}" if isinstance(value, str) else _toml_text(value)


def _convert(key: str, tp, value, from_cli: bool):
    """Convert a TOML value (typed) or a CLI string to the field's type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (list, typing.List):
        (item_tp,) = typing.get_args(tp)
        if from_cli:
            value = [v.strip() for v in value.split(",")] if value.strip() else []
            if "" in value:  # '1,,2' or '1,2,': a value left out
                raise ConfigError(f"{key}: an empty item in the list '{','.join(value)}'; give comma-separated "
                                  "values with none left out")
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {_shown(value, from_cli)}")
        return [_convert(key, item_tp, v, from_cli) for v in value]
    if tp is bool:
        if from_cli:
            low = value.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
        elif isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {_shown(value, from_cli)}")
    if tp is int:
        number = None
        if from_cli:
            for base in (0, 10):  # 0x1f, 0o17, 1_000; base 10 for leading zeros (042), which base 0 refuses
                try:
                    number = int(value, base)
                    break
                except ValueError:
                    pass
        elif isinstance(value, int) and not isinstance(value, bool):
            number = value
        if number is None:
            raise ConfigError(f"{key}: expected an integer, got {_shown(value, from_cli)}")
        if not -2**63 <= number < 2**63:  # torch and the collectives' timeouts take 64-bit integers
            raise ConfigError(f"{key}: {number} does not fit in a 64-bit integer; give a smaller value")
        return number
    if tp is float:
        number = None
        if from_cli:
            try:
                number = float(value)
            except ValueError:
                pass
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {_shown(value, from_cli)}")
        if not math.isfinite(number):  # TOML and float() both take nan and inf
            raise ConfigError(f"{key}: expected a finite number, got {_shown(value, from_cli)}")
        return number
    if tp is str:
        if from_cli or isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {_shown(value, from_cli)}")
    raise AssertionError(f"unsupported config type {tp} for {key}")


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _names(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def _sections_with(name: str) -> list[str]:
    """The sections that have a key ``name``."""
    return [section for section in SECTIONS if name in _names(section)]


def _or_list(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


# torchtitan's (0.2 and nearby) names of the options that Tessera names otherwise, with Tessera's name; the
# torchtitan options without a Tessera counterpart are left out (they get the ordinary suggestion, if any).
TORCHTITAN_NAMES: dict[str, str] = {
    "job.config_file": "--config",
    "job.print_args": "job.print_config",
    "model.tokenizer_path": "model.hf_assets_path",
    "model.converters": "float8.enable",
    "training.dataset": "data.dataset",
    "training.dataset_path": "data.path",
    "training.batch_size": "training.local_batch_size",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
    "training.enable_cpu_offload": "parallelism.fsdp_cpu_offload",
    "training.compile": "compile.enable",
    "training.seed": "debug.seed",
    "training.deterministic": "debug.deterministic",
    "lr_scheduler.lr_min": "lr_scheduler.min_lr_factor",
    "parallelism.data_parallel_replicate_degree": "parallelism.dp_replicate",
    "parallelism.data_parallel_shard_degree": "parallelism.dp_shard",
    "parallelism.tensor_parallel_degree": "parallelism.tp",
    "parallelism.enable_async_tensor_parallel": "parallelism.enable_async_tp",
    "parallelism.context_parallel_degree": "parallelism.cp",
    "parallelism.context_parallel_rotate_method": "parallelism.cp_rotate",
    "parallelism.pipeline_parallel_degree": "parallelism.pp",
    "parallelism.pipeline_parallel_schedule": "parallelism.pp_schedule",
    "parallelism.pipeline_parallel_schedule_csv": "parallelism.pp_schedule_csv",
    "parallelism.pipeline_parallel_microbatch_size": "parallelism.pp_microbatches",
    "parallelism.pipeline_parallel_layers_per_stage": "parallelism.pp_layers_per_stage",
    "checkpoint.enable_checkpoint": "checkpoint.enable",
    "checkpoint.last_save_in_hf": "checkpoint.last_save_hf",
    "activation_checkpoint.selective_ac_option": "activation_checkpoint.selective_option",
    "float8.recipe_name": "float8.recipe",
    "float8.enable_fsdp_float8_all_gather": "float8.fsdp_float8_all_gather",
    "float8.precompute_float8_dynamic_scale_for_fsdp": "float8.precompute_scale",
    "validation.enabled": "validation.enable",
    "validation.dataset_path": "validation.path",
}
# Where Tessera's option takes another kind of value than torchtitan's.
_TORCHTITAN_NOTES = {
    "job.config_file": "a command-line option, not a config key",
    "model.tokenizer_path": "the folder with tokenizer.json; data.tokenizer takes it too, or the file",
    "model.converters": "converters = [\"float8\"] is float8.enable = true",
    "parallelism.pipeline_parallel_microbatch_size": "the number of microbatches: training.local_batch_size / "
                                                     "the microbatch size",
    "parallelism.pipeline_parallel_layers_per_stage": "a list: the layers of each stage",
}


def _unknown_key(key: str) -> ConfigError:
    """The error for a key that no section has: Tessera's name when it is torchtitan's name of a Tessera option,
    else the nearest keys, if any are near."""
    if key in TORCHTITAN_NAMES:
        note = _TORCHTITAN_NOTES.get(key)
        return ConfigError(f"unknown config key '{key}' (torchtitan's name); Tessera's is '{TORCHTITAN_NAMES[key]}'"
                           + (f" ({note})" if note else ""))
    if key in SECTIONS:  # a section given as if it were a key (`--compile`)
        return ConfigError(f"unknown config key '{key}': it is a section; give one of its keys, e.g. "
                           f"'{key}.{_names(key)[0]}'")
    return ConfigError(f"unknown config key '{key}'{_suggest_keys(key)}")


def _suggest_keys(key: str) -> str:
    """' (did you mean ...?)' for a mistyped key, '' when nothing is close: a close name of its section (the names
    compared without the section, whose shared prefix makes any two keys of a section look alike), a close key
    when the section is mistyped, else the sections that have the name (or, given no section, a close one)."""
    section, _, name = key.partition(".")
    if not name:  # no section
        section, name = "", section
    if section in SECTIONS:
        close = [f"{section}.{n}" for n in difflib.get_close_matches(name, _names(section), n=1, cutoff=0.75)]
    elif section:
        close = difflib.get_close_matches(key, _all_keys(), n=1, cutoff=0.75)
    else:  # the name in whichever sections have it
        names = sorted({n for s in SECTIONS for n in _names(s)})
        name = (difflib.get_close_matches(name, names, n=1, cutoff=0.75) or [name])[0]
        close = []
    close = close or [f"{s}.{name}" for s in _sections_with(name)]
    return f" (did you mean {_or_list([repr(k) for k in close])}?)" if close else ""


# Fields that hold a file or folder path: a leading ~ is expanded when the value is read (from the TOML file or
# the command line, where bash leaves `--key=~/x` alone), so that every consumer sees the same path.
PATH_FIELDS = frozenset({
    "job.dump_folder", "model.hf_assets_path", "data.path", "data.tokenizer", "parallelism.pp_schedule_csv",
    "validation.path", "checkpoint.folder", "checkpoint.initial_load_path", "profiling.save_traces_folder",
    "profiling.save_memory_snapshot_folder",
})


def set_value(cfg: Config, key: str, value, from_cli: bool) -> None:
    """Set ``section.name`` on cfg from a TOML value or a CLI string, checking the key and the type (and
    expanding ~ in PATH_FIELDS)."""
    section, _, name = key.partition(".")
    if section not in SECTIONS or name not in _names(section):
        raise _unknown_key(key)
    cls = SECTIONS[section]
    value = _convert(key, _field_type(cls, name), value, from_cli)
    setattr(getattr(cfg, section), name, os.path.expanduser(value) if key in PATH_FIELDS else value)


# --------------------------------------------------------------------------------------------------------
# Loading: TOML file, then command-line overrides
# --------------------------------------------------------------------------------------------------------


def load_toml(cfg: Config, path: str) -> None:
    if os.path.isdir(path):
        raise ConfigError(f"--config: '{path}' is a folder; pass a TOML file such as train_configs/debug_model.toml")
    if not os.path.exists(path):  # a file, or a pipe such as --config <(...)
        raise ConfigError(f"--config: file '{path}' not found; pass an existing TOML file such as train_configs/debug_model.toml")
    if not os.path.isfile(path) and os.environ.get("WORLD_SIZE", "1").strip() not in ("", "1"):
        raise ConfigError(f"--config: '{path}' is not a file (a pipe, such as <(...)?), which the launcher's processes "
                          "cannot each read; save it to a file")
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8-sig")  # a byte-order mark (some Windows editors write one) is dropped
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config: '{path}' is not valid TOML ({e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config: '{path}' is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"--config: cannot read '{path}': {e.strerror}") from None
    for section, values in data.items():
        if section not in SECTIONS and not isinstance(values, dict):  # a key above every [section] header
            where = _sections_with(section)
            fix = (f"put it under {_or_list([f'[{s}]' for s in where])}" if where else
                   f"no section has such a key{_suggest_keys(section)}")
            raise ConfigError(f"{section}: the key '{section}' in {path} must sit in a section; {fix}")
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section '[{section}]' in {path}{did_you_mean(section, SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a [{section}] table in {path}, got {values!r}")
        for name, value in values.items():
            set_value(cfg, f"{section}.{name}", value, from_cli=False)


def _is_bool_key(key: str) -> bool:
    section, _, name = key.partition(".")
    cls = SECTIONS.get(section)
    if cls is None or name not in {f.name for f in dataclasses.fields(cls)}:
        return False
    return _field_type(cls, name) is bool


def _negated_bool(key: str) -> str:
    """For ``section.no-name`` where ``section.name`` is a boolean: ``section.name``; else ''."""
    section, _, name = key.partition(".")
    if name.startswith("no-") and _is_bool_key(f"{section}.{name[3:]}"):
        return f"{section}.{name[3:]}"
    return ""


def parse_args(argv: list[str] | None = None) -> Config:
    """Build the Config from ``--config FILE`` and ``--section.key value`` overrides (file first)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_file = None
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}': options look like --section.key value")
        body = arg[2:]
        key, eq, inline = body.partition("=")
        if key == "config":
            if eq:
                value = inline
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
            else:
                raise ConfigError("--config: expects a TOML file path" + (f" before {argv[i + 1]}" if i + 1 < len(argv)
                                                                         else ""))
            if config_file is not None:
                raise ConfigError(f"--config: given twice ('{config_file}', then '{value}'); pass one file and "
                                  "override its values with --section.key value")
            config_file = os.path.expanduser(value)
        elif _negated_bool(key) and (eq or (i + 1 < len(argv) and not argv[i + 1].startswith("--"))):
            value = inline if eq else argv[i + 1]
            raise ConfigError(f"--{key}: takes no value (got '{value}'); use --{_negated_bool(key)} false or "
                              f"--{key}")
        elif eq:
            overrides.append((key, inline))
        elif _negated_bool(key):
            overrides.append((_negated_bool(key), "false"))
        elif _is_bool_key(key) and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
            overrides.append((key, "true"))
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            overrides.append((key, argv[i + 1]))
            i += 1
        elif key not in _all_keys():
            raise _unknown_key(key)
        else:
            raise ConfigError(f"--{key}: expects a value")
        i += 1
    cfg = Config()
    if config_file is not None:
        load_toml(cfg, config_file)
    for key, value in overrides:
        set_value(cfg, key, value, from_cli=True)
    return cfg


# --------------------------------------------------------------------------------------------------------
# Dump
# --------------------------------------------------------------------------------------------------------


def to_toml(cfg: Config) -> str:
    import tomli_w

    return tomli_w.dumps(cfg.to_dict())


def dump(cfg: Config, folder: str, resumed_step: int | None = None) -> str:
    """Write ``cfg`` as ``folder``/config.toml. A run resumed at ``resumed_step`` whose configuration differs from
    the one there keeps that one as config.before-step-<N>.toml (N: the resumed run's first step): what the steps
    before it ran with."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "config.toml")
    text = to_toml(cfg)
    if resumed_step is not None and os.path.isfile(path):
        with open(path) as f:
            changed = f.read() != text
        if changed:
            aside, n = os.path.join(folder, f"config.before-step-{resumed_step + 1}.toml"), 0
            while os.path.exists(aside):  # (resumed at that step again, with other settings again)
                n += 1
                aside = os.path.join(folder, f"config.before-step-{resumed_step + 1}.{n}.toml")
            os.replace(path, aside)
    with open(path, "w") as f:
        f.write(text)
    return path


# The sections whose values decide what a resumed run computes (the layout, kernels, logging and saving do not;
# the seed made the initial weights, and the data order is the checkpoint's).
RESUME_SECTIONS = ("model", "data", "training", "float8", "optimizer", "lr_scheduler")


def resume_settings(cfg: Config) -> dict:
    """The RESUME_SECTIONS of ``cfg`` as plain data: what a checkpoint keeps of the run that saved it."""
    return {section: dataclasses.asdict(getattr(cfg, section)) for section in RESUME_SECTIONS}


def changed_settings(saved: dict, cfg: Config) -> list[str]:
    """The fields of RESUME_SECTIONS whose value in ``cfg`` differs from ``saved`` (the ``resume_settings`` of the
    run that saved a checkpoint), as "section.key old -> new"; fields ``saved`` lacks are left out."""
    def text(value) -> str:
        return repr(value) if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)

    now, changes = resume_settings(cfg), []
    for section in RESUME_SECTIONS:
        old = saved.get(section)
        if not isinstance(old, dict):
            continue
        for key, value in now[section].items():
            if key in old and old[key] != value:
                changes.append(f"{section}.{key} {text(old[key])} -> {text(value)}")
    return changes


class ArgumentParser(argparse.ArgumentParser):
    """argparse with Tessera's error contract: a bad flag is one ``error:`` line on stderr and exit status 2
    (argparse's own usage block above its ``prog: error:`` line is left out; ``--help`` shows the usage)."""

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr, flush=True)
        sys.exit(2)
