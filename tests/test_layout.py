"""The parallel layout from the command line: impossible layouts are refused up front (a possible one trains
in tests/test_checkpoint.py, through run_train.sh on 4 CPU ranks)."""

import os
import subprocess
import sys

import pytest

from engine import train
from engine.config import ConfigError, parse_args
from parallelize.mesh import ParallelDims

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BAD_LAYOUTS = [
    (3, ["--parallelism.tp", "3"], "parallelism.tp"),  # 8 KV heads
    (16, ["--parallelism.tp", "16"], "parallelism.tp"),  # more TP ranks than KV heads
    (4, ["--parallelism.dp_shard", "2"], "parallelism"),  # product 2, world 4
    (4, ["--parallelism.dp_shard", "0"], "parallelism.dp_shard"),
    (4, ["--parallelism.tp", "0"], "parallelism.tp"),
    (4, ["--parallelism.dp_replicate", "3"], "parallelism.dp_shard"),  # leaves no whole dp_shard
    (2, ["--training.global_batch_size", "6", "--training.local_batch_size", "4"], "training.global_batch_size"),
    (4, ["--parallelism.tp", "2", "--training.seq_len", "255"], "training.seq_len"),
    (2, ["--activation_checkpoint.mode", "some"], "activation_checkpoint.mode"),
    (2, ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_option", "0"],
     "activation_checkpoint.selective_option"),
    (2, ["--parallelism.tp", "2", "--parallelism.enable_async_tp"], "parallelism.enable_async_tp"),
    (2, ["--parallelism.fsdp_reshard_after_forward", "sometimes"], "parallelism.fsdp_reshard_after_forward"),
    (3, ["--data.num_shards", "4"], "data.num_shards"),  # 3 dp ranks would read 4 shards unevenly
    (4, ["--data.num_shards", "2"], "data.num_shards"),
    # pipeline and context parallelism
    (2, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "Interleaved1F1B",
         "--parallelism.pp_virtual_stages", "5"], "parallelism.pp"),  # 10 stages, 6 layers
    (4, ["--parallelism.pp", "4", "--parallelism.pp_microbatches", "2"], "parallelism.pp_microbatches"),
    (2, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "Zigzag"], "parallelism.pp_schedule"),
    (2, ["--parallelism.pp", "2", "--training.local_batch_size", "3"], "training.local_batch_size"),
    (2, ["--parallelism.pp", "2", "--parallelism.pp_layers_per_stage", "2,2"], "parallelism.pp_layers_per_stage"),
    (2, ["--parallelism.pp", "2", "--parallelism.pp_schedule_csv", "/no/such.csv"], "parallelism.pp_schedule_csv"),
    (2, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV", "--parallelism.pp_microbatches", "2"],
     "parallelism.pp_microbatches"),  # 4 stages
    (4, ["--parallelism.pp", "4", "--parallelism.pp_layers_per_stage", "3,0,0,3"], "parallelism.pp_layers_per_stage"),
    (4, ["--parallelism.cp", "2", "--parallelism.tp", "2", "--training.seq_len", "100"], "training.seq_len"),
    (2, ["--parallelism.cp", "2", "--parallelism.cp_rotate", "ring"], "parallelism.cp_rotate"),
    (2, ["--parallelism.cp", "2", "--model.attn", "flash_attn"], "model.attn"),
    (2, ["--parallelism.cp", "2", "--model.sdpa_backend", "math"], "model.sdpa_backend"),
    # the fused output loss
    (2, ["--parallelism.pp", "2", "--training.loss_chunk_tokens", "-8"], "training.loss_chunk_tokens"),
]


def test_zero_bubble_refuses_what_cannot_run_twice(tmp_path, capsys, monkeypatch):
    """The zero-bubble schedules run each backward in two passes, the weight pass as one autograd.grad call per
    weight group. On any torch they refuse compiled blocks (whose backward may run once per forward) and per-op
    AC (whose saved activations serve one pass), which both failed in step 1, and full or every-N AC (each
    autograd.grad call recomputed the checkpointed blocks: 10x the forwards, 3.2x the step time of the debug
    model on 2 ranks) and float8 (torchao's matmul node computes both gradients in each pass: twice the backward
    matmuls). On a torch whose split backward cannot pass through a custom autograd function (2.11) they refuse
    the fused loss too; 2.13 runs it (tests/test_parallel.py). The other schedules take all of these."""
    from engine.config import validation
    from parallelize import pipeline_parallel as pipeline

    monkeypatch.setenv("WORLD_SIZE", "2")
    pp2 = ["--parallelism.pp", "2", "--job.dump_folder", str(tmp_path / "run")]
    ac = ["--activation_checkpoint.mode"]
    per_op, every_2 = [*ac, "selective"], [*ac, "selective", "--activation_checkpoint.selective_option", "2"]
    float8, fused_loss = ["--float8.enable", "--float8.emulate"], ["--training.loss_chunk_tokens", "256"]
    always = ((["--compile.enable"], "compile.enable"), (per_op, "activation_checkpoint.mode"),
              ([*ac, "full"], "activation_checkpoint.mode"), (every_2, "activation_checkpoint.mode"),
              (float8, "float8.enable"))

    def refused(schedule, feature, key):
        assert train.main([*pp2, "--parallelism.pp_schedule", schedule, *feature]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: parallelism.pp_schedule: {schedule} splits") \
            and key in err[0], err

    for schedule in pipeline.SPLIT_BACKWARD_SCHEDULES:
        for feature, key in always:
            refused(schedule, feature, key)
        monkeypatch.setattr(validation, "split_backward_takes_custom_functions", lambda: False)
        refused(schedule, fused_loss, "(training.loss_chunk_tokens;")
        monkeypatch.setattr(validation, "split_backward_takes_custom_functions", lambda: True)
        train.check([*pp2, "--parallelism.pp_schedule", schedule, *fused_loss])
    assert not (tmp_path / "run").exists()
    for feature in (["--compile.enable", *per_op, *fused_loss], [*ac, "full", *float8], every_2):
        train.check([*pp2, "--parallelism.pp_schedule", "1F1B", *feature])
    # A CSV with I and W actions splits the backward whatever pp_schedule names: the advice is about the file.
    csv = tmp_path / "split.csv"
    csv.write_text("0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1W0,1F1,1I1,1W1\n")
    assert train.main([*pp2, "--parallelism.pp_schedule_csv", str(csv), *ac, "full"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: parallelism.pp_schedule_csv: {csv} splits the backward") \
        and err[0].endswith("use a CSV schedule with whole backwards (B) instead of I and W actions, or set "
                            "activation_checkpoint.mode to none"), err


def test_too_many_stages_names_the_fix_that_applies(monkeypatch):
    """More stages than the model has layers (+ embedding and output): a V schedule holds two stages per rank
    whatever pp_virtual_stages says, so only the looped schedules are told to lower it."""
    from engine.config import ConfigError

    for schedule, pp, fix in (
            ("ZBVZeroBubble", 8, "lower parallelism.pp, or use a schedule of one stage per rank (1F1B, GPipe)"),
            ("Interleaved1F1B", 8, "lower parallelism.pp or parallelism.pp_virtual_stages"),
            ("1F1B", 9, "own); lower parallelism.pp")):
        monkeypatch.setenv("WORLD_SIZE", str(pp))
        with pytest.raises(ConfigError) as e:
            train.check(["--parallelism.pp", str(pp), "--parallelism.pp_schedule", schedule])
        assert str(e.value).startswith("parallelism.pp: ") and str(e.value).endswith(fix), str(e.value)


def test_schedule_csv_that_does_not_fit_the_layout_is_one_error_line(tmp_path, capsys, monkeypatch):
    """The CSV schedule is checked against the stages each rank holds and the microbatch count (of the whole
    step, with gradient accumulation) before anything is built: torch would find a mismatch only in the first
    step, or fail with an assertion."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    looped = open(os.path.join(ROOT, "tests", "data", "pp2_looped_bfs.csv")).read()
    cases = {
        "one_row": (looped.splitlines()[0] + "\n", [], "has 1 row; it needs one per pipeline rank"),
        "v_placement": (looped.replace("0F0,0F1,0F2,0F3,2F0", "0F0,0F1,0F2,0F3,3F0"), [],
                        "row 0 runs stage 3 (3F0), but pp rank 0 holds stages [0, 2]"),
        "microbatches": (looped, ["--parallelism.pp_microbatches", "2"], "stage 0 runs forwards of microbatches "
                         "[0, 1, 2, 3], but the step has 2"),
        "bad_action": (looped.replace("0F1", "0Q1"), [], "row 0: "),
        # One schedule step runs every gradient-accumulation batch: the CSV must list all their microbatches.
        "accumulation": (looped, ["--training.local_batch_size", "4", "--training.global_batch_size", "8"],
                         "but the step has 8 (parallelism.pp_microbatches = 4 x 2 gradient accumulation batches)"),
        # Each microbatch's backward, whole or as input and weight halves, once (torch asserted mid-build).
        "no_backward": (looped.replace(",0B3", ""), [], "stage 0, microbatch 3: 1 forward(s) (F), 0 whole"),
        "twice": (looped.replace("2F3,", "2F3,2F3,"), [], "stage 2, microbatch 3: 2 forward(s) (F)"),
        "half_backward": (looped.replace("0B3", "0I3"), [], "0 whole backward(s) (B), 1 input backward(s) (I) and "
                          "0 weight"),
        # torch's loader takes every line for a rank's; its communication actions are Tessera's to add.
        "blank_line": (looped.replace("\n", "\n\n", 1), [], "line 2 is blank; each line is one pp rank's actions"),
        "comms": (looped.replace("0F1,", "0F1,0SEND_F1,"), [], "row 0: 0SEND_F1 is a communication or sharding "
                  "action"),
        # Each row's order: a backward after its forward (torch asserted mid-build).
        "backward_first": ("\n".join(",".join(reversed(row.split(","))) if i == 0 else row
                                     for i, row in enumerate(looped.splitlines())) + "\n", [],
                           "Rank 0, step 0: Running Full Backward for stage 0, microbatch 3 without first running "
                           "Forward"),
        "not_utf8": ("\udcff" + looped, [], "is not UTF-8 text (byte 0: invalid start byte); save it as UTF-8"),
    }
    for name, (text, extra, message) in cases.items():
        path = tmp_path / f"{name}.csv"
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
        dump = tmp_path / name
        argv = ["--parallelism.pp", "2", "--parallelism.pp_schedule", "Interleaved1F1B",
                "--parallelism.pp_schedule_csv", str(path), "--job.dump_folder", str(dump), *extra]
        assert train.main(argv) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: parallelism.pp_schedule_csv: '{path}'") \
            and message in err[0], (name, err)
        assert not dump.exists()
    train.check(["--parallelism.pp", "2", "--parallelism.pp_schedule", "Interleaved1F1B",
                 "--parallelism.pp_schedule_csv", os.path.join(ROOT, "tests", "data", "pp2_looped_bfs.csv"),
                 "--job.dump_folder", str(tmp_path / "good")])
    # A CSV given with a single-stage schedule (1F1B, the default) places one stage on each rank.
    train.check(["--parallelism.pp", "2", "--parallelism.pp_schedule_csv",
                 os.path.join(ROOT, "tests", "data", "pp2_1f1b.csv"), "--job.dump_folder", str(tmp_path / "good")])
    # An action that overlaps a forward and a backward (torch's runtime runs it) holds the stages of its parts.
    overlap = tmp_path / "overlap.csv"
    overlap.write_text("0F0,0F1,(0F2;0B0)OVERLAP_F_B,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n")
    train.check(["--parallelism.pp", "2", "--parallelism.pp_schedule_csv", str(overlap), "--parallelism.pp_microbatches",
                 "3", "--training.local_batch_size", "3", "--training.global_batch_size", "3", "--job.dump_folder",
                 str(tmp_path / "good")])


def test_pipeline_microbatch_rules_count_every_accumulation_batch(tmp_path, monkeypatch):
    """One schedule step runs pp_microbatches x accumulation microbatches: the rules on their number count
    them all (they refused layouts that run, tests/test_parallel.py's pp2_DualPipeV_accum2)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    accum2 = ["--training.local_batch_size", "4", "--training.global_batch_size", "8"]
    for schedule, micro in (("DualPipeV", "2"), ("1F1B", "1"), ("Interleaved1F1B", "1")):
        train.check(["--parallelism.pp", "2", "--parallelism.pp_schedule", schedule, "--parallelism.pp_microbatches",
                     micro, *accum2, "--job.dump_folder", str(tmp_path / "run")])
    with pytest.raises(ConfigError, match=r"^parallelism\.pp_microbatches: DualPipeV needs .* got 2 \(1 x 2 gradient"):
        train.check(["--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV", "--parallelism.pp_microbatches",
                     "1", *accum2, "--job.dump_folder", str(tmp_path / "run")])


@pytest.mark.parametrize("world, argv, field", BAD_LAYOUTS, ids=[" ".join(b[1]) for b in BAD_LAYOUTS])
def test_impossible_layout_is_one_error_line(world, argv, field, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    dump = tmp_path / "run"
    rc = train.main(["--job.dump_folder", str(dump), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: ") and field in err[0], err
    assert not dump.exists()


def test_dp_shard_takes_the_ranks_left_over():
    cfg = parse_args(["--parallelism.dp_replicate", "2", "--parallelism.tp", "2"])
    dims = ParallelDims.from_config(cfg.parallelism, 16)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp) == (2, 4, 2, 8)
    assert dims.fsdp_enabled and dims.tp_enabled and not dims.cp_enabled


def test_mesh_views_on_fake_world():
    """The named views of an 8,192-rank mesh, built in one process on the fake backend."""
    code = """
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from engine.config import ConfigError, parse_args
from parallelize.mesh import ParallelDims
dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8192)
cfg = parse_args(["--parallelism.dp_replicate", "4", "--parallelism.tp", "8"])
dims = ParallelDims.from_config(cfg.parallelism, 8192)
dims.build_mesh("cpu")
sizes = {v: dims.mesh(v).size() for v in ("dp", "dp_shard_cp", "dp_cp", "tp", "dp_replicate", "dp_shard")}
print(sizes, dims.coordinate("tp"), dims.coordinate("dp"), dims.mesh("fsdp").ndim)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == (
        "{'dp': 1024, 'dp_shard_cp': 256, 'dp_cp': 1024, 'tp': 8, 'dp_replicate': 4, 'dp_shard': 256} "
        "(5, 8) (0, 1024) 2"
    )


def test_fsdp_tp_norm_reduces_in_one_all_reduce():
    """The gradient norm of FSDP x TP parameters is partial over (dp_shard_cp, tp): with the dp_shard_cp_tp view
    DTensor makes it whole in one all-reduce; without it, one per dimension (DTensor then warns)."""
    code = """
import logging, warnings
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.testing._internal.distributed.fake_pg import FakeStore
from engine.config import ConfigError, parse_args
from parallelize.mesh import ParallelDims

records = []
handler = logging.Handler()
handler.emit = lambda r: records.append(r.getMessage())
logging.getLogger("torch.distributed.tensor._redistribute").addHandler(handler)
dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=64)
for args, dims_names in (
    (["--parallelism.dp_shard", "16", "--parallelism.tp", "4"], ("dp_shard", "tp")),
    (["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "4", "--parallelism.cp", "2",
      "--parallelism.tp", "4"], ("dp_replicate", "dp_shard_cp", "tp")),
    (["--parallelism.pp", "2", "--parallelism.dp_shard", "4", "--parallelism.cp", "2", "--parallelism.tp", "4"],
     ("dp_shard_cp", "tp")),
):
    dims = ParallelDims.from_config(parse_args(args).parallelism, 64)
    root = dims.build_mesh("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = root[dims_names]
    placements = [Replicate()] * (len(dims_names) - 2) + [Partial(), Partial()]
    norm = DTensor.from_local(torch.ones(()), mesh, placements).full_tensor()
print(len(records), [m[:120] for m in records])
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("0 []"), proc.stdout


def _env(ngpu: int) -> dict:
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": str(ngpu)}
    env.pop("WORLD_SIZE", None)
    return env


def test_run_train_sh_refuses_impossible_layout(tmp_path):
    dump = tmp_path / "run"
    proc = subprocess.run(["./run_train.sh", "--parallelism.tp", "3", "--job.dump_folder", str(dump)],
                          cwd=ROOT, capture_output=True, text=True, env=_env(3), timeout=600)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: parallelism.tp: 3 does not divide"), proc.stderr
    assert not dump.exists()


def test_cpu_offload_needs_cuda_and_fsdp():
    """FSDP does the offloading: refused without CUDA, and on a GPU layout without FSDP (it was ignored there)."""
    from engine.config import ConfigError
    from engine.config.validation import HOPPER, validate

    with pytest.raises(ConfigError, match=r"^parallelism\.fsdp_cpu_offload: offloading to CPU memory needs CUDA"):
        validate(parse_args(["--parallelism.fsdp_cpu_offload"]), 1)
    with pytest.raises(ConfigError, match=r"^parallelism\.fsdp_cpu_offload: FSDP does the offloading"):
        validate(parse_args(["--parallelism.fsdp_cpu_offload"]), 1, HOPPER)
    validate(parse_args(["--parallelism.fsdp_cpu_offload", "--parallelism.fsdp_single_rank"]), 1, HOPPER)
    validate(parse_args(["--parallelism.fsdp_cpu_offload", "--parallelism.dp_shard", "2"]), 2, HOPPER)
