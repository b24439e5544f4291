"""Data: tokenizers, datasets (built-in and local files), packing, rank sharding, exact resume, errors."""

import collections
import gzip
import json
import os
import re
from pathlib import Path

import pytest
import torch

from engine.config import Config, ConfigError
from engine.data.loader import ShardedDataLoader
from engine.data import Tokenizer, build_dataloader, build_dataset, build_tokenizer, check_data_config
from engine.data.datasets import BUILTIN_DATASETS, DataError, resolve_source, validation_data
from engine.data.tokenizer import BUILTIN_TOKENIZER

ASSETS = os.path.dirname(BUILTIN_TOKENIZER)


@pytest.fixture(autouse=True)
def _isolated_hf(tmp_path_factory, monkeypatch):
    """Keep datasets' Arrow cache out of the user's home and never touch the network."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.getbasetemp() / "hf_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(Config())


def make_cfg(path="", seq_len=16, batch=2, streaming=True, text_field="text", **data):
    cfg = Config()
    cfg.data.path = str(path)
    cfg.data.streaming = streaming
    cfg.data.text_field = text_field
    for key, value in data.items():
        setattr(cfg.data, key, value)
    cfg.training.seq_len = seq_len
    cfg.training.local_batch_size = batch
    return cfg


def docs_of(n, words=5):
    """n distinct short documents of different lengths."""
    return [" ".join(f"doc{i} says word{j} to the reader." for j in range(1 + (i * 7) % words)) for i in range(n)]


def write_jsonl(path, docs, field="text"):
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({field: d, "id": len(d)}) + "\n")
    return str(path)


def write_parquet(path, docs, field="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: docs, "n": list(range(len(docs)))}), str(path))
    return str(path)


def take(loader, n):
    return [next(loader) for _ in range(n)]


def flat_tokens(batches):
    """The token stream the batches cover: each sample's inputs plus its last label."""
    out = []
    for b in batches:
        for inp, lab in zip(b["input_ids"], b["labels"]):
            out.extend(inp.tolist() + [lab[-1].item()])
    return out


def assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for a, b in zip(batches_a, batches_b):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


def split_docs(tokens, tok):
    """Cut a token stream at BOS into documents (BOS ... EOS), checking the framing."""
    docs, cur = [], None
    for t in tokens:
        if t == tok.bos_id:
            assert cur is None or cur[-1] == tok.eos_id
            if cur is not None:
                docs.append(cur)
            cur = [t]
        else:
            cur.append(t)
    return docs, cur


# ------------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------------


def test_builtin_tokenizer_round_trip_and_specials(tok):
    assert tok.vocab_size == 4096  # specials included: the BPE was trained to 4096 entries in all
    assert tok.bos_id == tok._tok.token_to_id("<|begin_of_text|>")
    assert tok.eos_id == tok._tok.token_to_id("<|end_of_text|>")
    assert tok.bos_id != tok.eos_id and max(tok.bos_id, tok.eos_id) < tok.vocab_size
    for text in ["Return the number of items in a container.", "  tabs\tand\nnewlines  ", "héllo wörld, 日本語 ✓", ""]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert tok.bos_id not in ids[1:-1] and tok.eos_id not in ids[1:-1]
        assert tok.decode(ids[1:-1]) == text
        assert tok.encode(text, bos=False, eos=False) == ids[1:-1]
        assert tok.decode(ids) == "<|begin_of_text|>" + text + "<|end_of_text|>"
        assert tok.decode(torch.tensor(ids), skip_special_tokens=True) == text
    assert len(tok.encode("the the the the", bos=False, eos=False)) <= 4
    assert tok.encode_batch(["a b", "c"]) == [tok.encode("a b"), tok.encode("c")]
    # Special tokens written in a document are text: they neither end it nor start another.
    text = "a literal <|end_of_text|> in a doc about <|begin_of_text|> tokens"
    for ids in (tok.encode(text), tok.encode_batch([text])[0]):
        assert ids.count(tok.bos_id) == 1 and ids.count(tok.eos_id) == 1
        assert tok.decode(ids[1:-1]) == text


def _variant(tmp_path, name, replace=None, post_bos=None, config=None):
    """A copy of the built-in tokenizer with its specials renamed, a BOS post-processor, a config."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    folder = tmp_path / name
    folder.mkdir()
    with open(BUILTIN_TOKENIZER) as f:
        text = f.read()
    for old, new in (replace or {}).items():
        text = text.replace(json.dumps(old), json.dumps(new))
    path = folder / "tokenizer.json"
    path.write_text(text)
    if post_bos:
        t = HFTokenizer.from_file(str(path))
        t.post_processor = TemplateProcessing(single=f"{post_bos} $A", special_tokens=[(post_bos, t.token_to_id(post_bos))])
        t.save(str(path))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def test_llama3_style_tokenizer_gets_one_bos(tmp_path):
    # Llama 3 names, and a post-processor that adds BOS by itself: Tessera must not add a second one.
    path = _variant(tmp_path, "llama3", post_bos="<|begin_of_text|>")
    t = Tokenizer(path)
    assert (t.bos_token, t.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    ids = t.encode("hello world")
    assert ids.count(t.bos_id) == 1 and ids[0] == t.bos_id and ids[-1] == t.eos_id


def test_truncation_and_padding_saved_in_the_file_are_off(tmp_path):
    """A tokenizer.json saved with truncation and padding on (as some published ones are) encodes every document
    whole and unpadded, alone or in a batch, as the same file without them does."""
    from tokenizers import Tokenizer as HFTokenizer

    path = _variant(tmp_path, "saved_on")
    t = HFTokenizer.from_file(path)
    t.enable_truncation(max_length=8)
    t.enable_padding(pad_id=2, pad_token="<|pad|>", length=64)
    t.save(path)
    text = "a document of many more than eight tokens, which packing must see whole " * 4
    plain, saved_on = Tokenizer(BUILTIN_TOKENIZER), Tokenizer(path)
    assert len(plain.encode(text)) > 40
    assert saved_on.encode(text) == plain.encode(text)
    assert saved_on.encode_batch([text, "short"]) == plain.encode_batch([text, "short"]) == \
        [plain.encode(text), plain.encode("short")]


def test_builtin_tokenizer_exported_to_transformers_adds_bos_as_training_does():
    """transformers' tokenizer from the built-in files puts BOS first, as every training document starts."""
    from transformers import AutoTokenizer

    text = "Return the number of items in a container."
    ours = Tokenizer(BUILTIN_TOKENIZER).encode(text, eos=False)
    assert AutoTokenizer.from_pretrained(os.path.dirname(BUILTIN_TOKENIZER))(text)["input_ids"] == ours


def test_special_tokens_from_config_and_known_names(tmp_path):
    # tokenizer_config.json wins, in both its string and {"content": ...} forms.
    path = _variant(tmp_path, "cfg", replace={"<|pad|>": "<|eot_id|>"},
                    config={"bos_token": {"content": "<|begin_of_text|>", "lstrip": False}, "eos_token": "<|eot_id|>"})
    t = Tokenizer(path)
    assert t.eos_token == "<|eot_id|>" and t.encode("x")[-1] == t._tok.token_to_id("<|eot_id|>")
    # Llama 2 style names.
    t = Tokenizer(_variant(tmp_path, "llama2", replace={"<|begin_of_text|>": "<s>", "<|end_of_text|>": "</s>"}))
    assert (t.bos_token, t.eos_token) == ("<s>", "</s>")
    # GPT-2 style: one token for both.
    t = Tokenizer(_variant(tmp_path, "gpt2", replace={"<|end_of_text|>": "<|endoftext|>", "<|begin_of_text|>": "<|unused|>"}))
    assert t.bos_id == t.eos_id == t._tok.token_to_id("<|endoftext|>")
    # Nothing known: an error naming the field.
    path = _variant(tmp_path, "none", replace={"<|begin_of_text|>": "<A>", "<|end_of_text|>": "<B>"})
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: no BOS or EOS token"):
        Tokenizer(path)


def test_tokenizer_config_with_a_null_bos_asks_for_eos_alone(tmp_path, tok):
    """bos_token null in tokenizer_config.json: no BOS (as Megatron-LM separates documents by EOS alone), even
    with a known BOS name in the vocabulary; the packed stream then holds each document and its EOS only."""
    path = _variant(tmp_path, "eos_only", config={"bos_token": None, "eos_token": "<|end_of_text|>"})
    t = Tokenizer(path)
    assert t.bos_token is None and t.bos_id is None
    assert t.encode("hello world") == tok.encode("hello world")[1:]
    assert t.encode_batch(["a b", "c"]) == [ids[1:] for ids in tok.encode_batch(["a b", "c"])]
    docs = [f"document {i} " * 3 for i in range(40)]
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    cfg = make_cfg(data, seq_len=16, batch=2, streaming=True)
    loader = build_dataloader(cfg, t, 0, 1)
    batch = next(loader)
    stream = [i for d in docs for i in t.encode(d)]
    assert batch["input_ids"][0].tolist() == stream[:16] and tok.bos_id not in batch["input_ids"].flatten().tolist()
    # Null EOS is still an error: documents need an end.
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: no EOS token found"):
        Tokenizer(_variant(tmp_path, "no_eos", replace={"<|end_of_text|>": "<B>"}, config={"bos_token": None}))


def test_build_tokenizer_sources_and_errors(tmp_path):
    cfg = Config()
    assert build_tokenizer(cfg).path == BUILTIN_TOKENIZER
    cfg.model.hf_assets_path = os.path.dirname(_variant(tmp_path, "hf"))
    assert build_tokenizer(cfg).path == os.path.join(cfg.model.hf_assets_path, "tokenizer.json")
    cfg.data.tokenizer = BUILTIN_TOKENIZER  # data.tokenizer wins over model.hf_assets_path
    assert build_tokenizer(cfg).path == BUILTIN_TOKENIZER
    cfg.data.tokenizer = os.path.dirname(BUILTIN_TOKENIZER)  # or a folder holding tokenizer.json
    assert build_tokenizer(cfg).path == os.path.join(os.path.dirname(BUILTIN_TOKENIZER), "tokenizer.json")
    from engine.config.validation import validate

    validate(cfg)  # the config's own check takes the folder too (it asked for a file)
    cfg.data.tokenizer = str(tmp_path)  # a folder without one
    with pytest.raises(ConfigError, match=rf"^data\.tokenizer: tokenizer file '{tmp_path}/tokenizer\.json' not"):
        build_tokenizer(cfg)

    cfg = Config()
    cfg.data.tokenizer = str(tmp_path / "nope" / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: .*not found"):
        build_tokenizer(cfg)
    cfg = Config()
    cfg.model.hf_assets_path = str(tmp_path)  # a folder without tokenizer.json
    with pytest.raises(ConfigError, match=r"^model\.hf_assets_path: .*not found"):
        build_tokenizer(cfg)
    bad = tmp_path / "corrupt.json"
    bad.write_text('{"version": "1.0", "model": ')
    cfg = Config()
    cfg.data.tokenizer = str(bad)
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: .*not a valid"):
        build_tokenizer(cfg)


# ------------------------------------------------------------------------------------------------------
# Packing
# ------------------------------------------------------------------------------------------------------


def test_packing_streaming_is_the_exact_document_stream(tmp_path, tok):
    docs = docs_of(7)
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    cfg = make_cfg(path, seq_len=16, batch=3, streaming=True)
    loader = build_dataloader(cfg, tok, 0, 1)
    assert isinstance(loader, ShardedDataLoader) and iter(loader) is loader
    batches = take(loader, 12)
    for b in batches:
        for key in ("input_ids", "labels", "doc_ids"):
            assert b[key].shape == (3, 16) and b[key].dtype == torch.long and b[key].device.type == "cpu"
        assert torch.equal(b["labels"][:, :-1], b["input_ids"][:, 1:])
        for inp, ids in zip(b["input_ids"], b["doc_ids"]):
            assert ids[0] == 0
            for i in range(1, len(inp)):
                assert ids[i] == ids[i - 1] + int(inp[i] == tok.bos_id)
    # Streaming reads the one file in order, epoch after epoch: the samples are the stream, cut.
    epoch = [t for d in docs for t in tok.encode(d)]
    stream = flat_tokens(batches)
    expected = (epoch * (len(stream) // len(epoch) + 1))[: len(stream)]
    assert len(stream) > 2 * len(epoch)  # crosses two epoch boundaries
    assert stream == expected
    assert loader.state_dict()["shards"]["0"]["epoch"] >= 2


def test_packing_map_style_covers_each_epoch_once(tmp_path, tok):
    docs = docs_of(9)
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    cfg = make_cfg(path, seq_len=32, batch=2, streaming=False)
    loader = build_dataloader(cfg, tok, 0, 1)
    epoch_len = sum(len(tok.encode(d)) for d in docs)
    stream = flat_tokens(take(loader, -(-3 * epoch_len // (2 * 33))))
    got, _ = split_docs(stream, tok)
    texts = [tok.decode(d[1:-1]) for d in got]
    assert collections.Counter(texts[:9]) == collections.Counter(docs)  # epoch 0: each document once
    assert collections.Counter(texts[9:18]) == collections.Counter(docs)  # epoch 1 too
    assert texts[:9] != texts[9:18]  # ... in a fresh seeded order


# ------------------------------------------------------------------------------------------------------
# Resume
# ------------------------------------------------------------------------------------------------------


def _resume_case(cfg, tok, ks, n_after, rank=0, world=1):
    """Resume after k batches for each k; returns the uninterrupted batches and the epoch of each state."""
    full = take(build_dataloader(cfg, tok, rank, world), max(ks) + n_after)
    epochs = []
    for k in ks:
        loader = build_dataloader(cfg, tok, rank, world)
        take(loader, k)
        state = json.loads(json.dumps(loader.state_dict()))  # checkpoints hold plain JSON data only
        epochs.append(state["shards"][str(rank)]["epoch"])
        fresh = build_dataloader(cfg, tok, rank, world)
        fresh.load_state_dict(state)
        assert_same(take(fresh, n_after), full[k : k + n_after])
    return full, epochs


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "map"])
def test_resume_local_is_exact_across_epochs(tmp_path, tok, fmt, streaming):
    docs = docs_of(6)
    path = (write_jsonl if fmt == "jsonl" else write_parquet)(tmp_path / f"d.{fmt}", docs)
    cfg = make_cfg(path, seq_len=16, batch=2, streaming=streaming)
    epoch_tokens = sum(len(tok.encode(d)) for d in docs)
    batches_per_epoch = epoch_tokens / (2 * 17)
    assert batches_per_epoch > 2
    # k = 0, inside epoch 0, right around the first epoch boundary, and in epoch 2.
    ks = [0, 1, int(batches_per_epoch), int(batches_per_epoch) + 1, int(3 * batches_per_epoch)]
    _, epochs = _resume_case(cfg, tok, ks, n_after=5)
    assert epochs[:3] == [0, 0, 0] and epochs[3] == 1 and epochs[4] >= 2  # the 5 batches after ks[2] cross into epoch 1


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "map"])
def test_resume_when_a_sample_ends_exactly_at_the_end_of_an_epoch(tmp_path, tok, streaming):
    doc = "A single document that is one whole sample."
    path = write_jsonl(tmp_path / "one.jsonl", [doc])
    cfg = make_cfg(path, seq_len=len(tok.encode(doc)) - 1, batch=1, streaming=streaming)
    full, epochs = _resume_case(cfg, tok, ks=[1, 2, 3], n_after=2)
    assert epochs == [0, 1, 2]  # each state points just past the last (only) document of its epoch
    assert all(torch.equal(b["input_ids"], full[0]["input_ids"]) for b in full)


def test_resume_multi_file_folder_two_ranks(tmp_path, tok):
    folder = tmp_path / "shards"
    folder.mkdir()
    all_docs = docs_of(16)
    for i in range(4):  # 4 files, 2 ranks: datasets assigns whole files to ranks
        write_jsonl(folder / f"part-{i:02d}.jsonl", all_docs[4 * i : 4 * i + 4])
    (folder / "notes.md").write_text("not data")
    (folder / "z_readme.txt").write_text("a supported format, but not the first file's: not read")
    cfg = make_cfg(folder, seq_len=16, batch=2, streaming=True)
    source = resolve_source(cfg)
    assert (source.builder, len(source.files)) == ("json", 4)
    assert [os.path.basename(p) for p in source.ignored] == ["z_readme.txt"]
    # A small text file that sorts first is not taken for the data: the format holding most bytes is.
    (folder / "A_README.txt").write_text("how these shards were made")
    source = resolve_source(cfg)
    assert (source.builder, len(source.files)) == ("json", 4)
    assert [os.path.basename(p) for p in source.ignored] == ["A_README.txt", "z_readme.txt"]
    (folder / "A_README.txt").unlink()
    for rank in (0, 1):
        _, epochs = _resume_case(cfg, tok, ks=[2, 7, 11], n_after=4, rank=rank, world=2)
        assert epochs[0] == 0 and epochs[-1] >= 1


def test_load_state_into_a_used_loader(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", docs_of(6))
    cfg = make_cfg(path, seq_len=16, batch=2, streaming=True)
    loader = build_dataloader(cfg, tok, 0, 1)
    start = loader.state_dict()
    first = take(loader, 3)
    middle = loader.state_dict()
    after = take(loader, 6)
    loader.load_state_dict(middle)
    assert_same(take(loader, 6), after)
    loader.load_state_dict(start)  # back to the very beginning, after a same-epoch state was loaded
    assert_same(take(loader, 3), first)


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "map"])
def test_resume_builtin_corpus(tok, streaming):
    cfg = make_cfg("", seq_len=64, batch=2, streaming=streaming)
    assert cfg.data.dataset == "tessera_docs"
    full, _ = _resume_case(cfg, tok, ks=[3, 10], n_after=3)
    text = tok.decode(full[0]["input_ids"][0])
    assert text.startswith("<|begin_of_text|>")


def test_state_dict_layout_and_rank_mismatch(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", docs_of(8))
    cfg = make_cfg(path, seq_len=16, batch=2, streaming=True)
    loader = build_dataloader(cfg, tok, 1, 2)
    take(loader, 3)
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state
    shard = state["shards"]["1"]
    assert state["num_shards"] == 2 and list(state["shards"]) == ["1"]
    assert shard["dp_rank"] == 1 and shard["dp_world_size"] == 2 and shard["docs_consumed"] > 0
    other = build_dataloader(cfg, tok, 0, 2)
    with pytest.raises(ValueError, match=r"no position for data shards \[0\]"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="saved with 2 data shards"):
        build_dataloader(cfg, tok, 0, 2, num_shards=4).load_state_dict(state)
    with pytest.raises(ValueError, match="streaming"):
        build_dataloader(make_cfg(path, seq_len=16, batch=2, streaming=False), tok, 1, 2).load_state_dict(state)


def _ids(batches) -> list[int]:
    return [int(i) for b in batches for i in b["sample_ids"]]


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "map"])
def test_resume_on_another_dp_degree_neither_repeats_nor_skips(tmp_path, tok, streaming):
    """4 logical shards saved by 4 dp ranks, resumed by 2 ranks and 1 rank: each step's global batch holds the
    samples of the uninterrupted run, so no sample repeats or is skipped; 3 ranks are refused."""
    path = write_jsonl(tmp_path / "d.jsonl", docs_of(40))
    cfg = make_cfg(path, seq_len=16, batch=2, streaming=streaming)
    global_batch, k, after = 8, 3, 4  # samples per step, steps before the save, steps after it

    def run(dp, steps, states=None):
        """Per step: the sorted sample ids of the global batch; and the loaders' states."""
        loaders = [build_dataloader(cfg, tok, r, dp, num_shards=4) for r in range(dp)]
        if states is not None:
            merged = {"version": 1, "num_shards": 4, "turn": 0,
                      "shards": {s: v for st in states for s, v in st["shards"].items()}}
            for loader in loaders:
                loader.load_state_dict(json.loads(json.dumps(merged)))
        assert all(loader.batch_size * dp == global_batch for loader in loaders)
        seen = [sorted(_ids(next(loader) for loader in loaders)) for _ in range(steps)]
        return seen, [loader.state_dict() for loader in loaders]

    cfg.training.local_batch_size = 2
    whole, _ = run(4, k + after)
    before, states = run(4, k)
    assert before == whole[:k]
    for dp in (2, 1):
        cfg.training.local_batch_size = global_batch // dp
        resumed, _ = run(dp, after, states)
        assert resumed == whole[k:], dp
    # 3 ranks do not divide 4 shards: one rank would read its shard twice as fast as another rank its two.
    with pytest.raises(ValueError, match=r"^data\.num_shards: .*4 shards.* 3 data-parallel ranks"):
        build_dataloader(cfg, tok, 0, 3, num_shards=4)
    with pytest.raises(ValueError, match="data.num_shards"):
        build_dataloader(cfg, tok, 0, 8, num_shards=4)


def _steps_by_rank(cfg, tok, dp, num_shards, steps, states=None):
    """``steps`` steps of ``dp`` ranks' loaders (resumed from the saved ``states`` of any degree, gathered as
    engine/checkpoint/resume.py's load_data_position does): per step, each rank's samples in its order as (sample id,
    tokens); and the ranks' states after them."""
    loaders = [build_dataloader(cfg, tok, r, dp, num_shards=num_shards) for r in range(dp)]
    if states is not None:
        old_dp = len(states)
        for loader in loaders:
            state = {"version": 1, "num_shards": num_shards, "shards": {}}
            for old_rank in sorted({s % old_dp for s in loader.shard_ids}):
                state["shards"].update(states[old_rank]["shards"])
                if old_dp == dp:
                    state["turn"] = states[old_rank]["turn"]
            loader.load_state_dict(json.loads(json.dumps(state)))
    seen = []
    for _ in range(steps):
        batches = [next(loader) for loader in loaders]
        seen.append([[(int(i), t.tolist()) for i, t in zip(b["sample_ids"], b["input_ids"])] for b in batches])
    return seen, [loader.state_dict() for loader in loaders]


@pytest.mark.parametrize("num_shards,dp_before,dp_after,global_batch", [
    (4, 2, 1, 2),  # the user's case: 1 sample a step from 2 shards per rank, then 2 from 4
    (4, 1, 2, 2),
    (6, 3, 1, 3),
    (6, 2, 1, 4),
    (8, 4, 2, 4),
    (8, 2, 4, 4),
    (12, 2, 3, 6),
])
def test_resume_on_another_dp_degree_when_the_batch_is_not_a_multiple_of_the_shards_per_rank(
        tmp_path, tok, num_shards, dp_before, dp_after, global_batch):
    """A local batch that is not a multiple of a rank's shards leaves some shards a sample ahead of the others
    at a save. Resumed on another degree, every rank goes on from the right shard: the next global batches are
    exactly the uninterrupted run's on the new degree (each rank's samples, in order, with their tokens), so the
    same samples as the run on the old degree would have read."""
    path = write_jsonl(tmp_path / "d.jsonl", docs_of(48))
    cfg = make_cfg(path, seq_len=8, batch=global_batch // dp_before, streaming=False)
    after = 4  # steps after the save
    whole_before, _ = _steps_by_rank(cfg, tok, dp_before, num_shards, 3 + after)
    saved = {k: _steps_by_rank(cfg, tok, dp_before, num_shards, k)[1] for k in (1, 3)}  # saves after 1 and 3 steps
    cfg.training.local_batch_size = global_batch // dp_after
    whole_after, _ = _steps_by_rank(cfg, tok, dp_after, num_shards, 3 + after)
    for k, states in saved.items():
        if k == 1:  # some shards a sample ahead of others (after 3 steps too, but for (6, 2, 1, 4))
            assert all(len({st["samples"] for st in state["shards"].values()}) == 2 for state in states)
        resumed, _ = _steps_by_rank(cfg, tok, dp_after, num_shards, after, states)
        assert resumed == whole_after[k:k + after], k
        # The global batch of each step holds the same samples on either degree.
        assert ([sorted(s for rank in step for s in rank) for step in resumed]
                == [sorted(s for rank in step for s in rank) for step in whole_before[k:k + after]]), k


# ------------------------------------------------------------------------------------------------------
# Rank sharding
# ------------------------------------------------------------------------------------------------------


def _texts(ds):
    return [ex["text"] for ex in ds]


@pytest.mark.parametrize("layout", ["one-file", "four-files"])
@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "map"])
def test_two_ranks_see_disjoint_documents_covering_all(tmp_path, streaming, layout):
    docs = docs_of(40)
    if layout == "one-file":
        path = write_jsonl(tmp_path / "d.jsonl", docs)
    else:
        path = tmp_path / "parts"
        path.mkdir()
        for i in range(4):
            write_jsonl(path / f"{i}.jsonl", docs[10 * i : 10 * i + 10])
    cfg = make_cfg(path, streaming=streaming)
    seen = [_texts(build_dataset(cfg, rank, 2)) for rank in (0, 1)]
    assert seen[0] and seen[1]
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(docs)


def test_the_log_says_how_a_stream_splits_over_the_data_shards(tmp_path, tok):
    """Four files split over 2 or 4 shards as whole files; over 3 every shard reads all four (datasets' fallback),
    which the start-up line says with the fix; a map-style dataset is split by rows and says nothing, nor does the
    built-in corpus."""
    path = tmp_path / "parts"
    path.mkdir()
    for i in range(4):
        write_jsonl(path / f"{i}.jsonl", docs_of(30)[6 * i: 6 * i + 6])
    cfg = make_cfg(path, seq_len=16, batch=1, streaming=True)
    assert build_dataloader(cfg, tok, 0, 1).split_note == ""
    assert build_dataloader(cfg, tok, 1, 2).split_note == "; 2 data shards of 2 whole file(s) each"
    assert build_dataloader(cfg, tok, 0, 1, num_shards=4).split_note == "; 4 data shards of 1 whole file(s) each"
    note = build_dataloader(cfg, tok, 2, 3).split_note
    assert note == ("; its 4 file(s) do not split evenly over 3 data shards: every shard reads all of them and keeps "
                    "1 document in 3 (3x the reading; for large data, split it into a multiple of 3 files, or set "
                    "data.streaming = false)"), note
    note = build_dataloader(cfg, tok, 1, 2, num_shards=8).split_note  # 2 ranks: 2 or 4 shards would split by file
    assert note.endswith("(8x the reading; for large data, split it into a multiple of 8 files, or set data.streaming "
                         "= false; or, if no resume is to read it on another dp degree, set data.num_shards to a "
                         "multiple of 2 (the dp degree) that divides 4)"), note
    assert build_dataloader(make_cfg(path, seq_len=16, batch=1, streaming=False), tok, 1, 3).split_note == ""
    # The built-in corpus is one small file: every shard reading it whole is not worth a line on every run.
    assert build_dataloader(make_cfg(seq_len=16, batch=1), tok, 1, 2).split_note == ""


def test_two_rank_loaders_differ(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", docs_of(20))
    cfg = make_cfg(path, seq_len=16, batch=2, streaming=True)
    a = next(build_dataloader(cfg, tok, 0, 2))
    b = next(build_dataloader(cfg, tok, 1, 2))
    assert not torch.equal(a["input_ids"], b["input_ids"])


# ------------------------------------------------------------------------------------------------------
# Other sources and bad inputs
# ------------------------------------------------------------------------------------------------------


def test_txt_files_are_split_into_paragraph_documents(tmp_path, tok):
    path = tmp_path / "book.txt"
    path.write_text("First paragraph,\nstill the first.\n\nSecond paragraph.\n\n\nThird one.\n")
    texts = [t.strip() for t in _texts(build_dataset(make_cfg(path)))]
    assert texts == ["First paragraph,\nstill the first.", "Second paragraph.", "Third one."]
    # A gzip'd jsonl works as well (the built-in dataset is one).
    gz = tmp_path / "d.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"text": "zipped document"}) + "\n")
    assert _texts(build_dataset(make_cfg(gz, streaming=False))) == ["zipped document"]


def test_bad_data_inputs_name_the_field(tmp_path, tok):
    def fails(cfg, field, pattern=""):
        with pytest.raises(ConfigError, match=rf"^{field.replace('.', '[.]')}: .*{pattern}") as info:
            check_data_config(cfg)
            build_dataloader(cfg, tok, 0, 1)
        assert "\n" not in str(info.value)
        return str(info.value)

    fails(make_cfg(tmp_path / "missing.jsonl"), "data.path", "not found")
    csv = tmp_path / "d.csv"
    csv.write_text("text\nhello\n")
    fails(make_cfg(csv), "data.path", "unsupported extension")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    fails(make_cfg(empty_dir), "data.path", "no json")

    jsonl = write_jsonl(tmp_path / "d.jsonl", docs_of(3), field="body")
    msg = fails(make_cfg(jsonl), "data.text_field", "'body'")
    assert "'id'" in msg  # lists the columns found
    parquet = write_parquet(tmp_path / "d.parquet", docs_of(3), field="body")
    fails(make_cfg(parquet, streaming=False), "data.text_field", "'body'")
    fails(make_cfg(write_jsonl(tmp_path / "ok.jsonl", docs_of(3)), split="validation"), "data.split", "train")
    fails(make_cfg("", tokenizer=str(tmp_path / "no_tokenizer.json")), "data.tokenizer", "not found")

    blank = tmp_path / "blank.jsonl"
    blank.write_text("")
    fails(make_cfg(blank), "data.path", "empty")
    nulls = tmp_path / "nulls.jsonl"
    nulls.write_text('{"text": null}\n{"text": ""}\n')
    for streaming in (True, False):
        cfg = make_cfg(nulls, streaming=streaming)
        with pytest.raises(ConfigError, match=r"^data\.path: .*no non-empty"):
            next(build_dataloader(cfg, tok, 0, 1))
    one = write_jsonl(tmp_path / "one.jsonl", docs_of(1))
    with pytest.raises(ConfigError, match=r"^data\.path: .*rank 1"):
        build_dataset(make_cfg(one, streaming=False), 1, 2)


def test_a_bad_file_among_several_is_named(tmp_path, tok):
    """An empty file, a parquet file that is not one (cut short) or has no rows, in a folder: one line naming the
    file, found by the cheap checks (file sizes, parquet footers, the first file's first lines), whether streaming
    or not. A folder whose files hold no records at all says so; a malformed record found by the full read names
    its file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def fails(path, pattern, streaming=(True, False)):
        for s in streaming:
            cfg = make_cfg(path, streaming=s)
            with pytest.raises(ConfigError, match=rf"^data\.path: {pattern}") as info:
                check_data_config(cfg)
                build_dataloader(cfg, tok, 0, 1)
            assert "\n" not in str(info.value)

    def folder(name, files):
        """A folder of ``files`` (name -> writer); and its path as a regular expression."""
        path = tmp_path / name
        path.mkdir()
        for file, write in files.items():
            write(path / file)
        return path, re.escape(str(path))

    def good_jsonl(p):
        write_jsonl(p, docs_of(4))

    def empty(p):
        p.write_bytes(b"")

    def good_parquet(p):
        write_parquet(p, docs_of(4))

    def cut_parquet(p):
        write_parquet(p, docs_of(4))
        p.write_bytes(p.read_bytes()[:100])

    def no_rows(p):
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), str(p))

    def gz(text):
        def write(p):
            with gzip.open(p, "wt") as f:
                f.write(text)
        return write

    path, rx = folder("two_empty", {"a.jsonl": empty, "b.jsonl": empty})
    fails(path, rf"'{rx}/a\.jsonl' is empty; remove it from '{rx}'$")
    path, rx = folder("one_empty", {"a.jsonl": good_jsonl, "b.jsonl": empty})
    fails(path, rf"'{rx}/b\.jsonl' is empty; remove it from '{rx}'$")
    path, rx = folder("cut", {"a.parquet": good_parquet, "b.parquet": cut_parquet})
    fails(path, rf"'{rx}/b\.parquet' is not a valid parquet file \(ArrowInvalid: .*magic bytes.*\); remove it from")
    path, rx = folder("no_rows", {"a.parquet": good_parquet, "b.parquet": no_rows})
    fails(path, rf"'{rx}/b\.parquet' has no documents \(0 rows\); remove it from '{rx}'$")
    path, rx = folder("one_file", {"no_rows.parquet": no_rows})
    fails(path / "no_rows.parquet", rf"'{rx}/no_rows\.parquet' has no documents \(0 rows\)$")

    # More than 0 bytes but no records: blank lines, an empty compressed file (in the first file, whose records
    # give the json reader its columns: it failed to cast the next files'), or every file an empty JSON array.
    path, rx = folder("blank_first", {"a.jsonl": lambda p: p.write_text("\n\n  \n"), "b.jsonl": good_jsonl})
    fails(path, rf"'{rx}/a\.jsonl' has no documents \(nothing but blank lines\); remove it from '{rx}'$")
    path, rx = folder("gz", {"a.jsonl.gz": gz(""), "b.jsonl.gz": gz(json.dumps({"text": "a document"}) + "\n")})
    fails(path, rf"'{rx}/a\.jsonl\.gz' has no documents \(nothing but blank lines\); remove it from '{rx}'$")
    path, rx = folder("arrays", {"a.json": lambda p: p.write_text("[]"), "b.json": lambda p: p.write_text("[]\n")})
    fails(path, rf"'{rx}' \(2 json files\) has no documents$")
    # A malformed record in the second file: the full read's error names that file.
    path, rx = folder("bad_record", {"a.jsonl": good_jsonl,
                                     "b.jsonl": lambda p: p.write_text('{"text": "fine"}\n{"text": broken\n')})
    fails(path, rf"cannot load .*: Failed to load JSON from file '{rx}/b\.jsonl' with error ArrowInvalid: ",
          streaming=[False])


def test_too_many_data_shards_for_the_data_name_data_num_shards(tmp_path, tok):
    """20 documents split into 64 shards by data.num_shards: the error names data.num_shards and speaks of shards;
    split by 64 data-parallel ranks, it names data.path and speaks of ranks."""
    path = write_jsonl(tmp_path / "d.jsonl", docs_of(20))
    with pytest.raises(ConfigError, match=r"^data\.num_shards: .* has 20 documents, too few for 64 data shards "
                                          r"\(shards 20 to 63 would get none\); set data\.num_shards to 20 or fewer"):
        build_dataloader(make_cfg(path, streaming=False, num_shards=64), tok, 0, 1)
    with pytest.raises(ConfigError, match=r"^data\.num_shards: .* has no documents for data shard 20 of 64; set "
                                          r"data\.num_shards lower"):
        build_dataloader(make_cfg(path, streaming=True, num_shards=64), tok, 0, 1)
    with pytest.raises(ConfigError, match=r"^data\.path: .* has 20 documents, too few for 64 data-parallel ranks "
                                          r"\(ranks 20 to 63 would get none\)"):
        build_dataloader(make_cfg(path, streaming=False), tok, 0, 64)
    with pytest.raises(ConfigError, match=r"^data\.path: .* has no documents for data-parallel rank 20 of 64$"):
        build_dataloader(make_cfg(path, streaming=True), tok, 20, 64)


def test_bad_validation_data_names_the_validation_field(tmp_path, tok):
    """validation.enable: the validation data is checked with the training data, and its errors name the
    validation.* field that chose it (the data.* one it takes otherwise)."""
    good = write_jsonl(tmp_path / "good.jsonl", docs_of(3))
    body = write_jsonl(tmp_path / "body.jsonl", docs_of(3), field="body")

    def fails(field, pattern, **validation):
        cfg = make_cfg(good)
        cfg.validation.enable = True
        for key, value in validation.items():
            setattr(cfg.validation, key, value)
        with pytest.raises(ConfigError, match=rf"^{field.replace('.', '[.]')}: .*{pattern}"):
            check_data_config(cfg)

    fails("validation.path", "'text' is not a column .*'body'", path=body)
    csv = tmp_path / "d.csv"
    csv.write_text("text\nhello\n")
    fails("validation.path", "unsupported extension", path=str(csv))
    fails("validation.split", "single 'train' split", split="validation")
    fails("validation.dataset", "did you mean 'tessera_docs'", dataset="tessera_doc")
    fails("validation.text_field", "'title' is not a column .*'body'", path=body, text_field="title")
    cfg = make_cfg(good)
    cfg.validation.enable, cfg.validation.path, cfg.validation.text_field = True, body, "body"  # its own column
    check_data_config(cfg)
    cfg = make_cfg(good)
    cfg.validation.path = body  # validation off: not read
    check_data_config(cfg)


def test_mistyped_builtin_dataset_fails_at_once(tok):
    """A name close to a built-in dataset's is a typo, not a Hub dataset (those are owner/name): refused by the
    cheap check, with the suggestion, instead of a Hub lookup."""
    with pytest.raises(ConfigError, match=r"^data\.dataset: 'tessera_doc' is not a built-in dataset \(did you mean "
                                          r"'tessera_docs'\?\)"):
        check_data_config(make_cfg("", dataset="tessera_doc"))
    assert resolve_source(make_cfg("", dataset="someone/tessera_doc")).kind == "hub"


def test_hub_retries_are_not_logged_while_loading():
    """huggingface_hub logs a warning for every retry of an unreachable Hub (ten lines over half a minute): silent
    while Tessera loads, so that its error stays one line."""
    import logging

    from engine.data.datasets import _datasets_quiet

    retries = logging.getLogger("huggingface_hub.utils._http")
    with _datasets_quiet():
        assert not retries.isEnabledFor(logging.WARNING)
    assert retries.isEnabledFor(logging.WARNING)


def test_bad_record_found_mid_run_is_a_data_error(tmp_path, tok):
    """A record of the wrong type after the first ones (the start-up check reads the first 64, in the streaming
    order) stops the loader with a DataError (the trainer's one-line mid-run error) naming the field and the
    record."""
    def with_bad_record(name: str, count: int, bad_at: int, bad_text) -> Path:
        """``count`` documents, the one at ``bad_at`` with ``bad_text`` for its text."""
        path = tmp_path / name
        path.write_text("".join(json.dumps({"text": f"document {i} " * 10 if i != bad_at else bad_text}) + "\n"
                                for i in range(count)))
        return path

    # Streaming: the record's place in the shard's stream. Map-style: its row in the data (the epoch's order is
    # shuffled); both after the 64 read at start-up.
    for path, streaming, message in (
        (with_bad_record("late.jsonl", 101, 100, ["a", "list"]), True,
         r"^data\.text_field: column 'text' holds list values.*\(record 100 of shard 0 of 1, epoch 0\); fix or "
         r"remove the bad record, then resume"),
        (with_bad_record("late_map.jsonl", 300, 150, 7), False,
         r"^data\.text_field: column 'text' holds int values.*\(row 150 of shard 0 of 1\); fix"),
    ):
        loader = build_dataloader(make_cfg(path, seq_len=16, batch=2, streaming=streaming), tok, 0, 1)
        with pytest.raises(DataError, match=message):
            for _ in range(10000):
                next(loader)
    # Among the first records (read at start-up): a ConfigError saying which.
    early = with_bad_record("early.jsonl", 9, 2, 7)
    with pytest.raises(ConfigError, match=r"^data\.text_field: column 'text' holds int values.*\(record 2 of shard 0 "
                                          r"of 1, epoch 0\); fix or remove the bad record$"):
        build_dataloader(make_cfg(early, seq_len=16, batch=2, streaming=True), tok, 0, 1)


def test_resumed_position_past_a_documents_end_is_a_data_error(tmp_path, tok):
    """A checkpoint's token offset beyond its document (the data or tokenizer changed): one line naming
    data.tokenizer, not a ragged batch."""
    path = write_jsonl(tmp_path / "d.jsonl", docs_of(20))
    cfg = make_cfg(path, seq_len=16, batch=2, streaming=False)
    state = build_dataloader(cfg, tok, 0, 1).state_dict()
    state["shards"]["0"]["token_offset"] = 10_000
    loader = build_dataloader(cfg, tok, 0, 1)
    loader.load_state_dict(state)
    with pytest.raises(DataError, match=r"^data\.tokenizer: the checkpoint's data position is token 10000"):
        next(loader)


def test_resumed_position_past_the_end_of_data_that_shrank_names_the_field(tmp_path, tok):
    """A map-style position past the records a shard now holds (the data lost documents since the checkpoint): a
    ConfigError naming data.path and the way out, when the position is loaded (a set-up check of the trainer)."""
    path = write_jsonl(tmp_path / "d.jsonl", docs_of(20))
    cfg = make_cfg(path, seq_len=16, batch=2, streaming=False)
    loader = build_dataloader(cfg, tok, 0, 1)
    take(loader, 6)
    state = loader.state_dict()
    read = state["shards"]["0"]["docs_in_epoch"]
    assert read > 3, state
    write_jsonl(tmp_path / "d.jsonl", docs_of(3))
    with pytest.raises(ConfigError, match=rf"^data\.path: the checkpoint's data position is record {read} of shard 0 "
                                          r"of 1 \(epoch 0\), past the 3 records that shard of .* now holds: .*; "
                                          r"resume with the same data, or set checkpoint\.exclude_from_loading"):
        build_dataloader(cfg, tok, 0, 1).load_state_dict(state)


def test_unreachable_hub_dataset_is_one_line(tok):
    cfg = make_cfg("", dataset="no-such-user/no-such-dataset")  # HF_HUB_OFFLINE is on in these tests
    check_data_config(cfg)  # nothing cheap to check
    with pytest.raises(ConfigError, match=r"^data\.dataset: cannot load 'no-such-user/no-such-dataset'") as info:
        build_dataloader(cfg, tok, 0, 1)
    assert "\n" not in str(info.value)
    assert str(info.value).endswith("(hf download --repo-type dataset no-such-user/no-such-dataset --local-dir DIR) "
                                    "and give them with data.path")
    # The validation data's error names its own fields, the advice too.
    cfg = make_cfg("")
    cfg.validation.dataset = "no-such-user/other"
    vcfg, fields = validation_data(cfg)
    with pytest.raises(ConfigError, match=r"^validation\.dataset: cannot load 'no-such-user/other'") as info:
        build_dataloader(vcfg, tok, 0, 1, fields=fields)
    assert str(info.value).endswith("give them with validation.path")
    # Another Hub dataset reads its own configuration, not the training data's; the same one takes data's.
    cfg = make_cfg("", dataset="allenai/c4")
    cfg.data.dataset_config = "en"
    assert validation_data(cfg)[0].data.dataset_config == "en"
    cfg.validation.dataset = "allenai/c4"  # the same dataset, named: its configuration too
    assert validation_data(cfg)[0].data.dataset_config == "en"
    cfg.validation.dataset = "Salesforce/wikitext"
    assert validation_data(cfg)[0].data.dataset_config == ""
    cfg.validation.dataset_config = "wikitext-2-raw-v1"
    assert validation_data(cfg)[0].data.dataset_config == "wikitext-2-raw-v1"
    with pytest.raises(ConfigError, match=r"^data\.dataset: .*data\.path"):
        check_data_config(make_cfg("", dataset="my_docs.jsonl"))


# ------------------------------------------------------------------------------------------------------
# The built-in corpus
# ------------------------------------------------------------------------------------------------------


def test_builtin_corpus_is_english_prose(tok):
    path = BUILTIN_DATASETS["tessera_docs"]
    assert os.path.getsize(path) <= 4 * 2**20
    with gzip.open(path, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    assert sum(len(t.encode("utf-8")) for t in texts) >= 3_000_000
    assert len(texts) == len(set(texts)) and min(len(t) for t in texts) >= 200
    counts = collections.Counter()
    for ids in tok.encode_batch(texts[:400], bos=False, eos=False):
        counts.update(ids)
    top = {tok.decode([i]).strip().lower() for i, _ in counts.most_common(15)}
    assert {"the", "of", "to"} <= top, top
    with open(os.path.join(ASSETS, "SOURCE.md")) as f:
        source = f.read()
    assert "PSF" in source and "Python Software Foundation" in source and "CPython 3." in source
    with open(os.path.join(ASSETS, "tokenizer_config.json")) as f:
        config = json.load(f)
    assert (config["bos_token"], config["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")
