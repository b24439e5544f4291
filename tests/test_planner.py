"""The layout planner: only layouts that validate and fit, ranked by the cost model, the best as a TOML."""

import os
import subprocess
import sys

import pytest

from engine.config import ConfigError, parse_args
from tools import memory, planner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "train_configs", "llama3_8b.toml")


def _plan(gpus=8, gib=80.0, margin=0.1, batch=16, seq=8192, loss_chunk_tokens=2048):
    return planner.plan(parse_args(["--config", BASE]), gpus, seq, batch, gib, margin, planner.CostModel(),
                        loss_chunk_tokens)


def _assert_valid_and_fits(result, gpus, usable_gib):
    assert result.candidates
    for c in result.candidates:
        dims = memory.validate_layout(c.cfg, gpus)  # raises if validation would refuse it
        rows = memory.analytic_rows(c.cfg, dims, memory.model_shape(c.cfg))
        peak = max(r.estimate.peak for r in rows) / memory.GIB
        assert peak == pytest.approx(c.peak_gib) and peak <= usable_gib
    steps = [c.step_s for c in result.candidates]
    assert steps == sorted(steps)


def test_every_proposal_validates_and_fits():
    result = _plan()
    _assert_valid_and_fits(result, 8, 72.0)
    assert result.rejected_by_memory > 0  # the 8B model without checkpointing does not fit every layout
    # A tighter GPU drops more and still proposes only what fits.
    small = _plan(gib=40.0)
    _assert_valid_and_fits(small, 8, 36.0)
    assert small.rejected_by_memory > result.rejected_by_memory


def test_a_moe_model_is_planned_with_expert_parallelism_within_a_node():
    """Qwen3-30B-A3B on 16 GPUs (2 nodes of 8): every proposal validates and fits, ep from 1 to 8 is proposed, the
    best proposal with ep > 1 spreads the experts over ranks of one node and costs ep's all-to-all on NVLink, and
    layouts with ep are among the fastest (with the auxiliary loss trained on every pipeline stage, pipelines
    without ep compete: PP 8 x CP 2 comes first here); a dense model is never given ep."""
    base = parse_args(["--config", os.path.join(ROOT, "train_configs", "qwen3_30b_a3b.toml")])
    result = planner.plan(base, 16, 4096, 32, 80.0, 0.1, planner.CostModel(), 2048)
    _assert_valid_and_fits(result, 16, 72.0)
    best = next(c for c in result.candidates if c.dims.ep > 1)
    assert best.step_s <= 1.1 * result.candidates[0].step_s
    assert best.dims.tp * best.dims.ep <= 8
    assert best.links["ep"] == "NVLink" and best.costs["ep"] > 0
    assert {c.dims.ep for c in result.candidates} >= {1, 2, 4, 8}
    assert all(c.dims.ep == 1 for c in _plan().candidates)


def test_expert_weights_read_from_memory_bound_the_moe_layers_and_ep_relieves_them():
    """Qwen3-30B-A3B on 16 GPUs at seq 1024: without ep a rank's 128 experts see few routed rows apiece per pass
    (64 for one sample), too few for their weights' reads from HBM (3 per pass) to hide behind the FLOPs, so those
    layouts pay for the reads and an ep layout comes first; with memory that costs nothing, an ep-1 layout would."""
    base = parse_args(["--config", os.path.join(ROOT, "train_configs", "qwen3_30b_a3b.toml")])
    result = planner.plan(base, 16, 1024, 32, 80.0, 0.1, planner.CostModel(), 2048)
    best = result.candidates[0]
    assert best.dims.ep > 1 and best.costs["experts"] == 0 and best.links["experts"] == "HBM"
    assert "experts" not in best.reason
    without_ep = [c for c in result.candidates if c.dims.ep == 1]
    balance = 989e12 * 0.40 / 3350e9  # FLOPs per byte where the GEMMs' weight reads and FLOPs take as long
    for c in without_ep:  # bound by the weights exactly when an expert gets fewer rows than that per pass
        micro = c.cfg.parallelism.pp_microbatches if c.dims.pp > 1 else 1
        rows = c.cfg.training.local_batch_size // micro * 1024 // c.dims.cp * 8 / (c.dims.tp * 128)
        assert (c.costs["experts"] > 0) == (rows < balance), (c.dims.describe(), rows, c.costs)
    free = planner.plan(base, 16, 1024, 32, 80.0, 0.1, planner.CostModel(hbm_gbps=1e9), 2048)
    winner = free.candidates[0]  # with free memory reads: an ep-1 layout with one sample per microbatch

    def key(c):
        return planner.format_plan(planner.Plan([c], 0, 0, 1), 1).splitlines()[1].split()[1:13]
    assert winner.dims.ep == 1 and "experts" not in winner.reason
    same = next(c for c in without_ep if key(c) == key(winner))
    assert same.costs["experts"] > 0 and "HBM" in same.reason and same.step_s > best.step_s
    assert not any("experts" in c.costs for c in _plan(gpus=2).candidates)  # a dense model has no such term


def test_the_table_shows_a_layout_once_per_estimate():
    """Batch splits of one layout with the same estimate are folded into its first row, and counted."""
    result = _plan()
    table = planner.format_plan(result, 10).splitlines()
    rows = [line.split()[1:15] for line in table[1:11]]
    layouts = [row[:7] + row[10:] for row in rows]  # all but microbatches, local batch and accumulation
    assert len(rows) == 10 and len({tuple(r) for r in layouts}) == 10, table
    first = {}
    for c in result.candidates:
        first.setdefault((c.dims.describe(), c.cfg.parallelism.pp_schedule, planner._ac_text(c.cfg),
                          planner._loss_text(c.cfg), f"{c.peak_gib:.1f}", f"{c.step_s:.2f}"), c)
    assert len(first) < len(result.candidates)  # (8B on 8 GPUs has such ties: the check has something to fold)
    folded = int(table[11].split()[0].lstrip("(")) if len(table) > 11 else 0
    shown = list(first.values())[:10]  # (the candidates come ranked)
    assert folded == result.candidates.index(shown[-1]) + 1 - 10, table


def test_fused_loss_only_where_the_plain_loss_does_not_fit():
    """On 72 GB GPUs pure FSDP without checkpointing fits only with the fused loss, and is the fastest."""
    result = _plan(gib=72.0)
    _assert_valid_and_fits(result, 8, 72.0 * 0.9)
    best = result.candidates[0]
    assert (best.dims.dp_shard, best.cfg.activation_checkpoint.mode) == (8, "none")
    assert best.cfg.training.loss_chunk_tokens == 2048
    fused = [c for c in result.candidates if c.cfg.training.loss_chunk_tokens]
    for c in fused:  # each one's plain twin does not fit
        plain = memory.copy_config(c.cfg)
        plain.training.loss_chunk_tokens = 0
        rows = memory.analytic_rows(plain, memory.validate_layout(plain, 8), memory.model_shape(plain))
        assert max(r.estimate.peak for r in rows) / memory.GIB > 72.0 * 0.9
    without = _plan(gib=72.0, loss_chunk_tokens=0)
    assert not any(c.cfg.training.loss_chunk_tokens for c in without.candidates)
    assert len(without.candidates) == len(result.candidates) - len(fused)
    assert without.candidates[0].step_s > best.step_s


def test_validation_decides(monkeypatch):
    """Whatever validate refuses is never proposed (here: validation made to refuse tp 2)."""
    real = memory.validate_layout

    def refuse_tp2(cfg, world_size):
        if cfg.parallelism.tp == 2:
            raise ConfigError("parallelism.tp: refused by this test")
        return real(cfg, world_size)

    monkeypatch.setattr(memory, "validate_layout", refuse_tp2)
    result = _plan()
    assert result.rejected_by_validation > 0
    assert all(c.dims.tp != 2 for c in result.candidates)
    assert any(c.dims.tp == 4 for c in result.candidates)


def test_cost_model_prefers_links_in_a_node():
    """tp over the network costs more than the same tp over NVLink."""
    result = _plan()
    tp8 = next(c for c in result.candidates if c.dims.tp == 8)
    cfg, dims = tp8.cfg, tp8.dims
    shape = memory.model_shape(cfg)
    rows = memory.analytic_rows(cfg, dims, shape)
    flops = 1e9
    in_node, _ = planner.step_cost(cfg, dims, shape, flops, rows, planner.CostModel(gpus_per_node=8))
    across, links = planner.step_cost(cfg, dims, shape, flops, rows, planner.CostModel(gpus_per_node=4))
    assert links["tp"] == "network" and across["tp"] == pytest.approx(in_node["tp"] * 450 / 50)
    # A group fits a node only when its block of ranks divides the node: tp 8 on 12-GPU nodes has ranks 8-15
    # across two nodes, though 8 <= 12.
    _, links = planner.step_cost(cfg, dims, shape, flops, rows, planner.CostModel(gpus_per_node=12))
    assert links["tp"] == "network"
    assert [planner._in_node(1, 4, g) for g in (4, 6, 8, 12)] == [True, False, True, True]
    assert planner._in_node(2, 4, 8) and not planner._in_node(2, 4, 12) and planner._in_node(5, 1, 8)


def test_cli_writes_a_toml_the_launcher_accepts(tmp_path, capsys):
    out = tmp_path / "best.toml"
    rc = planner.main(["--model", "llama3", "--flavor", "8B", "--gpus", "8", "--seq-len", "8192",
                       "--global-batch", "16", "--out", str(out), "--top", "5"])
    text = capsys.readouterr().out
    assert rc == 0 and "ranked" in text and out.exists()
    cfg = parse_args(["--config", str(out)])
    best_line = text.split("reason\n", 1)[1].splitlines()[0].split()
    dims = memory.validate_layout(cfg, 8)
    assert [str(v) for v in (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp)] == best_line[1:6]
    assert cfg.training.global_batch_size == 16 and cfg.training.seq_len == 8192
    assert cfg.training.loss_chunk_tokens == 0  # the plain loss fits the winner on 80 GB
    assert cfg.data.dataset == "allenai/c4"  # the rest comes from the model's train_configs TOML
    # The dry run (the real build path on 8 simulated ranks) takes it and agrees that it fits.
    env = dict(os.environ, DRY_RUN="1", NGPU="8", PYTHON=sys.executable)
    proc = subprocess.run(["./run_train.sh", "--config", str(out), "--model.hf_assets_path="], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "; fits in 80 GiB per GPU" in proc.stdout


def test_cli_toml_drops_the_base_pipeline_split(tmp_path, capsys):
    """A base TOML's own pipeline split (or CSV) fits its own layout only: the written TOML does not keep it."""
    base = tmp_path / "base.toml"
    with open(os.path.join(ROOT, "train_configs", "llama3_8b.toml")) as f:
        base.write_text(f.read() + "\n[parallelism]\npp = 2\npp_layers_per_stage = [16, 16]\n")
    out = tmp_path / "best.toml"
    rc = planner.main(["--flavor", "8B", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16",
                       "--config", str(base), "--out", str(out), "--top", "1"])
    assert rc == 0, capsys.readouterr()
    cfg = parse_args(["--config", str(out)])
    assert cfg.parallelism.pp_layers_per_stage == [] and cfg.parallelism.pp_schedule_csv == ""
    memory.validate_layout(cfg, 8)


def test_cli_toml_keeps_the_base_checkpointing_policy(tmp_path, capsys):
    """The base TOML's activation_checkpoint.op_matmuls (alternate, which float8 runs use) is what the estimate
    was made with: the written TOML keeps it, with the mode the planner chose (it was dropped, and the run then
    recomputed less and needed more memory than planned)."""
    base = tmp_path / "base.toml"
    with open(os.path.join(ROOT, "train_configs", "llama3_8b.toml")) as f:
        base.write_text(f.read() + '\n[activation_checkpoint]\nmode = "selective"\nop_matmuls = "alternate"\n')
    out = tmp_path / "best.toml"
    rc = planner.main(["--flavor", "8B_L8", "--gpus", "1", "--seq-len", "8192", "--global-batch", "1",
                       "--gpu-memory-gib", "55", "--loss-chunk-tokens", "0", "--config", str(base), "--out", str(out),
                       "--top", "1"])
    assert rc == 0, capsys.readouterr()
    ac = parse_args(["--config", str(out)]).activation_checkpoint
    assert (ac.mode, ac.selective_option, ac.op_matmuls) == ("selective", "op", "alternate")


def test_cli_errors_are_one_line(capsys):
    rc = planner.main(["--flavor", "13B", "--gpus", "8", "--seq-len", "8192", "--global-batch", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: --flavor: '13B' is not a flavor of llama3"), err
    rc = planner.main(["--flavor", "70b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["error: --flavor: '70b' is not a flavor of llama3: debugmodel, debugmodel_L2, "
                               "debugmodel_tied, 1B, 3B, 8B, 8B_L8, 8B_L2, 70B, 405B (did you mean '70B'?)"], err
    rc = planner.main(["--flavor", "8B", "--gpus", "0", "--seq-len", "8192", "--global-batch", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--gpus" in err[0], err
    # A scenario where nothing fits: one error line with the smallest estimate, and no TOML.
    rc = planner.main(["--flavor", "70B", "--gpus", "8", "--seq-len", "8192", "--global-batch", "8",
                       "--gpu-memory-gib", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(
        "error: --gpu-memory-gib: no layout of llama3/70B on 8 GPUs fits 3.6 GiB per GPU (the smallest estimate is "
    ), err
    # --out is checked before the search
    rc = planner.main(["--flavor", "8B", "--gpus", "8", "--seq-len", "8192", "--global-batch", "8",
                       "--out", "/no/such/folder/best.toml"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: --out: cannot write"), err


@pytest.mark.parametrize("module, argv", [
    ("tools.planner", ["--flavor", "8B", "--gpus", "x"]),
    ("tools.sweep", ["--ngpu", "x"]),
    ("tools.slurm", ["--nodes", "two"]),
    ("tools.convert_hf", ["to-hf", "--bogus"]),
    ("engine.plot", []),
])
def test_tool_flag_errors_are_one_line(module, argv):
    """argparse's own errors (a flag's type, a missing argument) keep the tools' contract: one error: line."""
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert f"(see python -m {module}" in lines[0] and lines[0].endswith(" --help)"), lines


def test_validate_layout_accepts_what_validate_accepts_with_path_fields_set(tmp_path):
    """The layout check skips the files a layout does not depend on, and nothing more: a config validate() accepts
    with HF initial weights, validation data, assets, data and tokenizer files validates as a layout, also on a
    planning machine that lacks those files (initial_load_hf with a blanked initial_load_path was refused)."""
    from engine.config.validation import HOPPER, validate

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "val.jsonl").write_text('{"text": "b"}\n')
    (tmp_path / "tokenizer.json").write_text("{}")
    argv = ["--config", BASE, "--parallelism.tp", "2", "--checkpoint.initial_load_path", str(hf),
            "--checkpoint.initial_load_hf", "--validation.enable", "--validation.freq", "10",
            "--validation.path", str(tmp_path / "val.jsonl"), "--data.path", str(tmp_path / "train.jsonl"),
            "--data.tokenizer", str(tmp_path / "tokenizer.json"), "--model.hf_assets_path", str(hf)]
    cfg = parse_args(argv)
    validate(cfg, 8, HOPPER)
    assert memory.validate_layout(cfg, 8).tp == 2
    for path in (hf / "config.json", tmp_path / "train.jsonl", tmp_path / "val.jsonl", tmp_path / "tokenizer.json"):
        path.unlink()  # the planning machine has none of the files
    hf.rmdir()
    assert memory.validate_layout(cfg, 8).tp == 2
    with pytest.raises(ConfigError, match="checkpoint.initial_load_hf"):  # a rule not about a file still holds
        memory.validate_layout(parse_args(["--config", BASE, "--checkpoint.initial_load_hf"]), 8)
    with pytest.raises(ConfigError, match="checkpoint.initial_load_path"):
        memory.validate_layout(parse_args([*argv, "--checkpoint.create_seed_checkpoint"]), 8)
    # The estimator's command line, the finding's reproduction: no false error.
    proc = subprocess.run([sys.executable, "-m", "tools.memory", "--config", BASE, "--ngpu", "8",
                           "--checkpoint.initial_load_path", str(tmp_path / "missing"), "--checkpoint.initial_load_hf"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "fits" in proc.stdout, proc.stderr[-2000:]
