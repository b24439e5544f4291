"""From ``cfg.data`` to the documents of one data-parallel rank, as a Hugging Face dataset.

Three kinds of source, all read through ``datasets.load_dataset`` so that they share one code path:

- ``data.path`` (wins when set): a local file or folder. The format comes from the extension: ``.json``
  and ``.jsonl`` (JSON Lines, or a JSON array) -> the ``json`` builder; ``.parquet`` -> ``parquet``;
  ``.txt`` -> ``text``; ``.gz``/``.bz2``/``.xz`` compressed json/jsonl/txt work too. A folder is
  searched recursively (hidden entries skipped); the first supported file in sorted order fixes the
  format and every file of that format is read, in sorted order (files of other formats are named in
  the run's `data:` line, not read).
  **Text files: one document per paragraph** (``sample_by="paragraph"``: documents are separated by a
  blank line; single line breaks stay inside a document). One document per line would cut prose into
  sentences, and one per file would leave a single big file as one document that cannot be split
  across data-parallel ranks.
- ``data.dataset`` naming a built-in dataset (``tessera_docs``, the gzip JSON Lines file shipped in
  ``engine/data/assets``), read with the ``json`` builder like any local file.
- any other ``data.dataset``: a Hugging Face Hub dataset, ``load_dataset(name, data.dataset_config or
  None, split=data.split, streaming=data.streaming)``.

Local files and the built-in dataset form a single ``train`` split (``data.split`` may slice it, e.g.
``train[:90%]``, when not streaming). The dataset is then split across data-parallel ranks with
``datasets.distributed.split_dataset_by_node``: a map-style dataset gets a contiguous chunk per rank; a
streaming one gets whole files per rank when the number of files is a multiple of the number of ranks,
else every world_size-th document.

The validation data (``validation.*``) goes through the same functions: ``validation_data(cfg)`` gives the
config to read it with and the fields its errors name (``DataFields``).

``check_data_config(cfg)`` runs every check that needs no data loaded (files exist, extension known, none
empty, parquet footers with rows, split name, the text column of the first record, tokenizer file), for the
training data and, when validation.enable, the validation data; ``build_dataset`` loads.
"""

from __future__ import annotations

import bz2
import contextlib
import copy
import gzip
import json
import logging
import lzma
import os
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.config import Config, ConfigError, did_you_mean
from engine.data.tokenizer import check_tokenizer_config

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
BUILTIN_DATASETS = {"tessera_docs": os.path.join(ASSETS_DIR, "tessera_docs.jsonl.gz")}

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
COMPRESSIBLE = ("json", "text")


@dataclass(frozen=True)
class DataFields:
    """The config fields that set a data source, as its errors name them: the training data's (data.*), or the
    validation data's (validation_data)."""

    path: str = "data.path"
    dataset: str = "data.dataset"
    split: str = "data.split"
    text_field: str = "data.text_field"
    """Named when the text column is missing or holds no text (the validation data's own source names it)."""


TRAINING_FIELDS = DataFields()


def validation_data(cfg: Config) -> tuple[Config, DataFields]:
    """The validation data: a copy of ``cfg`` whose data section reads it (validation.dataset with its own
    validation.dataset_config, data.dataset_config when it is data.dataset, or validation.path; validation.split
    and validation.text_field in the place of the training data's where set; one shard per data-parallel rank),
    and the fields its errors name (validation.* where set, else the data.* it takes)."""
    v = cfg.validation
    vcfg = copy.deepcopy(cfg)
    fields = {}
    if v.dataset:
        vcfg.data.dataset, vcfg.data.path = v.dataset, ""
        # Its own configuration; the same dataset as the training data's keeps that one unless it names another.
        same = v.dataset == cfg.data.dataset
        vcfg.data.dataset_config = v.dataset_config or (cfg.data.dataset_config if same else "")
        fields["dataset"] = fields["text_field"] = "validation.dataset"
        fields["path"] = "validation.path"  # where its local files would be given instead (the Hub error's advice)
    elif v.path:
        vcfg.data.path = v.path
        fields["path"] = fields["text_field"] = "validation.path"
    if v.split:
        vcfg.data.split = v.split
        fields["split"] = "validation.split"
    if v.text_field:
        vcfg.data.text_field = v.text_field
        fields["text_field"] = "validation.text_field"
    vcfg.data.num_shards = -1
    return vcfg, DataFields(**fields)


@dataclass
class DataSource:
    """Where the documents come from, resolved from the config without reading any data."""

    kind: str  # "local", "builtin" or "hub"
    field: str  # the config field that chose it: fields.path or fields.dataset
    name: str  # the path, built-in name or hub name as given
    builder: str = ""  # local/builtin: "json", "parquet" or "text"
    files: list[str] = field(default_factory=list)  # local/builtin: absolute paths, sorted
    ignored: list[str] = field(default_factory=list)  # a folder's supported files of another format, not read
    fields: DataFields = TRAINING_FIELDS  # the fields its errors name

    def describe(self) -> str:
        if self.kind == "hub":
            return f"Hugging Face dataset '{self.name}'"
        if self.kind == "builtin":
            return f"built-in dataset '{self.name}'"
        return f"'{self.name}' ({len(self.files)} {self.builder} file{'s' if len(self.files) != 1 else ''})"


def file_format(path: str) -> str | None:
    """The ``datasets`` builder for a file name, or None if unsupported."""
    lower = path.lower()
    compressed = False
    for ext in COMPRESSIONS:
        if lower.endswith(ext):
            lower, compressed = lower[: -len(ext)], True
            break
    builder = FORMATS.get(os.path.splitext(lower)[1])
    if builder is None or (compressed and builder not in COMPRESSIBLE):
        return None
    return builder


def _supported_list() -> str:
    return "json, jsonl, parquet or txt (json, jsonl and txt also .gz, .bz2 or .xz compressed)"


def _folder_files(folder: str, key: str) -> tuple[str, list[str], list[str]]:
    """(format, its files, the supported files of other formats) of a folder, the value of the field ``key``: the
    format that holds most of the folder's bytes (a README.txt beside parquet shards is not the data), the first
    file's on a tie."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if not name.startswith("."):
                found.append(os.path.join(dirpath, name))
    found.sort(key=lambda p: os.path.relpath(p, folder))
    formats = {path: file_format(path) for path in found}
    sizes: dict[str, int] = {}  # format -> bytes, in the order the formats are first met
    for path, f in formats.items():
        if f is not None:
            sizes[f] = sizes.get(f, 0) + os.path.getsize(path)
    builder = max(sizes, key=sizes.__getitem__) if sizes else None  # max keeps the first of equals
    if builder is not None:
        return (builder, [p for p, f in formats.items() if f == builder],
                [p for p, f in formats.items() if f not in (None, builder)])
    raise ConfigError(f"{key}: folder '{folder}' holds no {_supported_list()} files")


def resolve_source(cfg: Config, fields: DataFields = TRAINING_FIELDS) -> DataSource:
    """Resolve data.path / data.dataset to a DataSource whose errors name ``fields``; cheap, raises
    ConfigError."""
    d = cfg.data
    if d.path:
        path = os.path.abspath(d.path)
        if not os.path.exists(path):
            raise ConfigError(f"{fields.path}: '{d.path}' not found; give a {_supported_list()} file or a folder of them")
        if os.path.isdir(path):
            builder, files, ignored = _folder_files(path, fields.path)
            return DataSource("local", fields.path, d.path, builder, files, ignored, fields)
        builder = file_format(path)
        if builder is None:
            raise ConfigError(f"{fields.path}: '{d.path}' has an unsupported extension; give a {_supported_list()} file")
        return DataSource("local", fields.path, d.path, builder, [path], fields=fields)
    if not d.dataset:
        raise ConfigError(f"{fields.dataset}: empty; name a built-in dataset (tessera_docs), a Hugging Face dataset, "
                          f"or set {fields.path}")
    if d.dataset in BUILTIN_DATASETS:
        path = BUILTIN_DATASETS[d.dataset]
        if not os.path.isfile(path):
            raise ConfigError(f"{fields.dataset}: the built-in dataset file '{path}' is missing; reinstall Tessera")
        return DataSource("builtin", fields.dataset, d.dataset, "json", [path], fields=fields)
    if file_format(d.dataset) is not None or os.path.exists(d.dataset):
        raise ConfigError(f"{fields.dataset}: '{d.dataset}' looks like a local file; set {fields.path} for local data")
    builtin = did_you_mean(d.dataset, BUILTIN_DATASETS)
    if builtin and "/" not in d.dataset:  # a typo of a built-in name, not a Hub dataset (owner/name)
        raise ConfigError(f"{fields.dataset}: '{d.dataset}' is not a built-in dataset{builtin}; a Hugging Face "
                          "dataset is named owner/name")
    return DataSource("hub", fields.dataset, d.dataset, fields=fields)


def _check_split(cfg: Config, source: DataSource) -> None:
    split, key = cfg.data.split.strip(), source.fields.split
    if not split:
        raise ConfigError(f"{key}: must not be empty")
    if source.kind == "hub":
        return
    if split.split("[")[0].strip() != "train":
        raise ConfigError(
            f"{key}: {source.describe()} has a single 'train' split (nothing is held out yet), got '{split}'"
        )
    if "[" in split and cfg.data.streaming:
        raise ConfigError(f"{key}: slicing ('{split}') needs data.streaming = false")


def _open_text(path: str):
    lower = path.lower()
    for ext, opener in COMPRESSIONS.items():
        if lower.endswith(ext):
            return opener(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _first_record_columns(source: DataSource) -> list[str] | None:
    """Column names from the first record of the first file, when that is cheap; None if unknown."""
    if source.builder == "text":
        return ["text"]
    path = source.files[0]
    if source.builder == "parquet":  # (_check_files has read its footer)
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    try:
        with _open_text(path) as f:
            for _ in range(1000):  # skip leading blank lines, but never scan a whole file
                line = f.readline(1 << 20)
                if not line:  # (the json reader takes its columns from this file: it would find none)
                    remove = f"; remove it from '{source.name}'" if len(source.files) > 1 else ""
                    raise ConfigError(f"{source.field}: '{path}' has no documents (nothing but blank lines){remove}")
                if line.strip():
                    break
            else:
                return None
    except (OSError, UnicodeDecodeError, EOFError, lzma.LZMAError) as e:
        raise ConfigError(f"{source.field}: cannot read '{path}' ({e})") from None
    try:
        record = json.loads(line)
    except ValueError:
        return None  # a pretty-printed JSON document: the json builder will tell
    return list(record) if isinstance(record, dict) else None


def _missing_field_error(text_field: str, columns, source: DataSource) -> ConfigError:
    found = ", ".join(repr(c) for c in columns) if columns else "none"
    return ConfigError(f"{source.fields.text_field}: '{text_field}' is not a column of {source.describe()}; columns "
                       f"found: {found}")


def _check_files(source: DataSource) -> None:
    """Every file of a local source holds something: not 0 bytes, and a parquet file has a readable footer with
    rows (its metadata only; nothing else is read). The error names the file."""
    import pyarrow.parquet as pq

    remove = f"; remove it from '{source.name}'" if len(source.files) > 1 else ""
    for path in source.files:
        if os.path.getsize(path) == 0:
            raise ConfigError(f"{source.field}: '{path}' is empty{remove}")
        if source.builder == "parquet":
            try:
                rows = pq.read_metadata(path).num_rows
            except Exception as e:
                raise ConfigError(
                    f"{source.field}: '{path}' is not a valid parquet file ({one_line(e)}){remove}"
                ) from None
            if rows == 0:
                raise ConfigError(f"{source.field}: '{path}' has no documents (0 rows){remove}")


def check_dataset_config(cfg: Config, fields: DataFields = TRAINING_FIELDS) -> DataSource:
    """The data checks that need no data loaded (no tokenizer check); returns the resolved source, whose errors
    name ``fields``."""
    if not cfg.data.text_field:
        raise ConfigError("data.text_field: must not be empty")
    source = resolve_source(cfg, fields)
    _check_split(cfg, source)
    if source.kind != "hub":
        _check_files(source)
        columns = _first_record_columns(source)
        if columns is not None and cfg.data.text_field not in columns:
            raise _missing_field_error(cfg.data.text_field, columns, source)
    return source


def check_data_config(cfg: Config) -> DataSource:
    """Every data and tokenizer check that needs no data loaded (files exist, extension known, split name,
    the text column of the first record, tokenizer file), for the training data and, when validation.enable, the
    validation data; raises ConfigError naming the field. Cheap: the entry point calls it before building
    anything. Returns the training data's source."""
    source = check_dataset_config(cfg)
    if cfg.validation.enable:
        check_dataset_config(*validation_data(cfg))
    check_tokenizer_config(cfg)
    return source


@contextlib.contextmanager
def _datasets_quiet():
    """Silence the datasets library's own output while it reads the data: its json reader logs a parse error
    before raising it, huggingface_hub logs every retry of an unreachable Hub, and the progress bar would stay on
    the screen above Tessera's one error line."""
    import datasets

    loggers = [logging.getLogger(name) for name in ("datasets", "huggingface_hub")]
    levels = [logger.level for logger in loggers]
    bars_were_on = datasets.is_progress_bar_enabled()
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    # The file readers' error line (it names the file) still reaches capture_reader_errors' holder, not the screen.
    readers = logging.getLogger("datasets.packaged_modules")
    readers_level = readers.level
    capture_reader_errors().pop()
    readers.setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        readers.setLevel(readers_level)
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if bars_were_on:
            datasets.enable_progress_bars()


class _ReaderErrors(logging.Handler):
    """datasets' file readers (datasets.packaged_modules) log an error that names the file before they raise it.
    While Tessera streams, that line is kept here, for Tessera's one error line, instead of being printed above
    it; their other records go on to the datasets logger as before."""

    def __init__(self):
        super().__init__()
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            self.last = record.getMessage()
        else:
            logging.getLogger("datasets").handle(record)

    def pop(self) -> str:
        last, self.last = self.last, ""
        return last


_READER_ERRORS = _ReaderErrors()


def capture_reader_errors() -> _ReaderErrors:
    """Route the readers' error log to the returned holder from now on (idempotent)."""
    logger = logging.getLogger("datasets.packaged_modules")
    if _READER_ERRORS not in logger.handlers:
        logger.addHandler(_READER_ERRORS)
        logger.propagate = False
    return _READER_ERRORS


class DataError(ConfigError):
    """The data turned out unreadable while training (a malformed record beyond the ones checked at start-up):
    a user error found late, reported as one line like the others (engine/train.py)."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """The exception in one line; for a wrapper (datasets' "An error occurred while generating the dataset"),
    the exception it was raised from, which says what is wrong."""
    while e.__cause__ is not None and type(e).__name__ == "DatasetGenerationError":
        e = e.__cause__
    return f"{type(e).__name__}: {one_line_text(str(e), limit) or 'no details'}"


def one_line_text(text: str, limit: int = 300) -> str:
    """``text`` on one line (whitespace runs made one space), cut to ``limit`` characters with "..."."""
    text = " ".join(text.split())
    return text[: limit - 3] + "..." if len(text) > limit else text


def reader_error_text(text: str) -> str:
    """A file reader's error line (capture_reader_errors) on one line, "<class 'pyarrow.lib.ArrowInvalid'>" as
    "ArrowInvalid"."""
    return one_line_text(re.sub(r"<class '(?:\w+\.)*(\w+)'>", r"\1", text))


def load_full_dataset(cfg: Config, source: DataSource | None = None):
    """The whole dataset (every rank's documents): a ``datasets.Dataset`` or ``IterableDataset``."""
    import datasets

    source = source or check_dataset_config(cfg)
    d = cfg.data
    try:
        with _datasets_quiet():
            if source.kind == "hub":
                return datasets.load_dataset(d.dataset, d.dataset_config or None, split=d.split,
                                             streaming=d.streaming)
            kwargs = {"sample_by": "paragraph"} if source.builder == "text" else {}
            return datasets.load_dataset(
                source.builder, data_files=source.files, split=d.split, streaming=d.streaming, **kwargs
            )
    except ConfigError:
        raise
    except Exception as e:
        what = f"'{d.dataset}'" + (f" (config '{d.dataset_config}')" if d.dataset_config else "")
        if source.kind != "hub":
            what = source.describe()
            if _no_data(e):  # every file empty (compressed or blank lines: more than 0 bytes)
                raise ConfigError(f"{source.field}: {what} has no documents") from None
        advice = ""
        if source.kind == "hub" and isinstance(e, ConnectionError):  # no network here (a compute node), or offline
            advice = (f"; without network here, download its files where there is (hf download --repo-type dataset "
                      f"{d.dataset} --local-dir DIR) and give them with {source.fields.path}")
        detail = reader_error_text(capture_reader_errors().pop()) or one_line(e)  # the reader's line names the file
        raise ConfigError(f"{source.field}: cannot load {what}: {detail}{advice}") from None


def _no_data(e: BaseException) -> bool:
    """Whether ``datasets.load_dataset`` failed because its files hold no records at all: the json builder's
    feature inference finds no first record (a StopIteration), or the split comes out empty."""
    while e.__cause__ is not None and type(e).__name__ == "DatasetGenerationError":
        e = e.__cause__
    return isinstance(e, StopIteration) or "corresponds to no data" in str(e)


class DatasetShard(NamedTuple):
    """One data shard's documents, and how many files the whole stream has (0 when not streaming): a stream
    whose files do not split evenly over the shards is read whole by every shard (``split_note``)."""

    dataset: Any  # a datasets.Dataset (data.streaming = false) or datasets.IterableDataset
    stream_files: int


def split_note(stream_files: int, num_shards: int, dp: int) -> str:
    """How a stream of ``stream_files`` files is split over ``num_shards`` data shards (read by ``dp``
    data-parallel ranks), for the start-up log."""
    if not stream_files or num_shards == 1:
        return ""
    if stream_files % num_shards == 0:
        return f"; {num_shards} data shards of {stream_files // num_shards} whole file(s) each"
    fix = f"for large data, split it into a multiple of {num_shards} files, or set data.streaming = false"
    if stream_files % dp == 0:  # some multiple of dp divides the file count: dp itself (no resume on other degrees)
        fix += (f"; or, if no resume is to read it on another dp degree, set data.num_shards to a multiple of {dp} "
                f"(the dp degree) that divides {stream_files}")
    return (f"; its {stream_files} file(s) do not split evenly over {num_shards} data shards: every shard reads all "
            f"of them and keeps 1 document in {num_shards} ({num_shards}x the reading; {fix})")


def build_dataset(cfg: Config, dp_rank: int = 0, dp_world_size: int = 1, fields: DataFields = TRAINING_FIELDS):
    """This rank's share of the dataset (``build_dataset_shard``'s dataset)."""
    return build_dataset_shard(cfg, dp_rank, dp_world_size, fields).dataset


def build_dataset_shard(cfg: Config, dp_rank: int = 0, dp_world_size: int = 1,
                        fields: DataFields = TRAINING_FIELDS) -> DatasetShard:
    """Share ``dp_rank`` of ``dp_world_size`` of the dataset, with the text column and non-emptiness checked;
    its errors name ``fields``."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_world_size})")
    source = check_dataset_config(cfg, fields)
    full = load_full_dataset(cfg, source)
    text_field = cfg.data.text_field
    columns = full.column_names
    if columns is not None and text_field not in columns:
        raise _missing_field_error(text_field, columns, source)
    if isinstance(full, datasets.Dataset) and len(full) == 0:
        raise ConfigError(f"{source.field}: {source.describe()} has no documents")
    if isinstance(full, datasets.Dataset) and len(full) < dp_world_size:
        n, last = len(full), dp_world_size - 1
        unit = "shard" if cfg.data.num_shards > 0 else "rank"
        none = f"{unit} {n}" if n == last else f"{unit}s {n} to {last}"
        if cfg.data.num_shards > 0:
            raise ConfigError(
                f"data.num_shards: {source.describe()} has {n} documents, too few for {dp_world_size} data shards "
                f"({none} would get none); set data.num_shards to {n} or fewer (a multiple of the data-parallel "
                "degree), or give more documents"
            )
        raise ConfigError(
            f"{source.field}: {source.describe()} has {n} documents, too few for {dp_world_size} data-parallel "
            f"ranks ({none} would get none); give more documents, or train on fewer data-parallel ranks"
        )
    ds = split_dataset_by_node(full, rank=dp_rank, world_size=dp_world_size) if dp_world_size > 1 else full
    if isinstance(ds, datasets.Dataset):
        return DatasetShard(ds, 0)
    # Streaming: look at this rank's first document (a fresh iteration; it does not move the dataset).
    try:
        with _datasets_quiet():
            first = next(iter(ds), None)
    except ConfigError:
        raise
    except Exception as e:
        detail = reader_error_text(capture_reader_errors().pop()) or one_line(e)  # the reader's line names the file
        raise ConfigError(f"{source.field}: cannot read {source.describe()}: {detail}") from None
    if first is None:
        raise ConfigError(no_documents_message(cfg, source, dp_rank, dp_world_size))
    if text_field not in first:
        raise _missing_field_error(text_field, list(first), source)
    return DatasetShard(ds, full.n_shards)


def no_documents_message(cfg: Config, source: DataSource, shard: int, num_shards: int,
                         documents: str = "documents") -> str:
    """The error for data shard ``shard`` of ``num_shards`` finding no ``documents``: it names data.num_shards
    when that setting made the split (else the shards are the data-parallel ranks, and the data's field)."""
    if num_shards == 1:
        return f"{source.field}: {source.describe()} has no {documents}"
    if cfg.data.num_shards > 0:
        return (f"data.num_shards: {source.describe()} has no {documents} for data shard {shard} of {num_shards}; "
                "set data.num_shards lower, or give more documents")
    return f"{source.field}: {source.describe()} has no {documents} for data-parallel rank {shard} of {num_shards}"


def document_text(example: dict, text_field: str, source_field: str = "data.text_field") -> str | None:
    """The text of one record; None for a null or empty text (such records are skipped)."""
    text = example.get(text_field) if isinstance(example, dict) else None
    if text is None or text == "":
        return None
    if not isinstance(text, str):
        raise ConfigError(f"{source_field}: column '{text_field}' holds {type(text).__name__} values, not text")
    return text
