"""float8 training (torchao, emulated on CPU): which layers are converted, the TP styles they get, the config
errors, the scale precomputation after the optimizer step, the loss against float32 over 200 steps, and
FSDP 2 x TP 2 on gloo against a single process.

"float8 tolerance": float8 rounds each element to 3 (e4m3) or 2 (e5m2, gradients) mantissa bits, and an
element's rounding flips wherever its input moves across a rounding boundary, so two float8 runs that differ
only in float32 rounding (another reduction order under TP, per-rank activation scales under FSDP) drift
apart at float8 level, not float32 level: through the 6-layer backward pass the first-step gradients of
FSDP 2 x TP 2 and of one process differ by about as much as float8 differs from float32 (measured: 9% and 9%
overall), while their losses agree to 1e-3. The parity check therefore bounds losses, gradient norms and
gradients at float8 level, and checks that the parallel run really is float8 (its gradients are not
float32's).
"""

import json
import os
import shutil

import pytest
import torch
from torch import nn

from engine import train
from engine.config import Config, ConfigError, parse_args
from engine.config.validation import validate
from parallelize.float8 import (
    check_float8_supported,
    convert_float8,
    float8_after_optimizer_step,
    is_float8_linear,
    module_filter,
)
from tests.parallel_harness import SHALLOW, global_batches, run_layout, run_world

pytest.importorskip("torchao", reason="torchao is in the dev extra: pip install -e '.[dev]'")

F8 = ["--float8.enable", "--float8.emulate"]


def _meta_model(vocab: int = 2048):
    import dataclasses

    from models.llama3.flavors import llama3_flavors
    from models.llama3.model import Transformer

    with torch.device("meta"):
        return Transformer(dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=vocab))


# --------------------------------------------------------------------------------------------------------
# Conversion and the TP plan
# --------------------------------------------------------------------------------------------------------


def test_parallelize_converts_block_linears_but_not_the_output():
    from models.llama3.parallelize import parallelize_llama
    from parallelize.mesh import ParallelDims

    cfg = parse_args([*F8, "--float8.filter_fqns", "layers.1.attention.wk,feed_forward.w3"])
    model = _meta_model()
    parallelize_llama(model, ParallelDims.from_config(cfg.parallelism, 1), cfg, "cpu")
    converted = {name for name, m in model.named_modules() if is_float8_linear(m)}
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    skipped = {"output", "layers.1.attention.wk"} | {f"layers.{i}.feed_forward.w3" for i in range(6)}
    assert converted == linears - skipped
    assert len(converted) == 6 * 7 - 1 - 6
    assert type(model.output) is nn.Linear
    # The same weights under the same names: checkpoints and init do not see the swap.
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in _meta_model().named_parameters()}


def test_filter_skips_dimensions_float8_cannot_multiply():
    keep = module_filter(skip=[], filter_fqns=[])
    assert keep(nn.Linear(32, 64), "a")
    assert not keep(nn.Linear(24, 64), "a")  # in_features not a multiple of 16
    assert not keep(nn.Linear(32, 40), "a")
    assert not keep(nn.Embedding(32, 64), "a")
    keep_tp4 = module_filter(skip=[], filter_fqns=[], tp=4)
    assert not keep_tp4(nn.Linear(32, 128), "a")  # 8 input features per TP rank
    assert keep_tp4(nn.Linear(64, 128), "a")
    out = nn.Linear(32, 64)
    assert not module_filter(skip=[out], filter_fqns=[])(out, "output")
    assert not module_filter(skip=[], filter_fqns=["wk"])(nn.Linear(32, 64), "layers.0.attention.wk")


def test_tp_plan_gives_float8_styles_to_converted_layers_only():
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from models.llama3.parallelize import tp_plan_block

    model = _meta_model()
    convert_float8(model, emulate=True, filter_fqns=["feed_forward.w3"], skip=[model.output])
    block = model.layers["0"]
    plan = tp_plan_block(block, float8_comm=True)
    assert type(plan["attention"]) is PrepareFloat8ModuleInput  # wq, wk, wv all float8: cast once, gather fp8
    assert all(type(plan[f"attention.{w}"]) is Float8ColwiseParallel for w in ("wq", "wk", "wv"))
    assert type(plan["attention.wo"]) is Float8RowwiseParallel
    assert type(plan["feed_forward"]) is PrepareModuleInput  # w3 stays high precision
    assert type(plan["feed_forward.w1"]) is Float8ColwiseParallel
    assert type(plan["feed_forward.w3"]) is ColwiseParallel
    assert type(plan["feed_forward.w2"]) is Float8RowwiseParallel
    plain = tp_plan_block(block, float8_comm=False)  # rowwise recipe, or gloo (no float8 collectives)
    assert {type(s) for k, s in plain.items() if "." in k} == {ColwiseParallel, RowwiseParallel}


# --------------------------------------------------------------------------------------------------------
# Configuration errors
# --------------------------------------------------------------------------------------------------------


def test_float8_needs_float8_hardware_or_emulate():
    for capability in (None, (8, 0), (7, 5)):
        with pytest.raises(ConfigError, match=r"^float8\.enable: .*float8\.emulate = true"):
            check_float8_supported(emulate=False, capability=capability)
    check_float8_supported(emulate=False, capability=(9, 0))  # H100
    check_float8_supported(emulate=False, capability=(8, 9))  # Ada
    check_float8_supported(emulate=True, capability=None)


BAD_FLOAT8 = [
    (["--float8.recipe", "blockwise"], "float8.recipe"),
    ([*F8, "--float8.recipe", "rowwise", "--float8.fsdp_float8_all_gather"], "float8.fsdp_float8_all_gather"),
    ([*F8, "--float8.precompute_scale"], "float8.precompute_scale"),
    # checked against the model's layers before anything is written: a misspelled layer name, and a filter
    # that leaves nothing in float8 (a silent no-op otherwise)
    ([*F8, "--float8.filter_fqns", "attention.wkk"], "float8.filter_fqns: 'attention.wkk' names no linear layer"),
    ([*F8, "--float8.filter_fqns", "layers"], "float8.filter_fqns: no linear layer would run in float8"),
]
if not torch.cuda.is_available():
    BAD_FLOAT8.append((["--float8.enable"], "float8.emulate"))


@pytest.mark.parametrize("argv, field", BAD_FLOAT8, ids=[f for _, f in BAD_FLOAT8])
def test_bad_float8_config_gives_one_error_line(argv, field, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dump = tmp_path / "run"
    rc = train.main(["--job.dump_folder", str(dump), *argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(lines) == 1 and lines[0].startswith("error: float8."), lines
    assert field in lines[0]
    assert not dump.exists()


def test_empty_filter_name_is_refused():
    cfg = Config()
    cfg.float8.filter_fqns = ["output", " "]
    with pytest.raises(ConfigError, match="float8.filter_fqns"):
        validate(cfg)


# --------------------------------------------------------------------------------------------------------
# Scales precomputed after the optimizer step (FSDP float8 all-gather)
# --------------------------------------------------------------------------------------------------------


def _weight_scales(model_parts):
    """(precomputed scale, the scale of the current weight) of every FSDP float8 weight."""
    from torch.distributed.tensor import DTensor

    out = []
    for part in model_parts:
        for m in part.modules():
            if is_float8_linear(m):
                assert isinstance(m.weight, DTensor)
                local = m.weight._local_tensor
                fresh = torch.finfo(torch.float8_e4m3fn).max / m.weight.full_tensor().abs().max().double()
                out.append((local._precomputed_scale, fresh.float()))
    return out


def test_scales_are_precomputed_after_each_optimizer_step(tmp_path):
    """The trainer calls float8_after_optimizer_step after optimizer.step(): with precompute_scale every FSDP
    float8 weight then holds the scale of its updated value (else FSDP computes it during the forward)."""
    from engine.distributed import World, destroy_distributed
    from engine.trainer import Trainer

    args = [*F8, "--float8.fsdp_float8_all_gather", "--float8.precompute_scale", "--parallelism.fsdp_single_rank",
            "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", "2",
            "--lr_scheduler.warmup_steps", "1", "--job.dump_folder", str(tmp_path)]
    cfg = parse_args(args)
    plan = validate(cfg)
    try:
        trainer = Trainer(cfg, World(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")), plan)
        assert all(scale is None for scale, _ in _weight_scales(trainer.model_parts))
        batch = next(iter(trainer.dataloader))
        for _ in range(2):
            trainer.train_step([batch])
            scales = _weight_scales(trainer.model_parts)
            assert len(scales) == 6 * 7
            assert all(s is not None for s, _ in scales), "the trainer must call float8_after_optimizer_step"
            for precomputed, fresh in scales:
                torch.testing.assert_close(precomputed, fresh, rtol=1e-6, atol=0)
        # The hook does nothing when precompute_scale is off.
        for part in trainer.model_parts:
            for m in part.modules():
                if is_float8_linear(m):
                    m.weight._local_tensor._precomputed_scale = None
        cfg.float8.precompute_scale = False
        float8_after_optimizer_step(trainer.model_parts, cfg.float8)
        assert all(s is None for s, _ in _weight_scales(trainer.model_parts))
        trainer.metrics.close()
    finally:
        destroy_distributed()


# --------------------------------------------------------------------------------------------------------
# Loss: float8 tracks float32 (acceptance 3 asks 200 steps of the default debug run: bench/float8_loss.py, its
# figures in docs/performance.md; CI runs 100 steps of a shorter sequence and batch)
# --------------------------------------------------------------------------------------------------------

# One 32-token sample per step on the 2-layer debug model: an emulated float8 step costs about the same at any
# small size (its casts of the weights dominate, per layer), so the batch is as small as keeps the loss meaningful.
# bench/float8_loss.py runs the default config (6 layers, 256 x 8) the same way.
TRACK = ["--model.flavor", "debugmodel_L2", "--training.steps", "100", "--training.seq_len", "32",
         "--training.local_batch_size", "1", "--metrics.log_freq", "10", "--lr_scheduler.warmup_steps", "10"]


def _losses(dump):
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_float8_tracks_float32_loss_over_100_steps(tmp_path, capsys):
    runs = {}
    for name, extra in (("fp32", []), ("float8", F8)):
        dump = str(tmp_path / name)
        assert train.main(["--job.dump_folder", dump, *TRACK, *extra]) == 0, capsys.readouterr().err
        runs[name] = _losses(dump)
    plain, f8 = runs["fp32"], runs["float8"]
    assert len(plain) == len(f8) == 11  # steps 1, 10, 20, ..., 100
    assert plain[-1] < plain[0] - 1.0  # it learned something
    assert f8[0] != plain[0]  # float8 really was on: rounding shows from the first step
    assert abs(f8[-1] - plain[-1]) / plain[-1] < 0.01, (plain, f8)


def test_rowwise_recipe_trains(tmp_path, capsys):
    """float8.recipe = rowwise, emulated on CPU in one process: the block linears are converted with torchao's
    rowwise config (per-row scales on both operands, power-of-2 scales; the output stays high precision), and a
    short run's loss is finite and falls. (Its multi-rank parity is not in CI: see FSDP2_TP2_FLOAT8.)"""
    import torch._inductor.config as inductor_config
    from torchao.float8.config import Float8LinearConfig, ScalingGranularity

    from models.llama3.parallelize import parallelize_llama
    from parallelize.mesh import ParallelDims

    rowwise = [*F8, "--float8.recipe", "rowwise"]
    before = inductor_config.emulate_precision_casts  # the rowwise plan sets it process-wide
    try:
        cfg = parse_args(rowwise)
        model = _meta_model()
        parallelize_llama(model, ParallelDims.from_config(cfg.parallelism, 1), cfg, "cpu")
        converted = [m for m in model.modules() if is_float8_linear(m)]
        assert len(converted) == 6 * 7 and type(model.output) is nn.Linear
        want = Float8LinearConfig.from_recipe_name("rowwise")
        for m in converted:
            assert m.config.emulate
            assert m.config.round_scales_to_power_of_2 == want.round_scales_to_power_of_2 is True
            for operand in ("cast_config_input", "cast_config_weight", "cast_config_grad_output"):
                assert getattr(m.config, operand).scaling_granularity is ScalingGranularity.AXISWISE, operand
        assert inductor_config.emulate_precision_casts is True

        dump = str(tmp_path / "rowwise")
        argv = ["--job.dump_folder", dump, *rowwise, "--training.steps", "12", "--training.seq_len", "32",
                "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2"]
        assert train.main(argv) == 0, capsys.readouterr().err
        losses = _losses(dump)
        print("rowwise losses:", losses)
        assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses))), losses
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    finally:
        inductor_config.emulate_precision_casts = before


# --------------------------------------------------------------------------------------------------------
# FSDP 2 x TP 2 and PP 2 x FSDP 2 on gloo against a single process (acceptance 4)
# --------------------------------------------------------------------------------------------------------

STEPS, GLOBAL = 5, 8
# tensorwise with every float8 piece that composes with FSDP and TP: weights all-gathered in float8 and their
# scales precomputed after each optimizer step; activations cast on their TP shards with scales all-reduced.
# (The rowwise recipe under FSDP 2 x TP 2 matched to a relative 3e-4 in losses when measured by hand; it is
# left out of CI for time.)
FSDP2_TP2_FLOAT8 = [*SHALLOW, "--training.local_batch_size", "4", "--parallelism.dp_shard", "2",
                    "--parallelism.tp", "2", *F8, "--float8.fsdp_float8_all_gather", "--float8.precompute_scale"]
PP2_FSDP2_FLOAT8 = [*SHALLOW, "--training.local_batch_size", "4", "--parallelism.pp", "2",
                    "--parallelism.dp_shard", "2", *F8, "--float8.fsdp_float8_all_gather", "--float8.precompute_scale"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _all_grads(result) -> torch.Tensor:
    return torch.cat([result["grads"][k].flatten() for k in sorted(result["grads"])])


@pytest.fixture(scope="module")
def float8_parity(tmp_path_factory):
    batches, out = global_batches(GLOBAL, STEPS), tmp_path_factory.mktemp("float8_parity")
    single = lambda name, *a: run_layout([*SHALLOW, "--training.local_batch_size", str(GLOBAL), *a], 1, 0,  # noqa: E731
                                         batches, str(out / name))
    fp32, f8 = single("fp32"), single("float8", *F8)
    layouts = {"fsdp2_tp2_float8": FSDP2_TP2_FLOAT8, "pp2_fsdp2_float8": PP2_FSDP2_FLOAT8}
    parallel = run_world(4, layouts, {name: batches for name in layouts}, str(out / "w4"), probe=float8_weight_scales)
    shutil.rmtree(out)  # the results are in memory
    return fp32, f8, parallel


def float8_weight_scales(trainer) -> list[list[tuple]]:
    """(the run_layout probe of the parity runs, after the first optimizer step; collective: every rank calls
    it.) Every rank's float8 weights: (name, the scale float8_after_optimizer_step precomputed on this rank,
    finfo.max / the whole weight's amax, finfo.max / this rank's local shard's amax), gathered to every rank."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    f8max = torch.finfo(torch.float8_e4m3fn).max
    mine = []
    for part in trainer.model_parts:
        for name, m in part.named_modules():
            if is_float8_linear(m):
                assert isinstance(m.weight, DTensor), name
                local = m.weight._local_tensor
                whole = f8max / m.weight.full_tensor().abs().max().double()  # all ranks of the weight's mesh
                shard = f8max / local.abs().max().double() if local.numel() else None
                mine.append((name, local._precomputed_scale, whole.float(), shard))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


@pytest.mark.parametrize("layout", ["fsdp2_tp2_float8", "pp2_fsdp2_float8"])
def test_precomputed_scales_are_those_of_the_whole_weight(float8_parity, layout):
    """The multi-rank runs' precomputed float8 weight scales are the whole weight's (amax all-reduced over every
    shard: FSDP's and TP's), on every rank, after the first optimizer step; the parity tolerances above are at
    float8 level and would not notice scales taken from each rank's local shard. The check can tell the two
    apart: many weights' shards have a smaller amax than the whole."""
    result = float8_parity[2][layout]
    assert "error" not in result, result.get("error")
    per_rank = result["probe"]
    assert len(per_rank) == 4
    # Each rank holds its stages' float8 linears: both blocks', or under PP 2 one stage's one block's.
    blocks_per_rank = 1 if layout.startswith("pp2") else 2
    assert [len(scales) for scales in per_rank] == [blocks_per_rank * 7] * 4
    local_differs = 0
    for rank, scales in enumerate(per_rank):
        for name, precomputed, whole, shard in scales:
            assert precomputed is not None, f"rank {rank} {name}: no precomputed scale"
            torch.testing.assert_close(precomputed.reshape(()), whole, rtol=1e-6, atol=0,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
            local_differs += shard is not None and not torch.isclose(shard.float(), whole, rtol=1e-6, atol=0)
    assert local_differs > 0.25 * sum(len(scales) for scales in per_rank), local_differs


def test_fsdp2_tp2_float8_matches_single_process(float8_parity):
    fp32, f8, parallel = float8_parity
    _check_float8_parity(fp32, f8, parallel["fsdp2_tp2_float8"])


def test_pp2_fsdp2_float8_matches_single_process(float8_parity):
    """float8 composes with pipeline stages too (each stage converts and all-gathers its own layers)."""
    fp32, f8, parallel = float8_parity
    _check_float8_parity(fp32, f8, parallel["pp2_fsdp2_float8"])


def _check_float8_parity(fp32, f8, result) -> None:
    assert "error" not in result, result.get("error")
    assert set(result["grads"]) == set(f8["grads"])  # every stage's, under pipeline parallelism
    # Rank 0 converted the same linears as one process (per block: the tolerances below would not notice a few
    # layers left in high precision).
    assert fp32["built"]["float8"] == 0
    per_block = f8["built"]["float8"] / f8["built"]["blocks"]
    assert per_block > 0 and result["built"]["float8"] == per_block * result["built"]["blocks"], result["built"]
    float8_error = _rel(_all_grads(f8), _all_grads(fp32))  # what float8 itself changes (measured 0.09)
    # The parallel run is float8 (its gradients are not float32's) ...
    assert _rel(_all_grads(result), _all_grads(fp32)) > 0.1 * float8_error
    # ... and stays within float8 tolerance of the single-process float8 run (measured: losses 1e-3,
    # gradients 0.09 overall and at most 0.19 in one tensor; gradient norms 3e-3 to 1.2e-2 on torch 2.13 and
    # 3.4e-2 to 3.8e-2 on torch 2.11 by step 5, where each layout's fp32 sums put other values across float8
    # rounding boundaries and the trajectories drift apart; the first step's norms agree to 4e-3 on both).
    assert result["losses"] == pytest.approx(f8["losses"], rel=3e-3)
    assert result["grad_norms"][0] == pytest.approx(f8["grad_norms"][0], rel=1e-2)
    assert result["grad_norms"] == pytest.approx(f8["grad_norms"], rel=6e-2)
    assert _rel(_all_grads(result), _all_grads(f8)) < 2 * float8_error
    for name, g in result["grads"].items():
        assert _rel(g, f8["grads"][name]) < 0.4, name
    assert result["losses"][-1] < result["losses"][0] - 0.5
