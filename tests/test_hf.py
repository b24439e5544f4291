"""Hugging Face interop: the Llama 3 state-dict adapter and engine.hf's export/load, checked against transformers'
LlamaForCausalLM on the same weights (CPU, fp32)."""

import dataclasses
import json
import os
import shutil
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.data.tokenizer import BUILTIN_TOKENIZER, Tokenizer
from engine.hf import INDEX_FILE, SINGLE_FILE, export_hf, load_hf
from models.registry import get_model_spec
from models.llama3 import Llama3HFAdapter, Transformer, TransformerModelArgs, llama3_flavors
from models.llama3.model import ffn_hidden_dim

transformers = pytest.importorskip("transformers")

FIELD = "checkpoint.initial_load_path"
TOLERANCE = 1e-4

DEBUG = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=2048)
# The 8B structure (head_dim 128, n_kv_heads = n_heads / 4, ffn_dim_multiplier 1.3, multiple_of 1024, rope_theta
# 500000, Llama 3.1 RoPE scaling) at a small width.
TINY_8B = dataclasses.replace(llama3_flavors["8B"], dim=512, n_heads=4, n_kv_heads=1, n_layers=2, vocab_size=4096)
FLAVORS = {"debugmodel": DEBUG, "8B-shaped": TINY_8B}


def build(args: TransformerModelArgs, seed: int = 0) -> Transformer:
    """A randomly initialized model on CPU (built on meta and materialized, as the trainer does), with random norm
    weights too (all-ones norms would hide a mix-up of the two norms of a block)."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights(buffer_device=None)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
    return model.eval()


def state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_equal_state_dicts(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def max_logit_diff(model: Transformer, hf_model, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(tokens) - hf_model(tokens).logits).abs().max().item()


def load_in_transformers(folder: str):
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return model.eval()


# ----------------------------------------------------------------------------------------------------------------
# logits against transformers
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_exported_logits_match_transformers(flavor, tmp_path):
    args = FLAVORS[flavor]
    model = build(args)
    folder = str(tmp_path / "hf")
    # The 8B-shaped export is sharded (about 27 MB of weights in 10 MB shards): transformers reads the index.
    shard = 10**7 if flavor == "8B-shaped" else 10**10
    export_hf(state_dict(model), args, folder, dtype=torch.float32, max_shard_bytes=shard)
    assert os.path.isfile(os.path.join(folder, INDEX_FILE)) == (flavor == "8B-shaped")

    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    diff = max_logit_diff(model, load_in_transformers(folder), tokens)
    print(f"{flavor}: max |logits - transformers' logits| = {diff:.2e}")
    assert diff <= TOLERANCE

    if args.rope_scaling:
        # The comparison sees the RoPE scaling: without it transformers' logits are far off at these positions.
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        config["rope_scaling"] = None
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        assert max_logit_diff(model, load_in_transformers(folder), tokens) > 10 * TOLERANCE


def test_folder_saved_by_transformers_loads_with_its_logits(tmp_path):
    """Import of a checkpoint Tessera did not write: a LlamaForCausalLM of the debug model's shapes, built and
    saved by transformers itself (its own config.json keys, tensor names, dtype and file layout), loads with
    load_hf into the debug flavor, and Tessera's model gives transformers' logits on the same tokens."""
    args = DEBUG
    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        intermediate_size=ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier),
        rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta, max_position_embeddings=args.max_seq_len,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch.manual_seed(3)
    hf_model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # random norms (transformers initializes them to ones, which would hide a mix-up)
        for name, param in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
    folder = str(tmp_path / "saved_by_transformers")
    hf_model.save_pretrained(folder)
    assert any(f.endswith(".safetensors") for f in os.listdir(folder))

    sd = load_hf(folder, args)
    model = build(args, seed=7)  # other weights (and the RoPE table), then every weight from the folder
    model.load_state_dict(sd)
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    diff = max_logit_diff(model, hf_model, tokens)
    print(f"max |logits - transformers' logits| = {diff:.2e}")
    assert diff <= TOLERANCE
    # The comparison sees the weights: one block's query projection left at another's gives other logits.
    with torch.no_grad():
        model.layers["1"].attention.wq.weight.copy_(model.layers["0"].attention.wq.weight)
    assert max_logit_diff(model, hf_model, tokens) > 10 * TOLERANCE


# ----------------------------------------------------------------------------------------------------------------
# the adapter
# ----------------------------------------------------------------------------------------------------------------


def test_registered_as_the_llama3_adapter():
    assert get_model_spec("llama3").state_dict_adapter is Llama3HFAdapter


def test_rope_permutation_per_head():
    """Within each head, interleaved pairs (x[2i], x[2i+1]) become halves (x[i], x[i + D/2])."""
    args = TransformerModelArgs(dim=8, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=4)
    with torch.device("meta"):
        names = list(Transformer(args).state_dict())
    sd = {name: torch.zeros(1) for name in names}
    sd["layers.0.attention.wq.weight"] = torch.arange(8.0)[:, None].expand(8, 8).clone()
    sd["layers.0.attention.wk.weight"] = torch.arange(4.0)[:, None].expand(4, 8).clone()
    hf = Llama3HFAdapter.to_hf(sd, args)
    assert hf["model.layers.0.self_attn.q_proj.weight"][:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert hf["model.layers.0.self_attn.k_proj.weight"][:, 0].tolist() == [0, 2, 1, 3]


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_adapter_round_trip_is_exact(flavor):
    args = FLAVORS[flavor]
    sd = state_dict(build(args))
    hf = Llama3HFAdapter.to_hf(sd, args)
    assert {name: tuple(t.shape) for name, t in hf.items()} == Llama3HFAdapter.hf_shapes(args)
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], sd["layers.0.attention.wq.weight"])
    assert_equal_state_dicts(Llama3HFAdapter.from_hf(hf, args), sd)


def test_hf_config_of_the_published_sizes():
    """config.json of the real flavors carries the published Llama 3.1 shapes."""
    published = {"8B": (4096, 14336, 32, 8), "70B": (8192, 28672, 64, 8), "405B": (16384, 53248, 128, 8)}
    for flavor, (hidden, intermediate, heads, kv_heads) in published.items():
        config = Llama3HFAdapter.hf_config(llama3_flavors[flavor])
        assert (config["hidden_size"], config["intermediate_size"]) == (hidden, intermediate)
        assert (config["num_attention_heads"], config["num_key_value_heads"]) == (heads, kv_heads)
        assert config["head_dim"] == 128
        assert config["rope_scaling"] == {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 500000.0
        assert config["vocab_size"] == 128256 and config["tie_word_embeddings"] is False
        assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    debug = Llama3HFAdapter.hf_config(DEBUG, dtype=torch.float32)
    assert debug["rope_scaling"] is None
    assert debug["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert debug["intermediate_size"] == ffn_hidden_dim(256, 256, None) == 768 and debug["dtype"] == "float32"


@pytest.mark.parametrize("flavor", ["debugmodel", "8B-shaped", "1B", "3B", "8B", "405B"])
def test_args_from_hf_config_inverts_hf_config(flavor):
    args = FLAVORS.get(flavor) or llama3_flavors[flavor]
    config = Llama3HFAdapter.hf_config(args)
    back = Llama3HFAdapter.args_from_hf_config(config)
    assert Llama3HFAdapter.hf_config(back) == config
    Llama3HFAdapter.check_hf_config(config, args, FIELD)
    # transformers 4.x configs (rope_theta + rope_scaling only) and 5.x ones (rope_parameters only) read the same.
    v4 = {k: v for k, v in config.items() if k != "rope_parameters"}
    v5 = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    for variant in (v4, v5):
        assert Llama3HFAdapter.args_from_hf_config(variant) == back


def test_args_from_hf_config_takes_any_intermediate_size():
    """Every FFN size reads back exactly, including those smaller than int(8 * dim / 3) (a multiplier below 1,
    whose float product used to round one below: 1 with hidden_size 74 failed an assert)."""
    config = Llama3HFAdapter.hf_config(DEBUG)
    for dim, heads in ((74, 1), (96, 4), (148, 2), (256, 16)):
        for hidden in range(1, int(8 * dim / 3) + 3):
            variant = {**config, "hidden_size": dim, "num_attention_heads": heads, "num_key_value_heads": heads,
                       "head_dim": dim // heads, "intermediate_size": hidden}
            args = Llama3HFAdapter.args_from_hf_config(variant)
            assert ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier) == hidden, (dim, hidden)


def test_transformers_reads_the_config_as_written():
    config = transformers.LlamaConfig(**Llama3HFAdapter.hf_config(TINY_8B))
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["factor"] == 8.0
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.head_dim == 128
    config = transformers.LlamaConfig(**Llama3HFAdapter.hf_config(DEBUG))
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"hidden_size": 4096, "head_dim": 256},
            "config.json has hidden_size 4096 but model.flavor debugmodel has dim 256",
        ),
        ({"num_key_value_heads": 4}, "num_key_value_heads 4 but model.flavor debugmodel has n_kv_heads 8"),
        ({"intermediate_size": 1024}, "intermediate_size 1024 but model.flavor debugmodel has FFN hidden size"),
        ({"vocab_size": 128256}, "vocab_size 128256 but"),
        ({"rope_theta": 10000.0, "rope_parameters": None}, "rope_theta 10000.0 but"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}, "rope_scaling True but"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}, "rope_scaling.low_freq_factor 2.0"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn'"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings True"),
        ({"model_type": "mistral"}, "model_type 'mistral'"),
    ],
)
def test_check_hf_config_names_the_difference(change, message):
    config = {**Llama3HFAdapter.hf_config(DEBUG), **change}
    with pytest.raises(ValueError, match=f"^{FIELD}: .*{message}".replace("(", r"\(").replace(")", r"\)")):
        Llama3HFAdapter.check_hf_config(config, DEBUG, FIELD, model_label="model.flavor debugmodel")


# ----------------------------------------------------------------------------------------------------------------
# export and load
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def debug_export(tmp_path_factory):
    """(state dict, folder) of a debugmodel exported in fp32 with the built-in tokenizer."""
    sd = state_dict(build(DEBUG, seed=3))
    folder = str(tmp_path_factory.mktemp("export") / "debug_hf")
    export_hf(sd, DEBUG, folder, dtype=torch.float32, tokenizer_path=BUILTIN_TOKENIZER)
    return sd, folder


def test_export_then_load_is_exact(debug_export, tmp_path):
    sd, folder = debug_export
    assert sorted(os.listdir(folder)) == ["config.json", SINGLE_FILE, "tokenizer.json", "tokenizer_config.json"]
    assert_equal_state_dicts(load_hf(folder, DEBUG), sd)
    tokenizer = Tokenizer(BUILTIN_TOKENIZER)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert (config["bos_token_id"], config["eos_token_id"]) == (tokenizer.bos_id, tokenizer.eos_id)
    # A tokenizer without BOS (bos_token null): config.json says so, rather than leave transformers' default (1).
    (tmp_path / "no_bos").mkdir()
    shutil.copyfile(BUILTIN_TOKENIZER, tmp_path / "no_bos" / "tokenizer.json")
    (tmp_path / "no_bos" / "tokenizer_config.json").write_text(json.dumps({"bos_token": None}))
    export_hf(sd, DEBUG, str(tmp_path / "no_bos_hf"), tokenizer_path=str(tmp_path / "no_bos" / "tokenizer.json"))
    with open(tmp_path / "no_bos_hf" / "config.json") as f:
        config = json.load(f)
    assert config["bos_token_id"] is None and config["eos_token_id"] == tokenizer.eos_id
    shutil.rmtree(tmp_path / "no_bos_hf")

    # bf16, sharded into one tensor per shard: the values are sd's rounded to bf16.
    sharded = str(tmp_path / "bf16")
    export_hf(sd, DEBUG, sharded, max_shard_bytes=1)
    n = len(sd)
    assert sorted(os.listdir(sharded)) == sorted(
        ["config.json", INDEX_FILE] + [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    expected = {name: t.to(torch.bfloat16).float() for name, t in sd.items()}
    assert_equal_state_dicts(load_hf(sharded, DEBUG), expected)
    # Readable by everyone the umask allows (safetensors and mkdtemp make owner-only files and folders).
    mask = os.umask(0o022)
    os.umask(mask)
    for path in [sharded, *(os.path.join(sharded, f) for f in os.listdir(sharded))]:
        assert stat.S_IMODE(os.stat(path).st_mode) == (0o777 if os.path.isdir(path) else 0o666) & ~mask, path


def test_export_never_overwrites(debug_export, tmp_path):
    sd, _ = debug_export
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="^out: .*occupied' already exists and is not an empty folder"):
        export_hf(sd, DEBUG, str(occupied), field="out")
    assert os.listdir(occupied) == ["keep.txt"] and (occupied / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="^dtype: cannot export in torch.int8"):
        export_hf(sd, DEBUG, str(tmp_path / "int8"), dtype=torch.int8)
    # A file where the folder would go, or where one of its parents would.
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(ValueError, match="^out: .*afile' already exists and is not an empty folder"):
        export_hf(sd, DEBUG, str(tmp_path / "afile"), field="out")
    with pytest.raises(ValueError, match="^out: .*afile' is a file, so .*afile/sub/hf' cannot be made; choose a "):
        export_hf(sd, DEBUG, str(tmp_path / "afile" / "sub" / "hf"), field="out")
    assert (tmp_path / "afile").read_text() == "mine"
    (tmp_path / "afile").unlink()
    # An empty folder is fine, and no temporary folder is left beside it.
    (tmp_path / "empty").mkdir()
    export_hf(sd, DEBUG, str(tmp_path / "empty"))
    assert sorted(os.listdir(tmp_path)) == ["empty", "occupied"]
    assert sorted(os.listdir(tmp_path / "empty")) == ["config.json", SINGLE_FILE]


def _rewrite_weights(folder: str, edit) -> None:
    path = os.path.join(folder, SINGLE_FILE)
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _truncate(folder: str) -> None:
    path = os.path.join(folder, SINGLE_FILE)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)


def _corrupt_config(folder: str) -> None:
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write("{not json")


def _only_pickle(folder: str) -> None:
    os.remove(os.path.join(folder, SINGLE_FILE))
    with open(os.path.join(folder, "pytorch_model.bin"), "wb") as f:
        f.write(b"not a pickle: loading must not try")


def _drop_a_shard(folder: str) -> None:
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump(index, f)


BAD_FOLDERS = {
    "no config.json": (lambda d: os.remove(os.path.join(d, "config.json")), "has no config.json"),
    "corrupt config.json": (_corrupt_config, "cannot read .*config.json. as JSON"),
    "no weights": (lambda d: os.remove(os.path.join(d, SINGLE_FILE)), "has neither model.safetensors nor"),
    "pickle weights only": (_only_pickle, "pytorch_model.bin: pickle files, which Tessera never loads"),
    "missing tensor": (
        lambda d: _rewrite_weights(d, lambda t: t.pop("model.layers.3.mlp.up_proj.weight")),
        "lacks model.layers.3.mlp.up_proj.weight",
    ),
    "unexpected tensor": (
        lambda d: _rewrite_weights(d, lambda t: t.update({"model.layers.6.input_layernorm.weight": torch.ones(256)})),
        "holds model.layers.6.input_layernorm.weight, which the configured model does not have",
    ),
    "wrong shape": (
        lambda d: _rewrite_weights(d, lambda t: t.update({"model.norm.weight": torch.ones(255)})),
        r"model.norm.weight in model.safetensors has shape \[255\], expected \[256\]",
    ),
    "integer tensor": (
        lambda d: _rewrite_weights(d, lambda t: t.update({"model.norm.weight": torch.ones(256, dtype=torch.int32)})),
        "model.norm.weight in model.safetensors has dtype I32, not floating point",
    ),
    "truncated file": (_truncate, "model.safetensors' is not a readable safetensors file"),
    "missing shard": (_drop_a_shard, "lacks model-00002-of-00002.safetensors, which model.safetensors.index.json"),
}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_bad_folders_are_refused_by_name(case, debug_export, tmp_path):
    _, good = debug_export
    folder = str(tmp_path / "bad")
    shutil.copytree(good, folder)
    damage, message = BAD_FOLDERS[case]
    damage(folder)
    before = sorted(os.listdir(folder))
    with pytest.raises(ValueError, match=f"^{FIELD}: .*{message}"):
        load_hf(folder, DEBUG)
    assert sorted(os.listdir(folder)) == before  # nothing on disk deleted


def test_missing_folder_and_other_flavor_are_refused(debug_export, tmp_path):
    _, folder = debug_export
    with pytest.raises(ValueError, match=f"^{FIELD}: folder '.*nowhere' not found"):
        load_hf(str(tmp_path / "nowhere"), DEBUG)
    mismatch = f"^{FIELD}: config.json has hidden_size 256 but model.flavor 8B_tiny has dim 512"
    with pytest.raises(ValueError, match=mismatch):
        load_hf(folder, TINY_8B, model_label="model.flavor 8B_tiny")
    with pytest.raises(ValueError, match="^--from: config.json has vocab_size 2048 but the configured model has"):
        load_hf(folder, dataclasses.replace(DEBUG, vocab_size=4096), field="--from")
