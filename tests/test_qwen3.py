"""The qwen3 family: its flavors against the published parameter counts, its Hugging Face adapter against
transformers' own Qwen3ForCausalLM and Qwen3MoeForCausalLM (logits both ways, CPU, fp32), and its tensor-parallel
plan against one process (2 gloo ranks)."""

import dataclasses
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import Shard

from models.llama3 import Llama3HFAdapter
from models.llama3.model import Transformer, count_params, flops_per_token, num_params
from models.moe import MoE
from models.qwen3 import Qwen3HFAdapter, Qwen3ModelArgs, qwen3_flavors
from models.qwen3.parallelize import parallelize_qwen3, pipeline_stage
from models.registry import get_model_spec
from tests.parallel_harness import AOT_EAGER, global_batches, run_jobs, run_layout

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
FIELD = "checkpoint.initial_load_path"

# ----------------------------------------------------------------------------------------------------------------
# the spec and the flavors
# ----------------------------------------------------------------------------------------------------------------


def test_registered():
    spec = get_model_spec("qwen3")
    assert spec.model_cls is Transformer and spec.args_cls is Qwen3ModelArgs
    assert spec.flavors is qwen3_flavors and spec.state_dict_adapter is Qwen3HFAdapter
    assert spec.parallelize_fn is parallelize_qwen3 and spec.pipeline_fn is pipeline_stage
    assert spec.flops_per_token is flops_per_token
    # A Qwen3 flavor is told from a Llama one with the same numbers (the HF conversion picks its adapter by class).
    assert isinstance(qwen3_flavors["8B"], get_model_spec("llama3").args_cls)
    same = Qwen3ModelArgs(**{f.name: getattr(qwen3_flavors["8B"], f.name) for f in dataclasses.fields(Qwen3ModelArgs)})
    assert same == qwen3_flavors["8B"]
    llama = get_model_spec("llama3").args_cls
    assert llama(**{f.name: getattr(same, f.name) for f in dataclasses.fields(llama)}) != same


# Published parameter counts, from the Qwen3 model cards on Hugging Face (Qwen/Qwen3-0.6B ... Qwen/Qwen3-235B-A22B,
# "Number of Parameters", "Number of Parameters (Non-Embedding)", "Number of Activated Parameters"), in billions, as
# printed: the count must round to them (within half a unit of the last digit printed), the activated count within
# one unit (the card prints 3.3B for the 3.35B parameters a token of 30B-A3B uses: attention, router, 8 experts,
# embedding and output). Non-embedding leaves out the embedding and an untied output projection.
PUBLISHED = {  # flavor: (total, non-embedding, activated or None, the unit of the last digit)
    "0.6B": (0.6, 0.44, None, 0.1),
    "1.7B": (1.7, 1.4, None, 0.1),
    "4B": (4.0, 3.6, None, 0.1),
    "8B": (8.2, 6.95, None, 0.1),
    "14B": (14.8, 13.2, None, 0.1),
    "32B": (32.8, 31.2, None, 0.1),
    "30B-A3B": (30.5, 29.9, 3.3, 0.1),
    "235B-A22B": (235, 234, 22, 1),
}
NON_EMBEDDING_UNIT = {"0.44": 0.01, "6.95": 0.01}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_flavors_count_the_published_parameters(flavor):
    args = qwen3_flavors[flavor]
    total, non_embedding, activated, unit = PUBLISHED[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    n = count_params(model)  # parameters() counts a tied weight once
    assert n == num_params(args)
    embeddings = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    assert abs(n / 1e9 - total) <= unit / 2, (flavor, n)
    assert abs((n - embeddings) / 1e9 - non_embedding) <= NON_EMBEDDING_UNIT.get(str(non_embedding), unit) / 2
    if activated is not None:
        assert abs(num_params(args, active=True) / 1e9 - activated) <= unit
    assert (model.output.weight is model.tok_embeddings.weight) == args.tie_embeddings
    assert args.vocab_size == 151936 and args.head_dim == 128 and args.qk_norm and args.norm_eps == 1e-6
    assert args.rope_theta == 1e6 and not args.rope_scaling
    assert args.tie_embeddings == (flavor in ("0.6B", "1.7B", "4B"))
    if args.moe is not None:
        assert (args.moe.num_experts, args.moe.top_k, args.moe.route_norm, args.moe.score_func) == \
            (128, 8, True, "softmax")
        assert args.moe.num_shared_experts == 0 and args.moe.load_balance_coeff is None and args.n_dense_layers == 0
        assert all(isinstance(block.feed_forward, MoE) for block in model.layers.values())


def test_benchmark_and_debug_flavors():
    f = qwen3_flavors
    for base, counts in (("8B", (2, 4, 8)), ("30B-A3B", (2, 4, 8)), ("235B-A22B", (1, 2))):
        for n in counts:
            args = f[f"{base}_L{n}"]
            assert args.n_layers == n and dataclasses.replace(args, n_layers=f[base].n_layers) == f[base]
    dense, moe = f["debugmodel"], f["debugmodel_moe"]
    assert dense.vocab_size == -1 and dense.head_dim == 64 != dense.dim // dense.n_heads and dense.qk_norm
    assert dense.moe is None and not dense.tie_embeddings
    assert dataclasses.replace(moe, moe=None) == dense
    assert (moe.moe.num_experts, moe.moe.top_k, moe.moe.hidden_dim, moe.moe.route_norm) == (8, 2, 128, True)
    assert moe.moe.load_balance_coeff is None
    for args in (dense, moe):
        args = dataclasses.replace(args, vocab_size=4096)
        with torch.device("meta"):
            model = Transformer(args)
        assert count_params(model) == num_params(args)
        assert list(model.state_dict()) == Qwen3HFAdapter.names(args)
        assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == Qwen3HFAdapter.shapes(args)


# ----------------------------------------------------------------------------------------------------------------
# logits against transformers
# ----------------------------------------------------------------------------------------------------------------

# Small configurations in transformers' own terms: heads 32 wide (not hidden_size / heads = 16), RoPE base 1e6.
COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, intermediate_size=96, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=128,
              attn_implementation="sdpa")
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
CONFIGS = {
    "dense": ("Qwen3", dict(tie_word_embeddings=False)),
    "dense_tied": ("Qwen3", dict(tie_word_embeddings=True)),
    "moe": ("Qwen3Moe", dict(**MOE, norm_topk_prob=True)),
    # the first block dense (mlp_only_layers), and the top-k weights not renormalized
    "moe_dense_first_no_norm_topk": ("Qwen3Moe", dict(**MOE, norm_topk_prob=False, mlp_only_layers=[0])),
}


def randomize(model: torch.nn.Module, router: str, others_std: float = 0.0) -> None:
    """Norm weights near 1 (all ones would hide a mix-up of two norms), routers (names ending in ``router``) wide
    enough that routing varies from token to token, and, with ``others_std``, every other weight."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(router):
                p.normal_(0, 0.5)
            elif others_std:
                p.normal_(0, others_std)


def hf_model(case: str, seed: int = 0):
    """transformers' model of ``case``, every weight random."""
    family, extra = CONFIGS[case]
    config = getattr(transformers, f"{family}Config")(**COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).to(torch.float32).eval()
    randomize(model, "mlp.gate.weight", others_std=0.05)
    return model


def tessera_model(args: Qwen3ModelArgs, seed: int = 0) -> Transformer:
    """A Tessera model of ``args``, built on meta and initialized as the trainer does, with random norms and
    routers."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights(buffer_device=None)
    randomize(model, "router.gate.weight")
    return model.eval()


def logit_diff(model: Transformer, hf, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(tokens) - hf(tokens).logits).abs().max().item()


def tokens(vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved_by_transformers(request, tmp_path_factory):
    """(case, transformers' model, the folder its save_pretrained wrote)."""
    model = hf_model(request.param)
    folder = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(folder)
    return request.param, model, folder


def read_folder(folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f), load_file(os.path.join(folder, "model.safetensors"))


def test_folder_saved_by_transformers_has_its_logits_in_tessera(saved_by_transformers):
    case, hf, folder = saved_by_transformers
    config, hf_state = read_folder(folder)
    args = Qwen3HFAdapter.args_from_hf_config(config)
    assert (args.moe is not None) == case.startswith("moe") and args.tie_embeddings == (case == "dense_tied")
    assert args.head_dim == 32 and args.n_dense_layers == (1 if "dense_first" in case else 0)
    assert {k: tuple(v.shape) for k, v in hf_state.items()} == Qwen3HFAdapter.hf_shapes(args)
    Qwen3HFAdapter.check_hf_config(config, args, FIELD)
    model = tessera_model(args, seed=5)  # other weights first: every one must come from the folder
    model.load_state_dict(Qwen3HFAdapter.from_hf(hf_state, args))  # strict
    diff = logit_diff(model, hf, tokens())
    print(f"{case}: max |logits - transformers' logits| = {diff:.2e}")
    assert diff <= TOLERANCE
    # The comparison sees the QK-norms: one left in rotate-half order gives other logits.
    with torch.no_grad():
        norm = model.layers["1"].attention.q_norm.weight
        norm.copy_(hf_state["model.layers.1.self_attn.q_norm.weight"])
    assert logit_diff(model, hf, tokens()) > 10 * TOLERANCE


@pytest.mark.parametrize("case", list(CONFIGS))
def test_tessera_export_has_its_logits_in_transformers(case, tmp_path):
    args = Qwen3HFAdapter.args_from_hf_config(hf_model(case).config.to_dict())
    model = tessera_model(args, seed=2)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    folder = str(tmp_path / "exported")
    os.makedirs(folder)
    hf_state = Qwen3HFAdapter.to_hf(state, args)
    assert {k: tuple(v.shape) for k, v in hf_state.items()} == Qwen3HFAdapter.hf_shapes(args)
    save_file({k: v.contiguous() for k, v in hf_state.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(Qwen3HFAdapter.hf_config(args, dtype=torch.float32), f)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    family = CONFIGS[case][0]
    assert type(hf).__name__ == f"{family}ForCausalLM" and hf.config.tie_word_embeddings == args.tie_embeddings
    diff = logit_diff(model, hf.eval(), tokens())
    print(f"{case}: max |logits - transformers' logits| = {diff:.2e}")
    assert diff <= TOLERANCE
    # Exporting one tensor at a time gives the same tensors (what a checkpoint's export does).
    one_by_one = {}
    for name, tensor in state.items():
        one_by_one.update(Qwen3HFAdapter.tensors_to_hf(name, tensor, args))
    assert list(one_by_one) == list(hf_state) and all(torch.equal(one_by_one[k], hf_state[k]) for k in hf_state)
    assert Qwen3HFAdapter.from_hf(hf_state, args).keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in Qwen3HFAdapter.from_hf(hf_state, args).items())


def test_reading_parts_gives_the_parts_of_the_whole(saved_by_transformers):
    """``read_from_hf`` of a box (what a rank holding a shard reads: engine.hf.load_hf_into) is that box of
    ``from_hf``'s tensor, and reads only the stored tensors the box needs: the experts it covers, the heads of
    wq/wk it touches."""
    _, _, folder = saved_by_transformers
    config, hf_state = read_folder(folder)
    args = Qwen3HFAdapter.args_from_hf_config(config)
    whole = Qwen3HFAdapter.from_hf(hf_state, args)
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        names_read = []

        def read(hf_name, box):
            names_read.append(hf_name)
            return f.get_slice(hf_name)[box]

        for name, shape in Qwen3HFAdapter.shapes(args).items():
            boxes = [tuple(slice(0, n) for n in shape),
                     (slice(shape[0] // 2 + 1, shape[0]), *(slice(0, n) for n in shape[1:])),
                     (slice(1, 1), *(slice(0, n) for n in shape[1:]))]  # an empty part
            if len(shape) == 3:  # an expert stack: experts 1-2, some rows, some columns
                boxes.append((slice(1, 3), slice(3, 20), slice(5, shape[2])))
            for box in boxes:
                names_read.clear()
                part = Qwen3HFAdapter.read_from_hf(name, box, read, args)
                assert torch.equal(part, whole[name][box]), (name, box)
                if len(shape) == 3 and box[0] == slice(1, 3):
                    assert names_read == Qwen3HFAdapter.hf_names(name, args)[1:3]


def test_another_architecture_is_refused_by_name(tmp_path):
    llama = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96).to_dict()
    with pytest.raises(ValueError, match=r"^config\.json: config\.json has model_type 'llama', not 'qwen3'"):
        Qwen3HFAdapter.args_from_hf_config(llama)
    qwen = hf_model("dense").config.to_dict()
    with pytest.raises(ValueError, match=r"^config\.json: config\.json has model_type 'qwen3', not 'llama'"):
        Llama3HFAdapter.args_from_hf_config(qwen)
    with pytest.raises(ValueError, match=rf"^{FIELD}: config\.json has model_type 'llama'"):
        Qwen3HFAdapter.check_hf_config(llama, qwen3_flavors["8B"], FIELD)


@pytest.mark.parametrize("change, message", [
    ({"decoder_sparse_step": 2}, r"makes blocks \[1\] sparse \(mlp_only_layers \[\], decoder_sparse_step 2\)"),
    ({"mlp_only_layers": [1]}, r"makes blocks \[0, 2\] sparse"),
    ({"mlp_only_layers": [0, 1, 2]}, "has no sparse block"),
    ({"use_sliding_window": True}, "use_sliding_window True"),
    ({"attention_bias": True}, "attention_bias True"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "RoPE type 'yarn'"),
    ({"num_experts_per_tok": 5}, "impossible Qwen3 model: top_k: 5 must be between 1 and the 4 experts"),
])
def test_configs_tessera_cannot_hold_are_refused_by_name(change, message):
    config = {**transformers.Qwen3MoeConfig(**COMMON, **MOE).to_dict(), **change}
    with pytest.raises(ValueError, match=f"^config\\.json: .*{message}"):
        Qwen3HFAdapter.args_from_hf_config(config)


@pytest.mark.parametrize("flavor, change, message", [
    ("14B", {}, "config.json has hidden_size 4096 but model.flavor 14B has dim 5120"),
    ("30B-A3B", {}, "config.json has model_type qwen3 but model.flavor 30B-A3B has model_type qwen3_moe"),
    ("8B", {"tie_word_embeddings": True},
     "config.json has tie_word_embeddings True but model.flavor 8B has tie_embeddings False"),
    ("8B", {"rope_theta": 5e6, "rope_parameters": None}, "config.json has rope_theta 5000000.0 but"),
])
def test_check_hf_config_names_the_difference(flavor, change, message):
    config = {**Qwen3HFAdapter.hf_config(qwen3_flavors["8B"]), **change}
    with pytest.raises(ValueError, match=f"^{FIELD}: {message}"):
        Qwen3HFAdapter.check_hf_config(config, qwen3_flavors[flavor], FIELD, model_label=f"model.flavor {flavor}")


def test_hf_config_of_every_published_flavor_reads_back_and_in_transformers():
    for name, args in qwen3_flavors.items():
        if args.vocab_size <= 0:
            args = dataclasses.replace(args, vocab_size=4096)
        config = Qwen3HFAdapter.hf_config(args)
        assert Qwen3HFAdapter.args_from_hf_config(config) == args, name
        Qwen3HFAdapter.check_hf_config(config, args, FIELD)
        theirs = transformers.AutoConfig.for_model(**config)
        assert theirs.head_dim == 128 or name.startswith("debug")
        assert theirs.tie_word_embeddings == args.tie_embeddings and theirs.rope_parameters["rope_theta"] == 1e6
        if args.moe is not None:
            assert (theirs.num_experts, theirs.num_experts_per_tok, theirs.moe_intermediate_size,
                    theirs.norm_topk_prob) == (args.moe.num_experts, args.moe.top_k, args.moe.hidden_dim, True)
    published_30b = Qwen3HFAdapter.hf_config(qwen3_flavors["30B-A3B"])
    assert {k: published_30b[k] for k in ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_experts",
                                          "num_experts_per_tok", "num_attention_heads", "num_key_value_heads",
                                          "head_dim", "num_hidden_layers", "max_position_embeddings")} == {
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_hidden_layers": 48, "max_position_embeddings": 40960}


def test_what_hugging_face_cannot_hold_is_refused():
    moe = qwen3_flavors["30B-A3B"]
    shared = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, num_shared_experts=1))
    with pytest.raises(ValueError, match="no shared experts"):
        Qwen3HFAdapter.hf_config(shared)
    with pytest.raises(ValueError, match="QK-norm"):
        Qwen3HFAdapter.hf_config(dataclasses.replace(qwen3_flavors["8B"], qk_norm=False))
    # The expert bias of auxiliary-loss-free balancing loads as zeros and exports only while zero.
    args = dataclasses.replace(qwen3_flavors["debugmodel_moe"], vocab_size=64, n_layers=1,
                               moe=dataclasses.replace(qwen3_flavors["debugmodel_moe"].moe, load_balance_coeff=1e-3))
    model = tessera_model(args)
    state = model.state_dict()
    assert "layers.0.feed_forward.expert_bias" in Qwen3HFAdapter.names(args)
    hf = Qwen3HFAdapter.to_hf(state, args)
    assert torch.equal(Qwen3HFAdapter.from_hf(hf, args)["layers.0.feed_forward.expert_bias"], torch.zeros(8))
    state["layers.0.feed_forward.expert_bias"][0] = 0.5
    with pytest.raises(ValueError, match="expert_bias: .*not zero"):
        Qwen3HFAdapter.to_hf(state, args)
    with pytest.raises(ValueError, match="^model.flavor: .*expert bias"):
        Qwen3HFAdapter.hf_config(args)


# ----------------------------------------------------------------------------------------------------------------
# parallel plans
# ----------------------------------------------------------------------------------------------------------------

STEPS = 4
GLOBAL = 8
TIED = "qwen3_tied"  # the dense 2-layer debug flavor with tied embeddings, registered by the test (none ships)


def register_tied() -> None:
    from models.registry import register_model_spec

    flavor = dataclasses.replace(qwen3_flavors["debugmodel_L2"], tie_embeddings=True)
    register_model_spec(dataclasses.replace(get_model_spec("qwen3"), name=TIED, flavors={"debugmodel_L2": flavor}))


def _args(flavor: str, *extra: str, model: str = "qwen3") -> list[str]:
    return ["--model.name", model, "--model.flavor", flavor, "--training.local_batch_size", str(GLOBAL), *extra]


def qk_norm_layout(trainer) -> dict:
    """A probe (run on every rank after the first step): block 0's q_norm weight's placements and mesh."""
    block = trainer.model_parts[0].layers["0"]
    norm = getattr(block, "_checkpoint_wrapped_module", block).attention.q_norm.weight
    return {"weight": [type(p).__name__ for p in getattr(norm, "placements", [])],
            "mesh": list(getattr(getattr(norm, "device_mesh", None), "mesh_dim_names", None) or [])}


def tied_weight(trainer) -> dict:
    """A probe: whether the output projection still shares the embedding's weight, and that weight's placements."""
    model = trainer.model_parts[0]
    weight = model.tok_embeddings.weight
    return {"shared": model.output.weight is weight,
            "placements": [str(p) for p in getattr(weight, "placements", [])]}


def moe_log(trainer) -> dict:
    """A probe: the first step's logged MoE values (every rank logs; a pipeline averages over its stages)."""
    return trainer.balance.log_values()


def _layout_job(world_size: int, rank: int, args: list[str], batches, dump: str, probe=None):
    register_tied()  # in every rank (they are forked from a server that never ran this test)
    return run_layout(args, world_size, rank, batches, dump, probe)


# name: (reference arguments (one process), the layout's extra arguments on 2 ranks); the 2-layer debug flavors
LAYOUTS = {
    # the dense flavor's QK-norms on the local heads
    "tp2": (_args("debugmodel_L2"), ["--parallelism.tp", "2"]),
    # the MoE flavor sharded by FSDP (experts sharded on the expert dimension), per-op activation checkpointing
    "moe_fsdp2_ac": (_args("debugmodel_moe_L2", "--training.local_batch_size", "4"),
                     ["--parallelism.dp_shard", "2", "--activation_checkpoint.mode", "selective"]),
    # the MoE flavor on two pipeline stages, and with each sequence split over two ranks
    "moe_pp2": (_args("debugmodel_moe_L2"), ["--parallelism.pp", "2", "--parallelism.pp_schedule", "1F1B"]),
    "moe_cp2": (_args("debugmodel_moe_L2"), ["--parallelism.cp", "2"]),
    # the auxiliary loss trained on both stages (the first stage's layers too); its reference takes the
    # pipeline's 2 microbatches as 2 accumulation steps, whose statistics it is computed on
    "moe_pp2_aux": (_args("debugmodel_moe_L2", "--model.moe_aux_loss_coeff", "0.5"),
                    ["--parallelism.pp", "2", "--parallelism.pp_schedule", "1F1B"]),
    # tied embeddings: one parameter in FSDP's root unit, initialized once; under TP one parameter sharded on the
    # vocabulary, with the logits and with the output fused into the loss
    "tied_fsdp2": (_args("debugmodel_L2", "--training.local_batch_size", "4", model=TIED),
                   ["--parallelism.dp_shard", "2"]),
    "tied_tp2": (_args("debugmodel_L2", model=TIED), ["--parallelism.tp", "2"]),
    "tied_tp2_fused_loss": (_args("debugmodel_L2", model=TIED), ["--parallelism.tp", "2",
                                                                 "--training.loss_chunk_tokens", "100"]),
    # on two pipeline stages: the last stage's copy of the embedding, both gradients summed (QK-norms on stage 2)
    "tied_pp2": (_args("debugmodel_L2", model=TIED), ["--parallelism.pp", "2", "--parallelism.pp_schedule", "1F1B"]),
}
REFERENCES = {"moe_pp2_aux": [*LAYOUTS["moe_pp2_aux"][0], "--training.local_batch_size", str(GLOBAL // 2),
                               "--training.global_batch_size", str(GLOBAL)]}  # else the layout's, on one process
PROBES = {"moe_pp2_aux": moe_log, "tp2": qk_norm_layout, "tied_fsdp2": tied_weight, "tied_tp2": tied_weight, "tied_tp2_fused_loss": tied_weight}


def test_layouts_match_one_process(tmp_path):
    """On 2 gloo ranks (CPU): the dense debug flavor (QK-norm, heads 64 wide) on TP 2, the MoE one on FSDP 2 with
    per-op activation checkpointing, PP 2 and CP 2, and the dense one with tied embeddings on FSDP 2, TP 2 and PP 2
    each give the losses and gradient norms of every step, and the first step's gradients of every parameter, of
    one process; the QK-norm weights are replicated on the TP mesh, and a tied weight stays one parameter."""
    from engine.config import parse_args

    register_tied()
    batches = global_batches(GLOBAL, STEPS)
    references, runs = {}, {}
    for name, (args, _) in LAYOUTS.items():
        # one process takes the whole global batch: local_batch_size = GLOBAL (the last one given wins)
        argv = REFERENCES.get(name, [*args, "--training.local_batch_size", str(GLOBAL)])
        key = repr(parse_args(argv))  # the tied layouts share one reference run
        if key not in runs:
            runs[key] = run_layout(argv, 1, 0, batches, str(tmp_path / f"ref_{name}"),
                                   moe_log if name == "moe_pp2_aux" else None)
        references[name] = runs[key]
        assert references[name]["losses"][-1] < references[name]["losses"][0], name
    assert parse_args(LAYOUTS["tied_fsdp2"][0]).model.name == TIED
    jobs = {name: ([*args, *extra], batches, str(tmp_path / name), PROBES.get(name))
            for name, (args, extra) in LAYOUTS.items()}
    results = run_jobs(2, _layout_job, jobs, str(tmp_path / "w2"))
    shutil.rmtree(tmp_path)
    for name, result in results.items():
        reference = references[name]
        assert "error" not in result, (name, result.get("error"))
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5), name
        assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5), name
        grads = dict(result["grads"])
        copy = None
        if name.startswith("tied"):  # the last stage's copy holds the tied weight's whole gradient
            copy = grads.pop("output.weight", None)
            assert (copy is not None) == (name == "tied_pp2"), name
        assert set(grads) == set(reference["grads"]), name
        if copy is not None:
            grads["tok_embeddings.weight (the copy)"] = copy
        for key, g in grads.items():
            want = reference["grads"][key.split(" ")[0]]
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name} {key}: {m}")
    tp2 = results["tp2"]
    assert any("q_norm" in k for k in tp2["grads"])
    assert tp2["built"]["wq"] == {"tp": "Shard(0)"} and tp2["built"]["wo"] == {"tp": "Shard(1)"}
    assert tp2["probe"] == {"weight": ["Replicate"], "mesh": ["tp"]}
    moe = results["moe_fsdp2_ac"]
    assert moe["built"]["checkpointed"] == moe["built"]["blocks"] == 2 and moe["built"]["dtensor_params"]
    assert any("experts.w1" in k for k in moe["grads"])
    assert results["moe_pp2_aux"]["losses"][-1] != results["moe_pp2"]["losses"][-1]  # the auxiliary loss trained
    # logged as the mean over both stages' layers and the 2 microbatches, as one process logs it
    logged, one = results["moe_pp2_aux"]["probe"], references["moe_pp2_aux"]["probe"]
    assert logged["moe_aux_loss"] == pytest.approx(one["moe_aux_loss"], rel=1e-5) and len(logged["expert_load"]) == 1
    for name in ("tied_fsdp2", "tied_tp2", "tied_tp2_fused_loss"):
        assert "output.weight" not in results[name]["grads"], name  # parameters() holds the tied weight once
        assert results[name]["probe"]["shared"], name
    assert results["tied_fsdp2"]["built"]["dtensor_params"]
    assert results["tied_tp2"]["probe"]["placements"] == [str(Shard(0))]  # on the vocabulary


def test_compiled_moe_blocks_under_per_op_checkpointing_match_eager(tmp_path):
    """A MoE block records its auxiliary loss and expert counts in its forward and trains the auxiliary loss
    through its output: compiled inside per-op checkpointing (parallelize/compile.py lets the recompute skip the
    counts) it trains as the eager model does. Dynamo and AOT autograd trace it (aot_eager: the recompute is
    AOT autograd's partition; without the setting Dynamo refuses the trace); test_moe compiles the layer with
    Inductor."""
    batches = global_batches(GLOBAL, 3)
    args = _args("debugmodel_moe_L2", "--model.moe_aux_loss_coeff", "0.5")
    eager = run_layout(args, 1, 0, batches, str(tmp_path / "eager"))
    compiled = run_layout([*args, *AOT_EAGER, "--activation_checkpoint.mode", "selective"], 1, 0, batches,
                          str(tmp_path / "compiled"))
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert compiled["grad_norms"] == pytest.approx(eager["grad_norms"], rel=1e-5)


def test_layouts_the_family_cannot_be_split_by_are_refused():
    """MoE under TP alone is refused; the tied 0.6B splits into pipeline stages (a copy of the embedding on the last)."""
    from engine.config import ConfigError, parse_args
    from engine.config.validation import validate

    with pytest.raises(ConfigError, match="^parallelism.tp: qwen3/debugmodel_moe "):
        validate(parse_args(["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--parallelism.tp", "2"]), 2)
    validate(parse_args(["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--parallelism.dp_shard", "2"]),
             2)
    assert validate(parse_args(["--model.name", "qwen3", "--model.flavor", "0.6B", "--parallelism.pp", "2"]),
                    2).dims.pp == 2
