"""Packing documents into fixed-length samples, and a data loader that resumes exactly.

Each document becomes ``[BOS] + tokens + [EOS]`` (no BOS for a tokenizer without one); the documents are laid end
to end and cut into samples of ``seq_len + 1`` tokens with no padding (the tokens left over stay for the next
sample): ``input_ids = sample[:-1]``, ``labels = sample[1:]``, and ``doc_ids[i]`` is the index, counted from 0
within the sample, of the document that input token ``i`` belongs to (a block-causal mask lets token ``i`` see
token ``j`` when ``doc_ids[i] == doc_ids[j]``).

The dataset is read over and over (epochs) so training never runs out of data. A map-style dataset
(``data.streaming = false``) is read in a fresh order each epoch, a permutation seeded by
``(debug.seed, epoch)``; a streaming dataset is read in its own order (``IterableDataset.set_epoch``
lets ``datasets`` reorder whole files between epochs, the same way on every rank).

Resume. ``DataLoader.state_dict()`` is plain JSON data. It does not hold the token buffer: it records
where the next sample starts, as (the document it starts in, the token offset in it). The document is
identified by the epoch and its index in this rank's epoch order (map-style), or by the streaming
dataset's own ``IterableDataset.state_dict()`` taken just before that document was read; on resume the
document is read and tokenized again and its first ``offset`` tokens are skipped. So the state stays
small whatever the document sizes, and it records how many documents this rank has finished, in this
epoch and in all.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator

import numpy as np
import torch

from engine.config import Config, ConfigError, check_shard_split
from engine.data.datasets import (TRAINING_FIELDS, DataError, DataFields, build_dataset_shard, capture_reader_errors,
                                  document_text, no_documents_message, one_line, reader_error_text, resolve_source,
                                  split_note)

STATE_VERSION = 1
READ_AHEAD = 64  # records read and tokenized together


class _Doc:
    """A document being packed: its tokens and where it sits in the data order."""

    __slots__ = ("tokens", "epoch", "index", "ds_state", "ds_state_after")

    def __init__(self, tokens, epoch, index, ds_state, ds_state_after):
        self.tokens = tokens  # list[int]: BOS (when the tokenizer has one) + text tokens + EOS
        self.epoch = epoch
        self.index = index  # position of its record in this rank's epoch order
        self.ds_state = ds_state  # streaming: the dataset's state before this record (None: epoch start)
        self.ds_state_after = ds_state_after  # streaming: the dataset's state after it


class DataLoader:
    """Packed batches ``{"input_ids", "labels", "doc_ids"}``, LongTensor[B, S] on the CPU, forever.

    B = training.local_batch_size, S = training.seq_len. Iterating yields batches until the process
    stops; ``state_dict``/``load_state_dict`` save and restore the position after the last batch.
    """

    def __init__(self, cfg: Config, tokenizer, dp_rank: int, dp_world_size: int,
                 fields: DataFields = TRAINING_FIELDS):
        import datasets

        self.cfg = cfg
        self.tokenizer = tokenizer
        self.dp_rank = int(dp_rank)
        self.dp_world_size = int(dp_world_size)
        self.seq_len = cfg.training.seq_len
        self.batch_size = cfg.training.local_batch_size
        self.seed = cfg.debug.seed
        self.text_field = cfg.data.text_field
        self.source = resolve_source(cfg, fields)
        self.dataset, self.stream_files = build_dataset_shard(cfg, self.dp_rank, self.dp_world_size, fields)
        self.streaming = not isinstance(self.dataset, datasets.Dataset)
        if not self.streaming:
            self.dataset = self.dataset.select_columns([self.text_field])
        self._order_cache: tuple[int, np.ndarray] | None = None
        self.batches_produced = 0
        self.samples_produced = 0
        self._set_position(epoch=0, index=0, ds_state=None, offset=0, docs_consumed=0)
        self._check_first_document()

    def _check_first_document(self) -> None:
        """Read and tokenize this shard's first document now (a fresh read; the position does not move), so
        that a text column of the wrong type, or one with no text at all, stops the run before it starts
        instead of at its first step."""
        docs = self._document_stream(0, 0, None, at_start=True)
        try:
            next(docs)
        finally:
            docs.close()

    # ------------------------------------------------------------------------------------------------
    # Position
    # ------------------------------------------------------------------------------------------------

    def _set_position(self, epoch: int, index: int, ds_state, offset: int, docs_consumed: int) -> None:
        """Make the next sample start at token ``offset`` of document ``index`` of ``epoch``."""
        self._epoch = epoch
        self._index = index
        self._ds_state = ds_state
        self._offset = offset
        self._docs_consumed = docs_consumed
        self._doc: _Doc | None = None  # the current document, once read
        self._docs: Iterator[_Doc] | None = None  # started lazily, from the position above

    @property
    def epoch(self) -> int:
        """The epoch (0: the first pass over this shard) of the document the next sample starts in, once read."""
        return self._doc.epoch if self._doc is not None else self._epoch

    def _order(self, epoch: int) -> np.ndarray:
        """Map-style: this rank's document order in ``epoch``."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order_cache = (epoch, rng.permutation(len(self.dataset)))
        return self._order_cache[1]

    def _records(self, epoch: int, index: int, ds_state) -> Iterator[tuple[int, object, object, dict]]:
        """(index, state before, state after, record) for the records of ``epoch`` from ``index`` on."""
        if self.streaming:
            ds = self.dataset
            ds.set_epoch(epoch)
            # Always (re)set the starting state: None starts the epoch at its beginning, even when an earlier
            # state of the same epoch was loaded into this dataset object.
            ds.load_state_dict(copy.deepcopy(ds_state) if ds_state is not None else None)
            before = ds_state
            reader_errors = capture_reader_errors()
            reader_errors.pop()  # (nothing left from an earlier read)
            records = iter(ds)
            while True:
                try:
                    record = next(records)
                except StopIteration:
                    break
                except Exception as e:  # a malformed record beyond what the start-up checks read
                    detail = reader_error_text(reader_errors.pop()) or one_line(e)  # the reader's line names the file
                    raise DataError(
                        f"{self.source.field}: cannot read {self.source.describe()} past record {index} of shard "
                        f"{self.dp_rank} of {self.dp_world_size} (epoch {epoch}): {detail}; fix or remove the "
                        "bad record, then resume from the last checkpoint"
                    ) from None
                after = ds.state_dict()
                yield index, before, after, record
                index += 1
                before = after
        else:
            order = self._order(epoch)
            for i in range(index, len(order)):
                yield i, None, None, self.dataset[int(order[i])]

    def _where(self, epoch: int, i: int) -> str:
        """Where record ``i`` of ``epoch`` (a position in this rank's order) is, for an error: its record number in
        the shard's stream, or a map-style shard's row (the order is shuffled: its position would mislead)."""
        if self.streaming:
            return f"record {i} of shard {self.dp_rank} of {self.dp_world_size}, epoch {epoch}"
        return f"row {int(self._order(epoch)[i])} of shard {self.dp_rank} of {self.dp_world_size}"

    def _document_stream(self, epoch: int, index: int, ds_state, at_start: bool = False) -> Iterator[_Doc]:
        """Documents from (epoch, index[, ds_state]) on, forever; records with a null/empty text are skipped.
        Bad data raises DataError (mid-run), or ConfigError when ``at_start`` (the start-up check).

        Records are read ahead in groups of READ_AHEAD and tokenized together (in parallel); every
        document keeps its own position, so reading ahead does not change what a state_dict records.
        """
        while True:
            whole_epoch = index == 0 and ds_state is None
            yielded = 0
            pending: list[tuple[str, int, object, object]] = []
            records = self._records(epoch, index, ds_state)
            while True:
                record = next(records, None)
                if record is not None:
                    i, before, after, example = record
                    try:
                        text = document_text(example, self.text_field, self.source.fields.text_field)
                    except ConfigError as e:
                        if at_start:  # one of the first records: fix it before the run starts
                            raise ConfigError(f"{e} ({self._where(epoch, i)}); fix or remove the bad record") from None
                        raise DataError(
                            f"{e} ({self._where(epoch, i)}); fix or remove the bad record, then resume from the last "
                            "checkpoint"
                        ) from None
                    if text is not None:
                        pending.append((text, i, before, after))
                if pending and (record is None or len(pending) >= READ_AHEAD):
                    token_lists = self.tokenizer.encode_batch([p[0] for p in pending])
                    for tokens, (_, i, before, after) in zip(token_lists, pending):
                        yielded += 1
                        yield _Doc(tokens, epoch, i, before, after)
                    pending = []
                if record is None:
                    break
            if whole_epoch and not yielded:  # (an epoch after the first: the data changed under the run)
                raise (ConfigError if at_start else DataError)(no_documents_message(
                    self.cfg, self.source, self.dp_rank, self.dp_world_size,
                    f"non-empty '{self.text_field}' documents"))
            epoch, index, ds_state = epoch + 1, 0, None

    def _current_doc(self) -> _Doc:
        if self._doc is None:
            if self._docs is None:
                self._docs = self._document_stream(self._epoch, self._index, self._ds_state)
            self._doc = next(self._docs)
            self._epoch, self._index, self._ds_state = self._doc.epoch, self._doc.index, self._doc.ds_state
            if self._offset > len(self._doc.tokens):  # a resumed position inside a document now shorter
                raise DataError(
                    f"data.tokenizer: the checkpoint's data position is token {self._offset} of record "
                    f"{self._index} of shard {self.dp_rank} (epoch {self._epoch}), which now has "
                    f"{len(self._doc.tokens)} tokens: the data or the tokenizer changed since that checkpoint; "
                    "resume with the same ones, or leave the data position out (checkpoint.exclude_from_loading "
                    "= [\"dataloader\"])"
                )
        return self._doc

    def _advance_doc(self) -> None:
        """The current document is used up: move the position to the one after it."""
        doc = self._doc
        self._docs_consumed += 1
        self._doc = None
        self._offset = 0
        self._index = doc.index + 1
        self._ds_state = doc.ds_state_after
        # (epoch stays; the stream moves to the next epoch itself and the next _current_doc records it)

    # ------------------------------------------------------------------------------------------------
    # Packing
    # ------------------------------------------------------------------------------------------------

    def _next_sample(self) -> tuple[list[int], list[int]]:
        """seq_len + 1 tokens and the document index (within the sample) of each."""
        need = self.seq_len + 1
        tokens: list[int] = []
        doc_ids: list[int] = []
        k = 0
        while need:
            doc = self._current_doc()
            take = min(need, len(doc.tokens) - self._offset)
            tokens.extend(doc.tokens[self._offset : self._offset + take])
            doc_ids.extend([k] * take)
            self._offset += take
            need -= take
            if self._offset == len(doc.tokens):
                self._advance_doc()
                k += 1
        return tokens, doc_ids

    def next_sample(self) -> tuple[list[int], list[int]]:
        """The next packed sample of this shard (tokens, document ids); counted in the state."""
        sample = self._next_sample()
        self.samples_produced += 1
        return sample

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        samples = [self.next_sample() for _ in range(self.batch_size)]
        tokens = torch.tensor([s[0] for s in samples], dtype=torch.long)
        doc_ids = torch.tensor([s[1][:-1] for s in samples], dtype=torch.long)
        self.batches_produced += 1
        return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "doc_ids": doc_ids}

    # ------------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The position after the last batch, as JSON-serializable data (ints, strings, lists, dicts)."""
        doc = self._doc
        return {
            "version": STATE_VERSION,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "streaming": self.streaming,
            "source": source_id(self.source.kind, self.source.name),
            "reading": reading_options(self.cfg, self.source.kind, self.tokenizer),
            "seed": self.seed,
            # The next sample starts at token `token_offset` of document `docs_in_epoch` of `epoch`
            # (this rank's order); `dataset_state` (streaming) is the dataset's state just before it.
            "epoch": doc.epoch if doc is not None else self._epoch,
            "docs_in_epoch": doc.index if doc is not None else self._index,
            "token_offset": self._offset,
            "dataset_state": copy.deepcopy(doc.ds_state if doc is not None else self._ds_state),
            "docs_consumed": self._docs_consumed,  # documents this rank has finished, all epochs (skipped
            # null/empty records not counted; docs_in_epoch counts every record)
            "batches": self.batches_produced,
            "samples": self.samples_produced,
        }

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"data loader state: unknown format (version {state.get('version') if isinstance(state, dict) else None})")
        if state["dp_rank"] != self.dp_rank or state["dp_world_size"] != self.dp_world_size:
            raise ValueError(
                f"data loader state: saved by data-parallel rank {state['dp_rank']} of {state['dp_world_size']}, "
                f"loaded by rank {self.dp_rank} of {self.dp_world_size}; resuming with another data-parallel "
                "degree is not supported yet"
            )
        if bool(state["streaming"]) != self.streaming:
            raise ValueError(
                f"data loader state: saved with data.streaming = {str(state['streaming']).lower()}, "
                f"resumed with {str(self.streaming).lower()}; use the same setting to resume"
            )
        if not self.streaming and state["docs_in_epoch"] > len(self.dataset):
            raise ConfigError(
                f"{self.source.field}: the checkpoint's data position is record {state['docs_in_epoch']} of shard "
                f"{self.dp_rank} of {self.dp_world_size} (epoch {state['epoch']}), past the {len(self.dataset)} "
                f"records that shard of {self.source.describe()} now holds: the data changed since that checkpoint; "
                "resume with the same data, or set checkpoint.exclude_from_loading = [\"dataloader\"] to read it "
                "from its beginning"
            )
        self.batches_produced = int(state.get("batches", 0))
        self.samples_produced = int(state.get("samples", 0))
        self._set_position(
            epoch=int(state["epoch"]),
            index=int(state["docs_in_epoch"]),
            ds_state=copy.deepcopy(state["dataset_state"]),
            offset=int(state["token_offset"]),
            docs_consumed=int(state["docs_consumed"]),
        )
        if self.seed != state.get("seed", self.seed) and not self.streaming:
            # The order of an epoch depends on the seed; keep the saved one so that the resumed run continues
            # the interrupted epoch exactly.
            self.seed = int(state["seed"])
            self._order_cache = None


SHARDED_STATE_VERSION = 1
SAMPLE_ID_STRIDE = 1 << 36  # sample id = shard * stride + index of the sample in its shard


def source_id(kind: str, name: str) -> str:
    """How a loader's state names its data: "kind:name" of its DataSource, a local path made absolute."""
    return f"{kind}:{os.path.abspath(name) if kind == 'local' else name}"


READING_FIELDS = {"dataset_config": "data.dataset_config", "split": "data.split", "text_field": "data.text_field",
                  "bos_id": "data.tokenizer", "eos_id": "data.tokenizer"}
"""The config field that sets each of reading_options' entries."""


def reading_options(cfg: Config, kind: str, tokenizer=None) -> dict:
    """What chooses the records of a source that are read, and the tokens of each (saved with a loader's position:
    a position in one split, column or framing means nothing in another): the split, the text column, a Hub
    dataset's configuration, and with ``tokenizer`` the BOS and EOS ids that frame each document (BOS None: no
    BOS)."""
    options = {"dataset_config": cfg.data.dataset_config if kind == "hub" else "", "split": cfg.data.split.strip(),
               "text_field": cfg.data.text_field}
    if tokenizer is not None:
        options.update(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    return options


class ShardedDataLoader:
    """A data-parallel rank's loader over logical shards, so that a run can resume on another dp degree.

    The dataset is split into ``num_shards`` logical shards (``data.num_shards``; by default one per
    data-parallel rank, which is then exactly the plain per-rank loader). Data-parallel rank r of dp reads
    the shards s with s % dp == r, one sample from each in turn; dp must divide num_shards (every rank then
    reads as many shards, and every shard advances at the same rate), so the global batch of a step holds
    the same samples whatever the degree, and a sample is never read twice or skipped. Batches carry
    ``sample_ids`` (shard * 2**36 + index in the shard) to prove it.

    Why the degree does not matter: number the samples of a run in reading order over all shards, 0, 1, 2, ...,
    sample i coming from shard i % num_shards. Rank r holds the shards s with s % dp == r, so it reads exactly
    the samples i with i % dp == r, in that order (its round robin over its shards); every rank reading as many
    samples a step, the global batch of a step is the next G samples of that order (G = dp x local_batch_size x
    gradient-accumulation batches), on any degree. After P samples in all, shard s has read P // num_shards
    samples, plus one when s < P % num_shards; a rank's next shard is then its first shard that has read the
    fewest, whatever the degree the first P were read on.

    ``state_dict()`` is JSON data: every shard's position. ``load_state_dict`` takes the positions of this
    rank's shards, wherever they were saved (engine/checkpoint/resume.py gathers them); saved on another degree, the
    rank's turn comes from those positions (``_turn_from_positions``).
    """

    def __init__(self, cfg: Config, tokenizer, dp_rank: int, dp_world_size: int, num_shards: int = -1,
                 fields: DataFields = TRAINING_FIELDS):
        if num_shards == -1:
            num_shards = cfg.data.num_shards if cfg.data.num_shards > 0 else dp_world_size
        check_shard_split(num_shards, dp_world_size, "the data is split into",
                          f"resume on a dp degree that divides {num_shards}, or start a run with a multiple of "
                          f"{dp_world_size} shards")
        self.num_shards = num_shards
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.batch_size = cfg.training.local_batch_size
        self.shard_ids = list(range(dp_rank, num_shards, dp_world_size))
        self.shards = {s: DataLoader(cfg, tokenizer, s, num_shards, fields) for s in self.shard_ids}
        self.turn = 0  # position in shard_ids of the shard that gives the next sample

    @property
    def source(self):
        """The data every shard reads (an engine.data.datasets.DataSource)."""
        return self.shards[self.shard_ids[0]].source

    @property
    def split_note(self) -> str:
        """How a stream's files are split over the shards, for the start-up log ("" when not streaming, or for the
        built-in dataset: one small file that every shard reads whole at no cost worth a line)."""
        if self.source.kind == "builtin":
            return ""
        return split_note(self.shards[self.shard_ids[0]].stream_files, self.num_shards, self.dp_world_size)

    @property
    def epoch(self) -> int:
        """The latest epoch any of this rank's shards reads (0 until one has been read through)."""
        return max(loader.epoch for loader in self.shards.values())

    def __iter__(self) -> "ShardedDataLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        tokens, doc_ids, ids = [], [], []
        for _ in range(self.batch_size):
            shard = self.shard_ids[self.turn]
            self.turn = (self.turn + 1) % len(self.shard_ids)
            loader = self.shards[shard]
            ids.append(shard * SAMPLE_ID_STRIDE + loader.samples_produced)
            t, d = loader.next_sample()
            tokens.append(t)
            doc_ids.append(d[:-1])
        tokens_t = torch.tensor(tokens, dtype=torch.long)
        return {
            "input_ids": tokens_t[:, :-1].contiguous(),
            "labels": tokens_t[:, 1:].contiguous(),
            "doc_ids": torch.tensor(doc_ids, dtype=torch.long),
            "sample_ids": torch.tensor(ids, dtype=torch.long),
        }

    def state_dict(self) -> dict:
        return {
            "version": SHARDED_STATE_VERSION,
            "num_shards": self.num_shards,
            "turn": self.turn,
            "shards": {str(s): loader.state_dict() for s, loader in self.shards.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Load ``state``: a ``state_dict()`` of this loader, or any dict whose "shards" holds (at least) the
        states of this rank's shards, saved on any dp degree with the same num_shards."""
        if not isinstance(state, dict) or state.get("version") != SHARDED_STATE_VERSION:
            raise ValueError("data loader state: unknown format")
        if int(state["num_shards"]) != self.num_shards:
            raise ValueError(
                f"data loader state: saved with {state['num_shards']} data shards, this loader has {self.num_shards}"
            )
        shards = state["shards"]
        missing = [s for s in self.shard_ids if str(s) not in shards]
        if missing:
            raise ValueError(f"data loader state: no position for data shards {missing}")
        for s in self.shard_ids:
            self.shards[s].load_state_dict(shards[str(s)])
        same_layout = sorted(int(s) for s in shards) == self.shard_ids
        if same_layout and "turn" in state:
            self.turn = int(state["turn"]) % len(self.shard_ids)
        else:  # saved on another dp degree: its turn was over other shards
            self.turn = self._turn_from_positions()

    def _turn_from_positions(self) -> int:
        """The position in shard_ids of this rank's first shard that has read the fewest samples: the shard the
        uninterrupted run reads next (see the class docstring), so the global batches go on exactly as they
        would have. (0 when all have read as many.)"""
        counts = [self.shards[s].samples_produced for s in self.shard_ids]
        return counts.index(min(counts))


def build_dataloader(cfg: Config, tokenizer, dp_rank: int = 0, dp_world_size: int = 1,
                     num_shards: int = -1, fields: DataFields = TRAINING_FIELDS) -> ShardedDataLoader:
    """This data-parallel rank's loader (``num_shards`` -1: data.num_shards, else one per dp rank); its errors
    name ``fields`` (engine.data.datasets.validation_data gives the validation data's)."""
    return ShardedDataLoader(cfg, tokenizer, dp_rank, dp_world_size, num_shards, fields)
