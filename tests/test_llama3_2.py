"""Llama 3.2 1B and 3B in the llama3 family: the flavors against the published parameter counts and config.json
files, and Hugging Face conversion of tied embeddings and Llama 3.2's RoPE scaling (factor 32) against
transformers' LlamaForCausalLM both ways (CPU, fp32)."""

import dataclasses
import json
import math
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.hf import SINGLE_FILE, export_hf, load_hf
from models.llama3 import Llama3HFAdapter, Transformer, TransformerModelArgs, llama3_flavors
from models.llama3.model import count_params, num_params, precompute_rope_inv_freq, precompute_rope_table
from tests.test_hf import assert_equal_state_dicts, build, load_in_transformers, max_logit_diff, state_dict

transformers = pytest.importorskip("transformers")

FIELD = "checkpoint.initial_load_path"
TOLERANCE = 1e-4

LLAMA3_2_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
# meta-llama/Llama-3.2-1B's and -3B's config.json (the keys that describe the model).
PUBLISHED_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "attention_bias": False,
    "mlp_bias": False, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "rope_scaling": LLAMA3_2_ROPE, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
PUBLISHED = {  # flavor: (config.json, parameter count)
    "1B": (PUBLISHED_1B, 1_235_814_400),
    "3B": ({**PUBLISHED_1B, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "head_dim": 128},
           3_212_749_824),
}

# A small Llama 3.2 in transformers' terms: tied embeddings, llama3 RoPE scaling with factor 32, heads 32 wide (so
# that several frequencies fall in the scaled and the smoothed bands).
SMALL = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=320, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=16384,
             tie_word_embeddings=True, rope_scaling=LLAMA3_2_ROPE, attn_implementation="sdpa")
# The same model in Tessera's terms.
SMALL_ARGS = TransformerModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=320,
                                  norm_eps=1e-5, rope_theta=500000.0, rope_scaling=True, rope_scaling_factor=32.0,
                                  max_seq_len=16384, tie_embeddings=True)


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(1))


def randomize(model: torch.nn.Module) -> None:
    """Norms near 1 (all ones would hide a mix-up of two norms) and every other weight wider than transformers'
    initialization, so that attention depends on the positions (and so on the RoPE scaling)."""
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied weight once
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


# ----------------------------------------------------------------------------------------------------------------
# the flavors
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_flavors_count_the_published_parameters_and_write_the_published_config(flavor):
    args = llama3_flavors[flavor]
    published, count = PUBLISHED[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    assert count_params(model) == num_params(args) == count  # parameters() counts the tied weight once
    assert model.output.weight is model.tok_embeddings.weight
    assert args.ffn_hidden_size == 8192 and args.head_dim == published["head_dim"]
    # The Hugging Face folder holds exactly those parameters: the embedding once, no lm_head.weight.
    shapes = Llama3HFAdapter.hf_shapes(args)
    assert "lm_head.weight" not in shapes and sum(math.prod(s) for s in shapes.values()) == count
    config = Llama3HFAdapter.hf_config(args)
    assert {k: config[k] for k in published if k not in ("bos_token_id", "eos_token_id")} == \
        {k: v for k, v in published.items() if k not in ("bos_token_id", "eos_token_id")}
    # The published config.json fits the flavor, and reads back as it.
    Llama3HFAdapter.check_hf_config(published, args, FIELD, model_label=f"model.flavor {flavor}")
    assert Llama3HFAdapter.hf_config(Llama3HFAdapter.args_from_hf_config(published)) == config


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_flavors_rope_is_transformers_llama3_rope(flavor):
    """The flavor's RoPE frequencies are those transformers computes from the config.json Tessera writes (factor 32
    divides the low frequencies, not 8)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    args = llama3_flavors[flavor]
    config = transformers.LlamaConfig(**Llama3HFAdapter.hf_config(args))
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_factor == 1.0
    ours = precompute_rope_inv_freq(args.head_dim, args.rope_theta, True, args.rope_scaling_factor)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    llama3_1 = precompute_rope_inv_freq(args.head_dim, args.rope_theta, True)
    assert ours[-1] == llama3_1[-1] / 4 and torch.equal(ours[:4], llama3_1[:4])


def test_llama3_1_flavors_keep_their_rope_table():
    """8B, 70B and 405B keep Llama 3.1's factor 8: the table the model builds is the one of the module's constants,
    bit for bit."""
    for flavor in ("8B", "70B", "405B"):
        assert llama3_flavors[flavor].rope_scaling_factor == 8.0
    args = dataclasses.replace(llama3_flavors["8B"], dim=256, n_heads=2, n_kv_heads=1, n_layers=1, vocab_size=8,
                               max_seq_len=4096)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    assert torch.equal(model.rope_table, precompute_rope_table(128, 4096, 500000.0, rope_scaling=True))


# ----------------------------------------------------------------------------------------------------------------
# logits against transformers
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_by_transformers(tmp_path_factory):
    """(transformers' small Llama 3.2, the folder its save_pretrained wrote)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SMALL, "rope_scaling": dict(LLAMA3_2_ROPE)})  # it adds to the dict
    hf = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    randomize(hf)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    folder = str(tmp_path_factory.mktemp("llama3_2") / "saved_by_transformers")
    hf.save_pretrained(folder)
    return hf, folder


def test_folder_saved_by_transformers_has_its_logits_in_tessera(saved_by_transformers):
    hf, folder = saved_by_transformers
    with safe_open(os.path.join(folder, SINGLE_FILE), framework="pt") as f:
        stored = set(f.keys())
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored  # tied: stored once
    with open(os.path.join(folder, "config.json")) as f:
        args = Llama3HFAdapter.args_from_hf_config(json.load(f))
    assert args.tie_embeddings and args.rope_scaling and args.rope_scaling_factor == 32.0
    assert args.ffn_hidden_size == 320 and args.head_dim == 32

    model = build(args, seed=7)  # other weights first: every one must come from the folder
    model.load_state_dict(load_hf(folder, args))
    assert model.output.weight is model.tok_embeddings.weight
    diff = max_logit_diff(model, hf, tokens())
    print(f"max |logits - transformers' logits| = {diff:.2e}")
    assert diff <= TOLERANCE
    # The comparison sees the factor: Llama 3.1's (8) gives other logits on the same weights.
    llama3_1 = build(dataclasses.replace(args, rope_scaling_factor=8.0))
    llama3_1.load_state_dict(load_hf(folder, args))
    assert max_logit_diff(llama3_1, hf, tokens()) > 10 * TOLERANCE


def test_tessera_export_has_its_logits_in_transformers(tmp_path):
    args = SMALL_ARGS
    model = build(args, seed=2)
    sd = state_dict(model)
    folder = str(tmp_path / "hf")
    export_hf(sd, args, folder, dtype=torch.float32)
    assert set(load_file(os.path.join(folder, SINGLE_FILE))) == set(Llama3HFAdapter.hf_shapes(args))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["tie_word_embeddings"] is True and config["rope_scaling"] == LLAMA3_2_ROPE

    hf = load_in_transformers(folder)
    assert hf.config.tie_word_embeddings and hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    diff = max_logit_diff(model, hf, tokens())
    print(f"max |logits - transformers' logits| = {diff:.2e}")
    assert diff <= TOLERANCE
    assert_equal_state_dicts(load_hf(folder, args), sd)  # and back, exactly

    # Exporting one tensor at a time (a checkpoint's export) gives the same tensors, and so does a state dict
    # that leaves the tied output out.
    hf_sd = Llama3HFAdapter.to_hf(sd, args)
    one_by_one = {}
    for name, tensor in sd.items():
        one_by_one.update(Llama3HFAdapter.tensors_to_hf(name, tensor, args))
    without_output = Llama3HFAdapter.to_hf({k: v for k, v in sd.items() if k != "output.weight"}, args)
    for other in (one_by_one, without_output):
        assert list(other) == list(hf_sd) and all(torch.equal(other[k], hf_sd[k]) for k in hf_sd)
    # A rank holding some rows of the tied output reads them from the embedding.
    rows = (slice(100, 200), slice(0, args.dim))
    part = Llama3HFAdapter.read_from_hf("output.weight", rows, lambda name, box: hf_sd[name][box], args)
    assert torch.equal(part, sd["tok_embeddings.weight"][rows])


def test_conversion_through_a_tessera_step_folder_keeps_the_logits(saved_by_transformers, tmp_path):
    """tools.convert_hf both ways with a tied model: transformers' folder -> a Tessera step folder (the output
    stored as the embedding's copy, as a checkpoint of the model holds it) -> a Hugging Face folder again (one
    embedding, no lm_head.weight), which transformers loads with the first model's logits."""
    from models.registry import get_model_spec, register_model_spec
    from tools.convert_hf import main as convert

    register_model_spec(dataclasses.replace(get_model_spec("llama3"), name="llama3_2_small",
                                            flavors={"small": SMALL_ARGS}))
    hf, folder = saved_by_transformers
    step, back = str(tmp_path / "step"), str(tmp_path / "back")
    assert convert(["from-hf", folder, step, "--flavor", "small", "--model", "llama3_2_small"]) == 0
    assert convert(["to-hf", step, back, "--dtype", "float32", "--no-tokenizer"]) == 0
    assert set(load_file(os.path.join(back, SINGLE_FILE))) == set(load_file(os.path.join(folder, SINGLE_FILE)))
    diff = (load_in_transformers(back)(tokens()).logits - hf(tokens()).logits).abs().max().item()
    assert diff <= TOLERANCE


# ----------------------------------------------------------------------------------------------------------------
# what Tessera cannot hold, or what differs from the configured model
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {**LLAMA3_2_ROPE, "low_freq_factor": 2.0}},
     "config.json has rope_scaling.low_freq_factor 2.0; Tessera's Llama 3 supports only 1.0"),
    ({"rope_scaling": {**LLAMA3_2_ROPE, "high_freq_factor": 8.0}},
     "config.json has rope_scaling.high_freq_factor 8.0; Tessera's Llama 3 supports only 4.0"),
    ({"rope_scaling": {**LLAMA3_2_ROPE, "original_max_position_embeddings": 4096}},
     "config.json has rope_scaling.original_max_position_embeddings 4096; Tessera's Llama 3 supports only 8192"),
    ({"rope_scaling": {k: v for k, v in LLAMA3_2_ROPE.items() if k != "high_freq_factor"}},
     "config.json has rope_scaling.high_freq_factor None"),
    ({"rope_scaling": {**LLAMA3_2_ROPE, "factor": "32"}}, "config.json has rope_scaling.factor '32'; .* positive"),
    ({"rope_scaling": {**LLAMA3_2_ROPE, "factor": 0}}, "config.json has rope_scaling.factor 0; .* positive"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 32.0}}, "config.json has RoPE type 'yarn'"),
    # transformers 5's form: rope_parameters only.
    ({"rope_scaling": None, "rope_theta": None,
      "rope_parameters": {**LLAMA3_2_ROPE, "low_freq_factor": 2.0, "rope_theta": 500000.0}},
     "config.json has rope_parameters.low_freq_factor 2.0"),
])
def test_rope_scaling_tessera_cannot_hold_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=f"^{FIELD}: {message}") as excinfo:
        Llama3HFAdapter.args_from_hf_config({**PUBLISHED_1B, **change}, FIELD)
    one_line_error(excinfo)


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {**LLAMA3_2_ROPE, "factor": 8.0}},
     "config.json has rope_scaling.factor 8.0 but model.flavor 1B has rope_scaling_factor 32.0"),
    ({"rope_scaling": None}, "config.json has rope_scaling False but model.flavor 1B has rope_scaling True"),
    ({"tie_word_embeddings": False},
     "config.json has tie_word_embeddings False but model.flavor 1B has tie_embeddings True"),
    (PUBLISHED["3B"][0], "config.json has hidden_size 3072 but model.flavor 1B has dim 2048"),
])
def test_config_of_another_model_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=f"^{FIELD}: {message}$") as excinfo:
        Llama3HFAdapter.check_hf_config({**PUBLISHED_1B, **change}, llama3_flavors["1B"], FIELD,
                                        model_label="model.flavor 1B")
    one_line_error(excinfo)


def test_folders_that_do_not_fit_are_refused_by_name(saved_by_transformers, tmp_path):
    _, folder = saved_by_transformers
    untied = dataclasses.replace(SMALL_ARGS, tie_embeddings=False)
    with pytest.raises(ValueError, match=f"^{FIELD}: config.json has tie_word_embeddings True but the configured "
                                         "model has tie_embeddings False$") as excinfo:
        load_hf(folder, untied)
    one_line_error(excinfo)
    # A tied config.json whose weights hold an output projection of their own: which one is meant is unknown.
    both = str(tmp_path / "both")
    shutil.copytree(folder, both)
    path = os.path.join(both, SINGLE_FILE)
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"^{FIELD}: {SINGLE_FILE} holds lm_head.weight, which the configured "
                                         "model does not have$") as excinfo:
        load_hf(both, SMALL_ARGS)
    one_line_error(excinfo)


# ----------------------------------------------------------------------------------------------------------------
# the shipped config
# ----------------------------------------------------------------------------------------------------------------


def test_shipped_config_shards_the_1b_model_with_fsdp_only():
    """train_configs/llama3_2_1b.toml validates on 8 GPUs as FSDP over all of them; TP shards the tied weight once
    (on the vocabulary), and PP puts the embedding and its copy on two stages (tests/test_parallel.py trains it)."""
    from engine.config import parse_args
    from engine.config.validation import validate

    base = ["--config", "train_configs/llama3_2_1b.toml", "--model.hf_assets_path="]
    cfg = parse_args(base)
    assert (cfg.model.name, cfg.model.flavor, cfg.compile.enable) == ("llama3", "1B", True)
    dims = validate(cfg, 8).dims
    assert (dims.dp_shard, dims.tp, dims.pp) == (8, 1, 1)
    assert validate(parse_args([*base, "--parallelism.tp", "2"]), 8).dims.tp == 2
    assert validate(parse_args([*base, "--parallelism.pp", "2"]), 8).dims.pp == 2
