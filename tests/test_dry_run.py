"""Dry runs at scale (fake process group, meta device) and the memory estimate they print."""

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import time
import types

import pytest
import torch

from engine.config import parse_args
from tools import dry_run, memory
from models.llama3.flavors import llama3_flavors
from models.llama3.model import Transformer, TransformerBlock, num_params, precompute_rope_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_dry(ngpu: int, *argv: str) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, DRY_RUN="1", NGPU=str(ngpu), PYTHON=sys.executable)
    start = time.perf_counter()
    proc = subprocess.run(["./run_train.sh", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # a hang guard, not a speed bar (speed is measured outside the tests)
    return proc, time.perf_counter() - start


def table_rows(out: str) -> list[list[str]]:
    """The rows of the per-rank table (lines starting with a pp rank number)."""
    lines = out.split("pp_rank", 1)[1].splitlines()[1:]
    return [line.split() for line in lines if re.match(r"\s*\d+\s+\d+\s", line)]


def test_dry_run_405b_on_16384_ranks():
    """The shipped config as it is, on a machine without its tokenizer folder (noted, not fatal). The design's
    bar (under a minute) is a benchmark's to check: the time is only printed here (pytest -s shows it)."""
    proc, seconds = run_dry(16384, "--config", "train_configs/llama3_405b.toml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "note: model.hf_assets_path './assets/hf/Llama-3.1-405B' not found" in out
    assert "mesh: pp 8 x dp_replicate 1 x dp_shard 256 x cp 1 x tp 8 = 16384 ranks" in out
    assert "views: dp 256, dp_shard_cp 256, dp_cp 256, tp 8, cp 1, pp 8; FSDP mesh: dp_shard 256" in out
    # Read from the built modules of pipeline stage 0 (15 blocks and the stage's root as FSDP units; a pipeline
    # stage keeps its parameters gathered from its forward to its backward).
    assert ("plan (rank 0): FSDP2 on 16 units (none resharded after forward); 15 modules compiled; 15 of 15 blocks "
            "checkpointed whole") in out
    rows = table_rows(out)
    assert [int(r[0]) for r in rows] == list(range(8))
    assert [int(r[1]) for r in rows] == [2048 * i for i in range(8)]  # one rank per pipeline stage
    assert [r[3] for r in rows] == ["15"] + ["16"] * 6 + ["15"]  # 126 layers, lighter first and last stages
    assert "warning" not in out  # built shard sizes == the formula's
    assert all(r[-1] == "yes" for r in rows)  # the shipped layout fits 80 GiB
    print(f"dry run of llama3_405b.toml on 16,384 ranks: {seconds:.1f} s")


def test_dry_run_qwen3_235b_a22b_on_1024_ranks_counts_the_experts_each_rank_holds():
    """The shipped MoE config: 128 experts spread over ep 8 and sharded by FSDP over the 128 ranks holding the same
    ones; the shards built match the formula's (no warning), and the layout fits."""
    proc, seconds = run_dry(1024, "--config", "train_configs/qwen3_235b_a22b.toml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "mesh: pp 1 x dp_replicate 1 x dp_shard 1024 x cp 1 x tp 1 (ep 8) = 1024 ranks" in out
    assert "model: 235.09B parameters" in out
    rows = table_rows(out)
    assert len(rows) == 1 and rows[0][3] == "94" and rows[0][-1] == "yes"
    # fp32 weights: 235B / 1024 ranks, the experts (2.4B per block) as much as the rest
    assert float(rows[0][4]) == pytest.approx(235.09e9 * 4 / 1024 / 1024**3, rel=0.02)
    assert "warning" not in out
    print(f"dry run of qwen3_235b_a22b.toml on 1,024 ranks: {seconds:.1f} s")


@pytest.mark.parametrize("ngpu, config, argv, layout", [
    (8, "llama3_8b.toml", [], "pp 1 x dp_replicate 1 x dp_shard 8 x cp 1 x tp 1"),
    (256, "llama3_70b.toml", ["--parallelism.tp", "8", "--parallelism.pp", "4", "--parallelism.cp", "2",
                              "--training.local_batch_size", "8", "--parallelism.pp_schedule", "Interleaved1F1B",
                              "--activation_checkpoint.mode", "selective"],
     "pp 4 x dp_replicate 1 x dp_shard 4 x cp 2 x tp 8"),
    # A stage without layers (nothing to compare with the formula's block) and a CSV schedule, named as such.
    (2, "debug_model.toml", ["--parallelism.pp", "2", "--parallelism.pp_layers_per_stage", "6,0",
                             "--parallelism.pp_schedule_csv", "tests/data/pp2_1f1b.csv"],
     "pp 2 x dp_replicate 1 x dp_shard 1 x cp 1 x tp 1"),
])
def test_dry_run_prints_mesh_and_table(ngpu, config, argv, layout):
    proc, seconds = run_dry(ngpu, "--config", f"train_configs/{config}", "--model.hf_assets_path=", *argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"mesh: {layout} = {ngpu} ranks" in out
    rows = table_rows(out)
    pp = int(layout.split()[1])
    assert len(rows) == pp
    assert "largest peak:" in out and "warning" not in out
    if pp == 4:  # Interleaved1F1B: two stages per rank, r and r + 4
        assert [r[2] for r in rows] == ["0,4", "1,5", "2,6", "3,7"]
    if "--parallelism.pp_schedule_csv" in argv:
        assert "pipeline from pp2_1f1b.csv (1F1B placement), 2 microbatches" in out, out
    print(f"dry run of {config} on {ngpu} ranks: {seconds:.1f} s")


def test_dry_run_user_error_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "16384")
    rc = dry_run.main(["--config", "train_configs/llama3_405b.toml", "--model.hf_assets_path=",
                       "--parallelism.tp", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: parallelism."), err
    for bad in ("0", "-3", "eight"):  # NGPU (run_train.sh passes it as WORLD_SIZE)
        monkeypatch.setenv("WORLD_SIZE", bad)
        assert dry_run.main(["--config", "train_configs/debug_model.toml"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: NGPU (WORLD_SIZE): must be a positive number of processes, got '{bad}'"], err
    # float8 filters are checked against the model's layers (a misspelled one would convert that layer)
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert dry_run.main(["--config", "train_configs/llama3_8b.toml", "--model.hf_assets_path=", "--float8.enable",
                         "--float8.filter_fqns", "output,attention.wkk"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("error: float8.filter_fqns: 'attention.wkk' names no linear"), err
    for bad in ("inf", "nan", "0", "lots"):  # the memory of one GPU
        monkeypatch.setenv("GPU_MEMORY_GIB", bad)
        assert dry_run.main(["--config", "train_configs/debug_model.toml"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: GPU_MEMORY_GIB: expected a positive number"), err


def test_dry_run_refuses_what_a_launch_refuses(monkeypatch, capsys):
    """A file a launch needs and that is missing: a real launch stops there, so does the dry run. (A missing
    tokenizer folder is only noted: the flavor gives the vocabulary; see the 405B test.)"""
    monkeypatch.setenv("WORLD_SIZE", "8")
    rc = dry_run.main(["--config", "train_configs/llama3_8b.toml", "--data.tokenizer", "/nonexistent/tokenizer.json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: data.tokenizer"), err


# --------------------------------------------------------------------------------------------------------
# The memory model
# --------------------------------------------------------------------------------------------------------


def test_stage_params_count_the_model():
    """One stage without TP/FSDP holds every parameter; the measured sizes of a real (meta) model agree."""
    args = dataclasses.replace(llama3_flavors["8B_L2"])
    shape = memory.ModelShape.from_args(args)
    stage = memory.stage_params(shape, 0, 1, args.n_layers, tp=1, fsdp_shard=1)
    assert stage.total.local == stage.total.tp == num_params(args)
    with torch.device("meta"):
        model = Transformer(args)
    assert dry_run.measure_stage(model, 0) == stage
    # TP 8 and FSDP 16: wq keeps 4096 / 8 = 512 rows, of which a rank stores 32.
    sharded = memory.stage_params(shape, 0, 1, args.n_layers, tp=8, fsdp_shard=16)
    assert sharded.block.tp * 8 == stage.block.tp + 7 * 2 * 4096  # the two norms are replicated over TP
    assert sharded.block.local == sum(-(-rows // 16) * cols for rows, cols, _ in memory.block_tensors(shape, 8))


def _saved_activation_bytes(block, x, rope_table, ctx) -> int:
    """Bytes of the distinct tensors autograd saves in a block's forward, weights (and their casts) and the RoPE
    table (a buffer of the model, saved as its cosines and sines) excluded."""
    param_shapes = {tuple(p.shape) for p in block.parameters()} | {tuple(p.shape)[::-1] for p in block.parameters()}
    storages = {}
    table = rope_table.untyped_storage().data_ptr()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr != table and tuple(t.shape) not in param_shapes:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx():
        block(x, rope_table)
    return sum(storages.values())


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_block_activation_formula_matches_autograd(precision):
    """The 'none' formula against the tensors autograd really keeps: fp32, and bf16 autocast (on CPU)."""
    args = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=512, n_heads=8, n_kv_heads=2)
    block = TransformerBlock(0, args)
    B, S = 3, 32  # T = 96 tokens: no activation has a weight's shape
    x = torch.randn(B, S, args.dim, requires_grad=True)
    freqs = precompute_rope_table(args.head_dim, S, args.rope_theta)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bfloat16" else contextlib.nullcontext
    measured = _saved_activation_bytes(block, x, freqs, ctx)
    shape = memory.ModelShape.from_args(args)
    lay = memory.RankLayout(S, B, 1, 1, 1, 1, 0, "", 1, 1, False, "default", False, False, "none", "op",
                            memory.precision_for(precision, data_parallel=False))
    formula = memory.block_bytes_per_token(shape, lay, "none") * B * S
    # On CPU RMSNorm is the composite op, which also keeps its normalized fp32 output (CUDA's fused kernel
    # keeps the input and rstd only, as the formula says).
    cpu_norms = 2 * args.dim * 4 * B * S
    assert measured == formula + cpu_norms


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["none", "selective", "selective_alternate"])
def test_compiled_block_formula_matches_autograd(precision, mode):
    """compile.enable: what inductor's partitioner keeps for backward, no AC and per-op AC with all or every
    other matmul kept (the compiled graph saves through autograd, so the hooks see it all, the SAC policy's
    choices included)."""
    from parallelize.activation_checkpoint import apply_ac

    torch._dynamo.reset()
    args = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=512, n_heads=8, n_kv_heads=2)
    blocks = torch.nn.ModuleDict({"0": TransformerBlock(0, args)})
    mode, _, op_matmuls = mode.partition("_")
    if mode == "selective":
        apply_ac(blocks, mode, "op", op_matmuls or "all", traced=True)
    block = torch.compile(blocks["0"], fullgraph=True)
    B, S = 3, 32
    x = torch.randn(B, S, args.dim, requires_grad=True)
    freqs = precompute_rope_table(args.head_dim, S, args.rope_theta)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bfloat16" else contextlib.nullcontext
    measured = _saved_activation_bytes(block, x, freqs, ctx)
    shape = memory.ModelShape.from_args(args)
    lay = memory.RankLayout(S, B, 1, 1, 1, 1, 0, "", 1, 1, False, "default", False, False, mode, "op",
                            memory.precision_for(precision, data_parallel=False), compiled=True,
                            ac_op_matmuls=op_matmuls or "all")
    kind = "op" if mode == "selective" else "none"
    assert measured == memory.block_bytes_per_token(shape, lay, kind) * B * S
    eager = dataclasses.replace(lay, compiled=False)
    assert memory.block_bytes_per_token(shape, lay, kind) < memory.block_bytes_per_token(shape, eager, kind)


def test_compiled_loss_keeps_the_logits_only():
    """compile.enable compiles the loss: it keeps the (bf16) logits and two fp32 numbers per token, where eager
    keeps two fp32 copies of the logits; the formula adds the logits' gradient, written in one kernel."""
    from models.loss import cross_entropy_sum

    torch._dynamo.reset()
    B, S, V = 3, 32, 4096
    logits = torch.randn(B, S, V, dtype=torch.bfloat16, requires_grad=True)
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() if t.is_floating_point() else 0
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.compile(cross_entropy_sum)(logits, torch.randint(0, V, (B, S)))
    args = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=V)
    lay = memory.RankLayout(S, B, 1, 1, 1, 1, 0, "", 1, 1, False, "default", False, False, "none", "op",
                            memory.precision_for("bfloat16", data_parallel=True), compiled=True)
    gradient = 2 * B * S * V
    assert sum(kept.values()) + gradient == memory.loss_bytes(memory.ModelShape.from_args(args), lay, B * S)


@pytest.mark.parametrize("op_matmuls", ["all", "alternate"])
def test_selective_op_formula_matches_the_policy(op_matmuls):
    """'op' keeps the block input and the outputs of the ops the policy saves (parallelize/activation_checkpoint.py):
    every matmul, or every other one."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import CheckpointPolicy

    from parallelize.activation_checkpoint import op_policy

    policy, forward = op_policy(op_matmuls), types.SimpleNamespace(is_recompute=False)

    class Record(TorchDispatchMode):
        bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if policy(forward, func, *args) == CheckpointPolicy.MUST_SAVE:
                first = out[0] if isinstance(out, (tuple, list)) else out
                Record.bytes += first.numel() * first.element_size()
                if func is not torch.ops.aten.mm.default:  # attention: the log-sum-exp too
                    Record.bytes += out[1].numel() * out[1].element_size()
            return out

    args = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=512, n_heads=8, n_kv_heads=2)
    block = TransformerBlock(0, args)
    B, S = 3, 32
    x = torch.randn(B, S, args.dim)
    with Record():
        block(x, precompute_rope_table(args.head_dim, S, args.rope_theta))
    shape = memory.ModelShape.from_args(args)
    lay = memory.RankLayout(S, B, 1, 1, 1, 1, 0, "", 1, 1, False, "default", False, False, "selective", "op",
                            memory.precision_for("float32", data_parallel=False), ac_op_matmuls=op_matmuls)
    block_input = args.dim * 4 * B * S
    assert Record.bytes + block_input == memory.block_bytes_per_token(shape, lay, "op") * B * S


def test_alternate_policy_is_torchtitans_for_float8_matmuls():
    """op_matmuls = alternate is torchtitan 0.2.2's per-op policy: every other aten.mm kept, and the float8
    matmuls (_scaled_mm, what torchao's Float8Linear runs on Hopper) neither counted nor kept; op_matmuls = all
    keeps them."""
    from torch.utils.checkpoint import CheckpointPolicy

    from parallelize.activation_checkpoint import op_policy

    ctx = types.SimpleNamespace(is_recompute=False)
    mm, scaled_mm = torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default
    alternate = op_policy("alternate")
    got = [alternate(ctx, op) for op in (scaled_mm, mm, scaled_mm, mm, mm, scaled_mm)]
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert got == [recompute, save, recompute, recompute, save, recompute]
    assert op_policy("all")(ctx, scaled_mm) == save and op_policy("all")(ctx, mm) == save


def test_fused_loss_formula_matches_what_autograd_keeps():
    """training.loss_chunk_tokens: the fused loss keeps the hidden state's and the weight's gradients for the
    backward (as the formula says, beside one chunk's transient logits), not the [tokens, vocabulary] logits."""
    from models.loss import linear_cross_entropy_sum

    args = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=512)
    B, S, chunk = 3, 32, 40
    h = torch.randn(B, S, args.dim, requires_grad=True)
    w = torch.randn(args.vocab_size, args.dim, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        linear_cross_entropy_sum(h, w, torch.randint(0, 512, (B, S)), chunk)
    shape = memory.ModelShape.from_args(args)
    lay = memory.RankLayout(S, B, 1, 1, 1, 1, 0, "", 1, 1, False, "default", False, False, "none", "op",
                            memory.precision_for("float32", data_parallel=False), loss_chunk_tokens=chunk)
    transient = chunk * args.vocab_size * (4 + 4)
    assert sum(kept) == memory.loss_bytes(shape, lay, B * S) - transient


def test_fused_loss_lowers_the_estimated_peak_at_a_large_vocabulary():
    base = ["--model.flavor", "8B_L8", "--training.seq_len", "8192", "--activation_checkpoint.mode", "selective"]
    plain = _peak(base)[0].estimate.moments["loss"]
    fused = _peak(base + ["--training.loss_chunk_tokens", "2048"])[0].estimate.moments["loss"]
    # 12 B x 8192 tokens x 128,256 (12.6 GB) against one 2,048-token chunk, the hidden state's and the fp32
    # output weight's gradients (1.6 + 0.07 + 2.1 GB).
    assert plain.other - fused.other > 8e9


def test_fused_loss_under_tp_counts_one_vocabulary_slice():
    base = ["--model.flavor", "8B_L8", "--training.seq_len", "8192", "--activation_checkpoint.mode", "selective",
            "--parallelism.tp", "2"]
    loss_parallel = _peak(base, world=2)[0].estimate.moments["loss"].other
    fused = _peak(base + ["--training.loss_chunk_tokens", "2048"], world=2)[0].estimate.moments["loss"].other
    whole = _peak(base[:-2] + ["--training.loss_chunk_tokens", "2048"])[0].estimate.moments["loss"].other
    # loss parallel: 16 B x 8192 tokens x 64,128 (8.4 GB); fused: a chunk's logits and the weight's gradient
    # over 64,128 rows (0.8 + 1.1 GB) and the whole hidden state's gradient (0.07 GB), about half of tp 1's.
    assert fused < loss_parallel / 4
    assert whole / 2 < fused < whole / 1.9


def _peak(argv, world=1):
    cfg = parse_args(["--config", "train_configs/llama3_8b.toml", "--model.hf_assets_path=", *argv])
    dims = memory.validate_layout(cfg, world)
    return memory.analytic_rows(cfg, dims, memory.model_shape(cfg))


def test_estimate_follows_checkpointing_sequence_and_pipeline():
    base = ["--model.flavor", "8B_L8", "--training.seq_len", "8192"]
    none, op, full = (_peak(base + ["--activation_checkpoint.mode", m])[0].estimate for m in ("none", "selective", "full"))
    assert none.peak > op.peak > full.peak
    assert none.params == op.params == full.params  # 2.8B parameters in fp32
    assert abs(none.params / 4 - 2_795_000_000) < 1_000_000
    # Saved activations grow linearly with the sequence (no S x S term with flash attention).
    short = _peak(["--model.flavor", "8B_L8", "--training.seq_len", "4096"])[0].estimate
    assert none.moments["loss"].activations == pytest.approx(2 * short.moments["loss"].activations)
    # 1F1B: the first stage holds pp microbatches in flight, the last one.
    rows = _peak(["--parallelism.pp", "4", "--training.local_batch_size", "4", "--parallelism.dp_shard", "2"], 8)
    first, last = rows[0].estimate.moments["loss"], rows[-1].estimate.moments["loss"]
    assert first.activations > 3 * last.activations


def test_fsdp_estimate_ends_with_the_roots_reduce_scatter():
    """FSDP2 frees the root's unsharded params before its reduce-scatter, and the reduce-scatter's output is the
    root's sharded gradient: the end of backward holds the other gradients and the larger of (unsharded
    gradients + fp32 input) and (input + output). FSDP2 on the one H100 (8B_L8, seq 8192, compile, per-op AC)
    logged 45.70 GiB of peak active memory (bench/results/2026-11-25-h100.csv)."""
    argv = ["--config", "train_configs/debug_model.toml", "--model.flavor", "8B_L8", "--training.seq_len", "8192",
            "--training.local_batch_size", "1", "--compile.enable", "--activation_checkpoint.mode", "selective",
            "--parallelism.fsdp_single_rank"]
    cfg = parse_args(argv)
    (row,) = memory.analytic_rows(cfg, memory.validate_layout(cfg, 1), memory.model_shape(cfg))
    est = row.estimate
    root = sum((s.root for s in row.stages), memory.PartSizes())
    end = est.moments["backward end"]
    assert end.grads == est.grads - 4 * root.local and end.working == 0
    assert end.other == max((2 + 4) * root.tp, (4 + 4) * root.tp)  # one rank: sharded = unsharded
    assert est.phase == "backward end" and est.peak / 2**30 == pytest.approx(45.70, rel=0.01)


@pytest.mark.parametrize("config", ["debug_model.toml", "qwen3_moe_debug.toml"])
def test_one_gpu_estimate_holds_the_gradients_of_the_weights_the_trainer_splits(config):
    """On one GPU (split bf16 weights, the default) the estimate's gradient bytes are those of the model as the
    trainer splits it: bf16 for every weight split_matmul_weights stores in bf16 (a MoE's stacked experts too),
    fp32 for the others."""
    from models.registry import get_model_spec
    from parallelize.bf16_weights import split_matmul_weights

    cfg = parse_args(["--config", f"train_configs/{config}"])
    shape = memory.model_shape(cfg)
    dims = memory.validate_layout(cfg, 1)
    estimate = memory.analytic_rows(cfg, dims, shape)[0].estimate
    assert memory.layout_precision(cfg, dims).split_weights
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_cls(dataclasses.replace(spec.flavors[cfg.model.flavor], vocab_size=shape.vocab_size))
    lows = split_matmul_weights([model])
    assert estimate.grads == sum(p.numel() * (2 if p in lows else 4) for p in model.parameters())
    assert any(p.ndim == 3 for p in lows) == bool(shape.experts)


def test_fsdp_estimate_on_split_shards_keeps_bf16_gradients():
    """training.fsdp_bf16_weights: the same parameter bytes (bf16 + low half), the sharded gradients in bf16."""
    argv = ["--config", "train_configs/debug_model.toml", "--model.flavor", "8B_L8", "--training.seq_len", "8192",
            "--training.local_batch_size", "1", "--compile.enable", "--activation_checkpoint.mode", "selective",
            "--parallelism.fsdp_single_rank"]
    plain, split = (memory.analytic_rows(cfg, memory.validate_layout(cfg, 1), memory.model_shape(cfg))[0].estimate
                    for cfg in (parse_args(argv), parse_args([*argv, "--training.fsdp_bf16_weights"])))
    assert split.params == plain.params and split.optimizer == plain.optimizer
    assert split.grads == plain.grads / 2
    assert split.peak < plain.peak - 1.5 * 2**30


def test_memory_command(capsys):
    rc = memory.main(["--config", "train_configs/llama3_8b.toml", "--model.flavor", "8B_L8",
                      "--activation_checkpoint.mode", "full", "--gpu-memory-gib", "80"])
    out = capsys.readouterr().out
    assert rc == 0 and "fits in 80 GiB" in out and len(table_rows(out)) == 1
    rc = memory.main(["--config", "train_configs/llama3_8b.toml", "--ngpu", "6", "--parallelism.tp", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: parallelism.dp_shard"), err
    # A float8 filter that leaves no layer to convert: refused as a launch refuses it. No --config: named.
    for argv, message in (
        (["--config", "train_configs/llama3_8b.toml", "--float8.enable", "--float8.filter_fqns",
          "attention,feed_forward"], "error: float8.filter_fqns: no linear layer would run in float8"),
        (["--parallelism.tp", "2"], "error: --config: give the config file of the run to estimate"),
    ):
        rc = memory.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith(message), err


def test_dry_run_validates_for_the_cluster_gpus_not_this_cpu():
    """float8, flash_attn and async TP are refused by a launch on this CPU machine, but a dry run plans for
    Hopper GPUs: the same config is validated, built and tabled."""
    argv = ["--config", "train_configs/llama3_8b.toml", "--model.hf_assets_path=", "--float8.enable",
            "--parallelism.tp", "2", "--compile.enable", "--parallelism.enable_async_tp", "--model.attn", "sdpa"]
    env = dict(os.environ, NGPU="8", PYTHON=sys.executable)
    launch = subprocess.run(["./run_train.sh", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert launch.returncode == 2 and launch.stderr.startswith("error: parallelism.enable_async_tp: needs"), launch.stderr
    proc, _ = run_dry(8, *argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "validated for CUDA GPUs of compute capability 9.0 with flash-attn" in proc.stdout
    assert "mesh: pp 1 x dp_replicate 1 x dp_shard 4 x cp 1 x tp 2 = 8 ranks" in proc.stdout
    assert "FutureWarning" not in proc.stderr


def test_shared_empty_fsdp_chunks_give_torch_shapes():
    """The dry run's padding of FSDP2's chunks (one shared empty tensor on meta) gives the shapes torch's own
    gives, leaves other devices to torch, and is undone afterwards."""
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    from tools.dry_run import shared_empty_fsdp_chunks

    original = _fsdp_param._chunk_with_empty
    meta = torch.empty(5, 3, device="meta")
    want = [c.shape for c in original(meta, 8, 0)]
    with shared_empty_fsdp_chunks():
        got = [c.shape for c in _fsdp_param._chunk_with_empty(meta, 8, 0)]
        on_cpu = [c.shape for c in _fsdp_param._chunk_with_empty(torch.empty(5, 3), 8, 0)]
    assert got == want == on_cpu and len(got) == 8 and got[-1] == torch.Size([0])
    assert _fsdp_param._chunk_with_empty is original


def test_autocast_cache_keeps_checkpointed_weight_copies_for_the_region():
    """The premise of the PP estimate below: inside one autocast region a checkpointed block's recomputation
    finds its weight's bf16 copy still cached (no second cast), so the copy lives as long as the region; a
    region per forward (no PP) casts again."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    class CountCasts(TorchDispatchMode):
        casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and args[0] is w and kwargs.get("dtype") == torch.bfloat16:
                CountCasts.casts += 1
            return func(*args, **kwargs)

    w = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True)

    def step(one_region: bool) -> int:
        CountCasts.casts = 0
        with CountCasts():
            region = torch.autocast("cpu", dtype=torch.bfloat16)
            region.__enter__()
            y = checkpoint(lambda h: torch.relu(h @ w), x, use_reentrant=False)
            if not one_region:
                region.__exit__(None, None, None)
            y.float().sum().backward()
            if one_region:
                region.__exit__(None, None, None)
        return CountCasts.casts

    assert step(one_region=True) == 1
    assert step(one_region=False) == 2


def test_estimate_counts_the_pipeline_steps_autocast_cache():
    """PP without FSDP runs each step in one autocast region: every matmul weight's bf16 copy is counted, also
    the checkpointed blocks' (one copy, shared by the microbatches); compiled blocks cast in their graphs."""
    argv = ["--model.flavor", "8B_L8", "--training.seq_len", "4096", "--activation_checkpoint.mode", "full",
            "--parallelism.pp", "2", "--training.local_batch_size", "2"]
    rows = _peak(argv, world=2)
    for row in rows:
        est = row.estimate
        all_mm = sum(s.block.matmul_tp * s.layers + (s.final.matmul_tp if s.final else 0) for s in row.stages)
        assert est.moments["loss"].working == 2 * all_mm
        assert est.moments["recompute"].working == 2 * all_mm
    compiled = _peak(argv + ["--compile.enable", "true"], world=2)
    last = compiled[-1]
    assert last.estimate.moments["loss"].working == 2 * last.stages[-1].final.matmul_tp  # the output's only
    # No PP: a region per forward; checkpointed blocks cast again when recomputed.
    single = _peak(argv[:-4] + ["--training.no-bf16_weights"])[0]
    assert single.estimate.moments["loss"].working == 2 * single.stages[0].final.matmul_tp
    # The default on one GPU, split bf16 weights: no copies at all, bf16 gradients of the matmul weights.
    split = _peak(argv[:-4])[0]
    assert all(m.working == 0 for m in split.estimate.moments.values())
    mm = sum(s.block.matmul_tp * s.layers + (s.final.matmul_tp if s.final else 0) for s in split.stages)
    assert split.estimate.grads == single.estimate.grads - 2 * mm
