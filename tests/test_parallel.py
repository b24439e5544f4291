"""Loss parity of every data/tensor-parallel layout with a single process (gloo, CPU, fp32, deterministic).

Every layout trains the debug model (its 2-layer flavor; 4-stage pipelines the 6-layer one) 3 steps on the same
global batches (8 samples of 64 tokens) from the same initial weights (parallelize/init.py makes initialization
layout-independent) and must reproduce the single-process losses and gradient norms to a relative 1e-5, and its
first-step gradients to rounding. Activation checkpointing (full, per-op, every N-th block), gradient
accumulation, torch.compile, every pipeline schedule, context parallelism and their compositions up to 4-D
(16 ranks) are checked the same way.
"""

import shutil

import pytest
import torch

from engine.config import parse_args
from parallelize.pipeline_parallel import split_backward_takes_custom_functions
from tests.parallel_harness import AOT_EAGER, SHALLOW, global_batches, run_layout, run_world

STEPS = 3
GLOBAL = 8


def _deep(args) -> bool:
    """Pipelines of 4 ranks train the 6-layer debug model (their 8 stages need blocks to hold); the other layouts
    its 2-layer flavor."""
    return "--parallelism.pp" in args and int(args[args.index("--parallelism.pp") + 1]) >= 4


def _layout(local: int, *args: str, deep: bool = False) -> list[str]:
    """A layout's flags, on the debug model of the depth it needs."""
    return ["--training.local_batch_size", str(local), *([] if deep or _deep(args) else SHALLOW), *args]


FSDP2_TP2 = ["--parallelism.dp_shard", "2", "--parallelism.tp", "2"]
PP_SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


# torch 2.11's zero-bubble weight pass cannot go through the fused loss (validation refuses the pair there; see
# test_split_backward_probe); on 2.13 the V schedules run it.
ZB_FUSED = split_backward_takes_custom_functions()
TORCH_RELEASE = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])  # (2, 13)


def _pipelines(pp: int) -> dict:
    return {f"pp{pp}_{name}": _layout(8, "--parallelism.pp", str(pp), "--parallelism.pp_schedule", name)
            for name in PP_SCHEDULES}


LAYOUTS = {
    2: {
        "ddp2": _layout(4, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"),
        # Gradient accumulation under DDP: the gradients are all-reduced once, in the last microbatch's backward.
        "ddp2_accum2": _layout(2, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1",
                              "--training.global_batch_size", "8"),
        "tp2": _layout(8, "--parallelism.tp", "2"),
        "tp2_no_loss_parallel": _layout(8, "--parallelism.tp", "2", "--parallelism.disable_loss_parallel"),
        "fsdp2_compile_ac_op": _layout(4, "--parallelism.dp_shard", "2", "--compile.enable",
                                       "--activation_checkpoint.mode", "selective"),
        # Without FSDP the first compiled block takes the embedding's pending reduce-scatter (torch 2.13's backward
        # failed there: parallelize.compile.wait_before_compiled_blocks). AOT_EAGER: both TP layouts fail without their
        # fixes on this backend too (see its definition).
        "tp2_compile": _layout(8, "--parallelism.tp", "2", *AOT_EAGER),
        # Full AC compiles inside the checkpoint (torch 2.13 failed compiling the wrapper under TP: the shipped
        # 70B and 405B configs' combination; parallelize.compile.apply_compile).
        "tp2_compile_ac_full": _layout(8, "--parallelism.tp", "2", *AOT_EAGER, "--activation_checkpoint.mode", "full"),
        **_pipelines(2),
        "pp2_csv": _layout(8, "--parallelism.pp", "2", "--parallelism.pp_schedule", "Interleaved1F1B",
                           "--parallelism.pp_schedule_csv", "tests/data/pp2_looped_bfs.csv"),
        # A CSV with 1F1B's placement (one stage per rank), and DualPipeV's 4 stages fed by 2 microbatches of
        # each of 2 accumulation batches (one schedule step runs all 4).
        "pp2_csv_1f1b": _layout(8, "--parallelism.pp", "2", "--parallelism.pp_schedule_csv", "tests/data/pp2_1f1b.csv"),
        "pp2_DualPipeV_accum2": _layout(4, "--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV",
                                        "--parallelism.pp_microbatches", "2", "--training.global_batch_size", "8"),
        "cp2": _layout(8, "--parallelism.cp", "2"),
        "cp2_alltoall_fused_loss": _layout(8, "--parallelism.cp", "2", "--parallelism.cp_rotate", "alltoall",
                                           "--training.loss_chunk_tokens", "100"),
        # Compiled blocks (fullgraph) with the point-to-point ring inside, under per-op AC, which saves the ring's
        # output whole (parallelize/context_parallel.py: one operator).
        "cp2_alltoall_compile_ac_op": _layout(8, "--parallelism.cp", "2", "--parallelism.cp_rotate", "alltoall",
                                              *AOT_EAGER, "--activation_checkpoint.mode", "selective"),
        # The harness steps the optimizer per tensor (see BASE); this layout keeps the engine's CPU default.
        "fsdp2_fused_loss_foreach_adamw": _layout(4, "--parallelism.dp_shard", "2", "--training.loss_chunk_tokens",
                                                  "48", "--optimizer.implementation", "foreach"),
        # Every other matmul saved (the reference's policy) counts the matmuls of tensor-parallel DTensors.
        "tp2_ac_op_alternate": _layout(8, "--parallelism.tp", "2", "--activation_checkpoint.mode", "selective",
                                       "--activation_checkpoint.op_matmuls", "alternate"),
        "tp2_fused_loss": _layout(8, "--parallelism.tp", "2", "--training.loss_chunk_tokens", "80"),
        # The fused loss on the last stage, with a single-stage schedule and with a V schedule (last stage on
        # rank 0, backward split into its input and weight halves).
        "pp2_1F1B_fused_loss": _layout(8, "--parallelism.pp", "2", "--parallelism.pp_schedule", "1F1B",
                                       "--training.loss_chunk_tokens", "100"),
        **({"pp2_ZBVZeroBubble_fused_loss": _layout(8, "--parallelism.pp", "2", "--parallelism.pp_schedule",
                                                    "ZBVZeroBubble", "--training.loss_chunk_tokens", "100")}
           if ZB_FUSED else {}),
    },
    4: {
        "fsdp4": _layout(2, "--parallelism.dp_shard", "4"),
        "hsdp2x2": _layout(2, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"),
        "hsdp2x2_accum2": _layout(1, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2",
                                  "--training.global_batch_size", "8"),
        "pp2_ddp2_accum2": _layout(2, "--parallelism.pp", "2", "--parallelism.dp_replicate", "2",
                                   "--parallelism.dp_shard", "1", "--training.global_batch_size", "8"),
        "tp4": _layout(8, "--parallelism.tp", "4"),
        "fsdp2_tp2": _layout(4, *FSDP2_TP2),
        "ddp2_tp2": _layout(4, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1",
                            "--parallelism.tp", "2"),
        "fsdp4_ac_full": _layout(2, "--parallelism.dp_shard", "4", "--activation_checkpoint.mode", "full"),
        "fsdp2_tp2_ac_op": _layout(4, *FSDP2_TP2, "--activation_checkpoint.mode", "selective"),
        "fsdp2_tp2_accum2": _layout(2, *FSDP2_TP2, "--training.global_batch_size", "8"),
        # CUDA's default optimizer: fused AdamW, which applies the clip factor in its kernel (engine/optim.py),
        # over DTensor gradients of two meshes (from the second step: the harness reads the first's gradients).
        "fsdp2_tp2_fused_adamw": _layout(4, *FSDP2_TP2, "--optimizer.implementation", "fused"),
        "fsdp4_reshard_never_ac_every2": _layout(2, "--parallelism.dp_shard", "4",
                                                 "--parallelism.fsdp_reshard_after_forward", "never",
                                                 "--activation_checkpoint.mode", "selective",
                                                 "--activation_checkpoint.selective_option", "2"),
        **_pipelines(4),
        "cp4": _layout(8, "--parallelism.cp", "4"),
        "cp4_alltoall": _layout(8, "--parallelism.cp", "4", "--parallelism.cp_rotate", "alltoall"),
        "cp2_fsdp2": _layout(4, "--parallelism.cp", "2", "--parallelism.dp_shard", "2"),
        "cp2_tp2": _layout(8, "--parallelism.cp", "2", "--parallelism.tp", "2"),
        "fsdp2_tp2_fused_loss": _layout(4, *FSDP2_TP2, "--training.loss_chunk_tokens", "48"),
    },
    8: {
        "hsdp2x2_tp2": _layout(2, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2",
                               "--parallelism.tp", "2"),
        "pp2_fsdp2_tp2": _layout(4, "--parallelism.pp", "2", "--parallelism.dp_shard", "2", "--parallelism.tp", "2"),
        "pp2_fsdp2_tp2_fused_loss": _layout(4, "--parallelism.pp", "2", "--parallelism.dp_shard", "2",
                                            "--parallelism.tp", "2", "--training.loss_chunk_tokens", "48"),
        "cp2_hsdp2x2": _layout(2, "--parallelism.cp", "2", "--parallelism.dp_replicate", "2",
                               "--parallelism.dp_shard", "2"),
    },
    16: {
        "pp2_fsdp2_cp2_tp2": _layout(4, "--parallelism.pp", "2", "--parallelism.dp_shard", "2", "--parallelism.cp",
                                     "2", "--parallelism.tp", "2", "--parallelism.pp_schedule", "Interleaved1F1B"),
    },
}


@pytest.fixture(scope="module")
def batches():
    return global_batches(GLOBAL, STEPS)


@pytest.fixture(scope="module")
def references(batches, tmp_path_factory):
    """The single-process runs of the 2-layer debug model (``False``) and of the 6-layer one that 4-stage pipelines
    train (``True``)."""
    dump = tmp_path_factory.mktemp("ref")
    results = {deep: run_layout(_layout(GLOBAL, deep=deep), 1, 0, batches, str(dump / str(deep)))
               for deep in (False, True)}
    shutil.rmtree(dump)  # the results are in memory; a run's files only fill the disk
    return results


@pytest.fixture(scope="module")
def reference(references):
    return references[False]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def world_results(request, batches, tmp_path_factory):
    world = request.param
    layouts = LAYOUTS[world]
    out = tmp_path_factory.mktemp(f"w{world}")
    results = run_world(world, layouts, {name: batches for name in layouts}, str(out))
    shutil.rmtree(out)  # the results (each layout's gradients among them) are in memory
    return results


def _check(result, reference, args: list[str]):
    """Losses and gradient norms of every step, the first step's clipped gradients of every parameter (from
    every pipeline stage), and that the features ``args`` ask for were built (``_check_built``)."""
    assert "error" not in result, result.get("error")
    assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5)
    assert set(result["grads"]) == set(reference["grads"])
    for name, g in result["grads"].items():
        torch.testing.assert_close(g, reference["grads"][name], rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")
    _check_built(args, result["built"])


def test_reference_trains(references):
    for reference in references.values():
        assert len(reference["losses"]) == STEPS
        assert reference["losses"][-1] < reference["losses"][0]
        assert reference["grad_norms"][0] > 1.0  # training.max_norm = 1: the recorded first-step gradients are clipped
    assert references[True]["built"]["blocks"] == 6 and references[False]["built"]["blocks"] == 2


def test_single_process_ac_matches_reference(batches, reference, tmp_path):
    for mode in (["full"], ["selective"], ["selective", "--activation_checkpoint.selective_option", "2"],
                 ["selective", "--activation_checkpoint.op_matmuls", "alternate"],
                 ["selective", "--activation_checkpoint.op_matmuls", "alternate", "--compile.enable"]):
        args = _layout(GLOBAL, "--activation_checkpoint.mode", *mode)
        result = run_layout(args, 1, 0, batches, str(tmp_path))
        _check(result, reference, args)


def test_single_process_fused_loss_matches_reference(batches, reference, tmp_path):
    # 8 x 64 tokens in chunks of 48 (the last one shorter), with compile: the blocks compiled, the loss eager.
    for extra in ([], ["--compile.enable"]):
        args = _layout(GLOBAL, "--training.loss_chunk_tokens", "48", *extra)
        result = run_layout(args, 1, 0, batches, str(tmp_path))
        _check(result, reference, args)


def test_single_process_compile_matches_reference(batches, reference, tmp_path):
    args = _layout(GLOBAL, "--compile.enable")
    _check(run_layout(args, 1, 0, batches, str(tmp_path)), reference, args)


def test_compile_backend_aot_eager_traces_without_inductor(batches, reference, tmp_path, monkeypatch):
    """compile.backend = aot_eager: the blocks and the loss are compiled (Dynamo and AOT autograd trace them),
    Inductor generates nothing, and the run is the reference's."""
    import torch._inductor.compile_fx as compile_fx

    generated = []
    inductor = compile_fx.compile_fx
    monkeypatch.setattr(compile_fx, "compile_fx", lambda *a, **k: generated.append(1) or inductor(*a, **k))
    torch._dynamo.reset()  # graphs cached by earlier tests would not be traced again
    args = _layout(GLOBAL, *AOT_EAGER)
    result = run_layout(args, 1, 0, batches, str(tmp_path))
    _check(result, reference, args)
    assert result["built"]["compiled"] == 2 and not generated
    torch._dynamo.reset()
    args = _layout(GLOBAL, "--compile.enable")  # the check can fail: the default backend is Inductor's
    run_layout(args, 1, 0, batches, str(tmp_path / "inductor"))
    assert generated


def test_compile_without_autotuning_matches_reference(batches, reference, tmp_path):
    """compile.autotune = false reaches Inductor's process-wide options, for elementwise kernels and reductions
    (a CPU build ignores them: the numbers stay the reference's); the next compiled run sets them back from its
    own config."""
    import torch._inductor.config as inductor_config

    def options():
        return inductor_config.triton.autotune_pointwise, inductor_config.test_configs.force_filter_reduction_configs

    try:
        args = _layout(GLOBAL, "--compile.enable", "--compile.no-autotune")
        _check(run_layout(args, 1, 0, batches, str(tmp_path / "off")), reference, args)
        assert options() == (False, True)
        args = _layout(GLOBAL, "--compile.enable")
        run_layout(args, 1, 0, batches, str(tmp_path / "on"))
        assert options() == (True, False)
    finally:
        inductor_config.triton.autotune_pointwise = True
        inductor_config.test_configs.force_filter_reduction_configs = False


def test_fsdp_on_a_single_rank_matches_reference(batches, reference, tmp_path):
    from engine.distributed import destroy_distributed

    try:
        args = _layout(GLOBAL, "--parallelism.fsdp_single_rank", "--activation_checkpoint.mode", "selective")
        result = run_layout(args, 1, 0, batches, str(tmp_path))
        _check(result, reference, args)
        assert result["built"]["dtensor_params"]  # FSDP2 did wrap it
    finally:
        destroy_distributed()


def _check_built(args: list[str], built: dict) -> None:
    """The features the layout's flags ask for were applied (not ignored) on rank 0's model parts."""
    from parallelize.pipeline_parallel import SCHEDULES

    a = " ".join(args)
    blocks = built["blocks"]
    if "--activation_checkpoint.mode full" in a or ("--activation_checkpoint.mode selective" in a
                                                     and "selective_option" not in a):
        assert built["checkpointed"] == blocks, built
    elif "--activation_checkpoint.selective_option" in a:
        every = int(args[args.index("--activation_checkpoint.selective_option") + 1])
        assert built["checkpointed"] == len(range(0, blocks, every)) > 0, built
    else:
        assert built["checkpointed"] == 0, built
    per_op = "--activation_checkpoint.mode selective" in a and "selective_option" not in a
    alternate = "--activation_checkpoint.op_matmuls alternate" in a
    assert built["op_matmuls"] == (["alternate" if alternate else "all"] if per_op else []), built
    assert built["compiled"] == (blocks if "--compile.enable" in a else 0), built
    if "--parallelism.dp_replicate 2" in a:  # HSDP/DDP: the replicas all-reduce once per step, whatever the
        assert built["replica_all_reduces"] == [built["fsdp_units"]] * STEPS, built  # gradient accumulation
    if "--parallelism.pp_schedule_csv" in a:
        assert built["schedule"] == "_PipelineScheduleRuntime", built
    elif "--parallelism.pp " in a:
        name = args[args.index("--parallelism.pp_schedule") + 1] if "--parallelism.pp_schedule" in args else "1F1B"
        assert built["schedule"] == SCHEDULES[name][0], built
    else:
        assert built["schedule"] is None, built
    if "FSDP2 on" in built["plan"]:  # the units that free their parameters after forward, as the plan line says
        mode = args[args.index("--parallelism.fsdp_reshard_after_forward") + 1] \
            if "--parallelism.fsdp_reshard_after_forward" in args else "default"
        if mode == "default":  # every block but the last; none of a pipeline stage's (its backward re-gathers)
            mode = "never" if "--parallelism.pp " in a or blocks < 2 else str(blocks - 1)
        which = {"never": "none", "always": "all"}.get(mode, mode)
        assert f"units ({which} resharded after forward)" in built["plan"], built
    _check_built_sharding(args, built)


def _degree(args: list[str], dim: str) -> int:
    flag = f"--parallelism.{dim}"
    return int(args[args.index(flag) + 1]) if flag in args else 1


def _check_built_sharding(args: list[str], built: dict) -> None:
    """Context, sequence, tensor and loss parallelism were applied as the flags ask (their losses match the
    reference whether applied or ignored: see parallel_harness.built_features): every block's attention is the
    ring attention over a CP group of the cp degree with the configured rotate method (or its own kernel without
    CP); the model gets seq_len / cp tokens of each sequence, the blocks the hidden state of seq_len / (cp x tp)
    positions (sequence parallel), their attention that of seq_len / cp; wq and wo are colwise and rowwise TP
    shards; the trainer's loss parallel (and the logits' layout where the output runs unfused on rank 0)."""
    cp, tp = _degree(args, "cp"), _degree(args, "tp")
    seq = built["seq_len"]
    if cp > 1:
        rotate = args[args.index("--parallelism.cp_rotate") + 1] if "--parallelism.cp_rotate" in args else "allgather"
        assert built["attn_fns"] == [("parallelize.context_parallel.context_attention", cp, rotate)] * built["blocks"], built
    else:
        assert built["attn_fns"] == [None] * built["blocks"], built
    assert built["tokens_seq"] == [seq // cp], built  # rank 0 holds the first stage under every schedule
    if "--compile.enable" in args or not built["blocks"]:  # compiled blocks run the hooks only inside the graph
        assert built["block_seq"] == built["attn_seq"] == [], built  # (no record); some stages hold no block
    else:
        assert built["block_seq"] == [seq // (cp * tp)], built
        assert built["attn_seq"] == [seq // cp], built
    if tp > 1 and built["blocks"]:
        assert built["wq"] is not None and built["wq"].get("tp") == "Shard(0)", built
        assert built["wo"] is not None and built["wo"].get("tp") == "Shard(1)", built
    else:
        assert "tp" not in (built["wq"] or {}) and "tp" not in (built["wo"] or {}), built
    loss_parallel = tp > 1 and "--parallelism.disable_loss_parallel" not in args
    assert built["loss_parallel"] == loss_parallel, built
    if _degree(args, "pp") == 1 and "--training.loss_chunk_tokens" not in args:
        assert built["logits"], built  # rank 0 holds the output, unfused with the loss
    if built["logits"]:
        assert "--training.loss_chunk_tokens" not in args, built
        assert built["logits"] == (["Shard(2)"] if loss_parallel else ["tensor"]), built


def test_parallel_layouts_match_single_process(world_results, references):
    failures = []
    args_by_name = {name: args for layouts in LAYOUTS.values() for name, args in layouts.items()}
    for name, result in world_results.items():
        try:
            _check(result, references[_deep(args_by_name[name])], args_by_name[name])
        except AssertionError as e:
            failures.append(f"{name}: {str(e)[:600]}")
    assert not failures, "\n".join(failures)


def test_document_masking_matches_single_process(batches, reference, tmp_path):
    """Document masking (flex, block-causal) with PP (every stage gets the microbatch's document ids) and with CP
    (the ring attention masks each chunk pair; the batches' document boundaries fall inside chunks)."""
    doc = ["--model.attn", "flex", "--model.attn_mask", "block_causal"]
    doc_reference = run_layout(_layout(GLOBAL, *doc), 1, 0, batches, str(tmp_path / "ref"))
    # The batches hold document boundaries: masking them changes the losses.
    assert doc_reference["losses"] != pytest.approx(reference["losses"], rel=1e-4)
    cp2 = ["--parallelism.cp", "2"]
    worlds = {
        2: {
            "pp2_1F1B": _layout(8, *doc, "--parallelism.pp", "2", "--parallelism.pp_schedule", "1F1B"),
            "pp2_DualPipeV_fused_loss": _layout(8, *doc, "--parallelism.pp", "2", "--parallelism.pp_schedule",
                                                "DualPipeV" if ZB_FUSED else "Interleaved1F1B",
                                                "--training.loss_chunk_tokens", "100"),
            "cp2": _layout(8, *doc, *cp2),
            "cp2_alltoall_fused_loss": _layout(8, *doc, *cp2, "--parallelism.cp_rotate", "alltoall",
                                               "--training.loss_chunk_tokens", "100"),
        },
        4: {
            "cp2_fsdp2": _layout(4, *doc, *cp2, "--parallelism.dp_shard", "2"),
            "cp2_tp2": _layout(8, *doc, *cp2, "--parallelism.tp", "2"),
            "pp2_cp2": _layout(8, *doc, *cp2, "--parallelism.pp", "2", "--parallelism.pp_schedule", "1F1B"),
        },
    }
    for world, layouts in worlds.items():
        results = run_world(world, layouts, {name: batches for name in layouts}, str(tmp_path / f"w{world}"))
        for name, result in results.items():
            _check(result, doc_reference, layouts[name])


def tied_copies(trainer) -> dict:
    """(A probe, after the first step.) Every rank's embedding and tied output projection, whole, on rank 0."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    def whole(w):
        return (w.full_tensor() if isinstance(w, DTensor) else w).detach().clone()

    mine = {}
    for part in trainer.model_parts:  # full_tensor is collective over the stage's ranks: all of them call it
        if part.tok_embeddings is not None:
            mine["embedding"] = whole(part.tok_embeddings.weight)
        if part.output is not None:
            mine["output"] = whole(part.output.weight)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {kind: [m[kind] for m in every if kind in m] for kind in ("embedding", "output")}


def test_tied_embeddings_match_single_process(batches, tmp_path):
    """An output projection tied to the embedding (Llama 3.2, small Qwen3). Under TP (with FSDP) one weight, sharded
    on the vocabulary once. On two pipeline stages, the first stage's embedding and the last stage's copy get the
    sum of both gradients (across ranks, or on one rank where a V schedule puts both stages there, under FSDP and
    TP shards too), the clip counts it once, and both copies take the same update. Losses, gradient norms and
    gradients as one process's, and the copies bit for bit equal after the first update."""
    tied = ["--model.flavor", "debugmodel_tied"]
    reference = run_layout(_layout(GLOBAL, *tied, deep=True), 1, 0, batches, str(tmp_path / "ref"))
    assert set(reference["grads"]) >= {"tok_embeddings.weight"} and "output.weight" not in reference["grads"]
    pp2 = ["--parallelism.pp", "2"]
    worlds = {
        2: {"pp2_1F1B": _layout(8, *tied, *pp2, "--parallelism.pp_schedule", "1F1B"),
            "pp2_ZBVZeroBubble": _layout(8, *tied, *pp2, "--parallelism.pp_schedule", "ZBVZeroBubble"),
            "tp2": _layout(8, *tied, "--parallelism.tp", "2")},
        4: {"fsdp2_tp2": _layout(4, *tied, *FSDP2_TP2),
            "pp2_fsdp2": _layout(4, *tied, *pp2, "--parallelism.dp_shard", "2"),
            "pp2_tp2_fused_loss": _layout(8, *tied, *pp2, "--parallelism.tp", "2", "--parallelism.pp_schedule",
                                          "Interleaved1F1B", "--training.loss_chunk_tokens", "100"),
            # the first and last of 4 stages: a group of their own (with 2 stages, the pp group is the pair)
            "pp4_1F1B": _layout(8, *tied, "--parallelism.pp", "4", "--parallelism.pp_schedule", "1F1B")},
    }
    for world, layouts in worlds.items():
        results = run_world(world, layouts, {name: batches for name in layouts}, str(tmp_path / f"w{world}"),
                            probe=tied_copies)
        for name, result in results.items():
            assert "error" not in result, (name, result.get("error"))
            assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5), name
            assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5), name
            grads = dict(result["grads"])
            copy = grads.pop("output.weight", None)  # the last stage's copy: the tied weight's whole gradient
            assert (copy is not None) == name.startswith("pp"), name
            assert set(grads) == set(reference["grads"]), name
            for key, g in [*grads.items(), *([("output.weight", copy)] if copy is not None else [])]:
                want = reference["grads"]["tok_embeddings.weight" if key == "output.weight" else key]
                torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name} {key}: {m}")
            copies = result["probe"]
            assert copies["embedding"] and copies["output"], name
            for w in copies["output"]:
                assert torch.equal(w, copies["embedding"][0]), name


# The releases whose answer was measured. An unlisted release is still checked against the real thing below.
SPLIT_BACKWARD_KNOWN = {(2, 11): False, (2, 13): True}


def _split_backward_through_the_fused_loss():
    """The fused output loss (models/loss.py's custom autograd function, as the last stage of a zero-bubble
    schedule runs it): its gradients (input, weight) from torch's split backward, the input half then the weight
    half, or the RuntimeError it raised; and the plain backward's, for comparison."""
    from torch import nn
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from models.loss import linear_cross_entropy_sum

    g = torch.Generator().manual_seed(0)
    h0, w0, labels = torch.randn(2, 3, 8, generator=g), torch.randn(16, 8, generator=g), torch.randint(0, 16, (2, 3))

    def run(split: bool):
        h, w = h0.clone().requires_grad_(), nn.Parameter(w0.clone())
        with torch.enable_grad():
            loss = linear_cross_entropy_sum(h * 1, w, labels, 4)
            if not split:
                loss.backward()
                return h.grad, w.grad
            try:
                _, groups = stage_backward_input([loss], None, [h], iter([w]))
                stage_backward_weight(iter([w]), groups)
            except RuntimeError as e:
                return e
        return h.grad, w.grad

    return run(True), run(False)


def test_split_backward_probe():
    """The probe behind the zero-bubble rule (validation refuses a zero-bubble schedule with the fused loss when it
    says no; CI keeps those layouts when it says yes), on every torch release: it answers what the real split
    backward through the fused loss does (the same gradients as the plain backward, or a RuntimeError), and on
    the measured releases it gives the measured answer (2.11 cannot, 2.13 and later can)."""
    takes = split_backward_takes_custom_functions()
    split, plain = _split_backward_through_the_fused_loss()
    if takes:
        assert not isinstance(split, Exception), split
        for got, want in zip(split, plain):
            assert got is not None
            torch.testing.assert_close(got, want)
    else:
        assert isinstance(split, RuntimeError) or split[1] is None, "the probe says no, but the split backward works"
    if TORCH_RELEASE in SPLIT_BACKWARD_KNOWN:
        assert takes == SPLIT_BACKWARD_KNOWN[TORCH_RELEASE]
    elif TORCH_RELEASE > max(SPLIT_BACKWARD_KNOWN):
        assert takes  # a newer release lost what 2.13 has: the zero-bubble fused-loss layouts would leave CI


def test_mixed_precision_policy_follows_the_config_on_cuda_and_is_fp32_on_cpu(monkeypatch):
    """FSDP2's policy: training.mixed_precision_param / mixed_precision_reduce on CUDA; float32 throughout on CPU
    (gloo and CPU kernels: the parity tests compare fp32 with fp32), whatever they say. parallelize_llama hands
    apply_fsdp the policy of the config and the device type it is given."""
    import types

    from torch.distributed.fsdp import MixedPrecisionPolicy

    import models.llama3.parallelize as plan
    from parallelize.fsdp import mixed_precision_policy

    bf16, fp32 = torch.bfloat16, torch.float32
    for param, reduce in (("bfloat16", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16"),
                          ("float32", "float32")):
        want = MixedPrecisionPolicy(param_dtype=bf16 if param == "bfloat16" else fp32,
                                    reduce_dtype=bf16 if reduce == "bfloat16" else fp32)
        assert mixed_precision_policy(param, reduce, "cuda") == want
        assert mixed_precision_policy(param, reduce, "cpu") == MixedPrecisionPolicy(param_dtype=fp32, reduce_dtype=fp32)

    policies = []
    monkeypatch.setattr(plan, "apply_fsdp", lambda model, blocks, mesh, mp_policy, **kw: policies.append(mp_policy))
    dims = types.SimpleNamespace(tp_enabled=False, ep_enabled=False, cp_enabled=False, pp_enabled=False,
                                 data_parallel=True, tp=1, mesh=lambda name: name)
    for argv, device, want in (
        ([], "cuda", (bf16, fp32)),  # the defaults
        (["--training.mixed_precision_param", "float32", "--training.mixed_precision_reduce", "bfloat16"], "cuda",
         (fp32, bf16)),
        (["--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "bfloat16"], "cpu",
         (fp32, fp32)),
    ):
        cfg = parse_args(argv)
        plan.parallelize_llama(_meta_debug_model(), dims, cfg, device)
        assert (policies[-1].param_dtype, policies[-1].reduce_dtype) == want, (argv, device, policies[-1])
    assert len(policies) == 3


def _meta_debug_model():
    import dataclasses

    from models.llama3 import Transformer, llama3_flavors

    with torch.device("meta"):
        return Transformer(dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=256))


def test_schedule_table_matches_torch():
    """parallelize/pipeline_parallel.py names torch's schedule classes without importing them: the names exist and the
    multi-stage flags agree with torch's class hierarchy."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    from parallelize.pipeline_parallel import SCHEDULES, is_multi_stage, schedule_class

    assert sorted(SCHEDULES) == sorted(PP_SCHEDULES)
    for name in SCHEDULES:
        cls = schedule_class(name)
        assert issubclass(cls, PipelineScheduleMulti if is_multi_stage(name) else PipelineScheduleSingle), name


def compiled_tp_collective(world_size: int, rank: int, cache_dir: str) -> dict:
    """On an FSDP 2 x TP 2 mesh: the trainer's compiled loss over vocabulary-sharded logits (loss parallel: its
    log-softmax reduces over TP), forward and backward, with the compiler's on-disk cache in ``cache_dir`` keyed
    as the trainer keys it. Returns rank 0's loss and how many compiled graphs it loaded from
    the cache."""
    import os

    from torch._dynamo.utils import counters
    from torch.distributed.tensor import DTensor, Shard

    from models.loss import cross_entropy_sum
    from parallelize.compile import compile_loss, tag_compile_caches
    from parallelize.mesh import ParallelDims
    from parallelize.tensor_parallel import loss_context

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    dims = ParallelDims.from_config(parse_args(["--parallelism.dp_shard", "2", "--parallelism.tp", "2"]).parallelism,
                                    world_size)
    dims.build_mesh("cpu")
    tag_compile_caches(dims.group_names())
    tp = dims.mesh("tp")
    vocab = torch.arange(8.0).repeat(2, 3, 1)  # [batch 2, seq 3, vocab 8], the same on every rank
    logits = DTensor.from_local(vocab.chunk(2, dim=-1)[tp.get_local_rank()], tp, [Shard(-1)]).requires_grad_()
    with loss_context(True):
        loss = compile_loss(cross_entropy_sum)(logits, torch.full((2, 3), 7))
        loss.backward()
    return {"loss": float(loss.detach()), "cache_hits": counters["aot_autograd"]["autograd_cache_hit"]}


def test_compiled_collectives_reload_from_a_cache_shared_by_other_tp_groups(tmp_path):
    """The compiler's on-disk cache is shared by a node's ranks, but the code it holds names the process group it
    was compiled for. Keyed without the group (torch 2.13), a restarted run's ranks 0-1 load the code of ranks 2-3
    and their TP collective fails. The trainer keys the cache by the rank's groups (``tag_compile_caches``): a
    restart still reloads its own compiled code."""
    from tests.parallel_harness import run_jobs

    cache = str(tmp_path / "cache")
    for run in ("first", "restart"):
        result = run_jobs(4, compiled_tp_collective, {run: (cache,)}, str(tmp_path / run))[run]
        # 6 tokens whose target is the largest of the logits 0..7: each loses log(sum(e^(k - 7)))
        assert result["loss"] == pytest.approx(6 * float(torch.logsumexp(torch.arange(8.0) - 7, 0)))
    if TORCH_RELEASE >= (2, 13):  # torch 2.11 does not cache graphs over DTensors at all (it cannot pickle them)
        assert result["cache_hits"] > 0


def tp_step_all_reduces(world_size: int, rank: int, dump: str) -> dict:
    """TP 2 without FSDP: the all-reduces of one forward and backward, and of one whole optimizer step, counted by
    DTensor's CommDebugMode (it sees the functional and the c10d collectives)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from tests.parallel_harness import build_trainer

    trainer = build_trainer(["--parallelism.tp", "2", "--training.local_batch_size", "4"], world_size, rank, 3, dump)
    batches = [{k: v[:4] for k, v in b.items()} for b in global_batches(4, 3)]
    trainer.train_step([batches[0]])  # the optimizer's state exists from here on
    with CommDebugMode() as forward_backward:
        trainer.forward_backward([batches[1]])
    trainer.optimizer.zero_grad(set_to_none=True)
    with CommDebugMode() as step:
        trainer.train_step([batches[2]])
    trainer.metrics.close()

    def all_reduces(mode) -> int:
        return sum(n for op, n in mode.get_comm_counts().items() if "all_reduce" in str(op) or "allreduce" in str(op))

    return {"forward_backward": all_reduces(forward_backward), "step": all_reduces(step)}


def test_tp_without_fsdp_reduces_the_norm_gradients_once(tmp_path):
    """TP without FSDP leaves the sequence-parallel norms' gradients Partial (summed over the TP ranks); every op
    that read them reduced them again: clipping and AdamW made 53 all-reduces per step on the debug model. The
    trainer reduces them once, in one all-reduce (``reduce_partial_grads``), so a step adds exactly three to its
    forward and backward: that one, the gradient norm's and the logged loss's. (The tp layouts of
    test_parallel_layouts_match_single_process check the reduced gradients themselves.)"""
    from tests.parallel_harness import run_jobs

    counts = run_jobs(2, tp_step_all_reduces, {"tp2": (str(tmp_path / "run"),)}, str(tmp_path / "jobs"))["tp2"]
    assert counts["step"] - counts["forward_backward"] == 3, counts


def rope_table_dtype_under_fsdp(world_size: int, rank: int) -> dict:
    """FSDP with CUDA's bf16 parameter policy, on CPU: the dtypes of the hidden state and of the RoPE table that
    each block's attention receives."""
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from models.llama3 import Transformer, llama3_flavors
    from parallelize.fsdp import apply_fsdp

    args = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=64, n_layers=2, max_seq_len=256)
    torch.manual_seed(0)
    model = Transformer(args)
    seen = []
    for block in model.layers.values():
        block.attention.register_forward_pre_hook(lambda module, a: seen.append((a[0].dtype, a[1].dtype)))
    apply_fsdp(model, list(model.layers.values()), init_device_mesh("cpu", (world_size,)),
               MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    model(torch.randint(0, 64, (1, 256)))
    return {"seen": seen}


def test_fsdp_bf16_keeps_the_rope_table_fp32(tmp_path):
    """FSDP's bf16 policy casts a module's floating-point forward inputs; the blocks receive the model's fp32 RoPE
    table as one, and cosines and sines rounded to bf16 stretch the rotated vectors (by up to 3e-3). Only the root
    casts the model's inputs: each block gets the bf16 hidden state and the fp32 table."""
    from tests.parallel_harness import run_jobs

    seen = run_jobs(2, rope_table_dtype_under_fsdp, {"run": ()}, str(tmp_path))["run"]["seen"]
    assert seen == [(torch.bfloat16, torch.float32)] * 2


def test_op_policy_saves_the_matmuls_and_the_attention_kernel_not_the_math_kernels_scores():
    """Per-op AC (parallelize/activation_checkpoint.py) saves the linear layers' mm and the fused attention kernel's output;
    under the math attention kernel (model.sdpa_backend = math) it saves neither of its bmm, whose first result is
    the [B, H, S, S] scores."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from parallelize.activation_checkpoint import op_policy

    saved, seen = [], set()
    base = op_policy("all")

    def policy(ctx, op, *args, **kwargs):
        decision = base(ctx, op, *args, **kwargs)
        seen.add(str(op))
        if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            saved.append(str(op))
        return decision

    linear = torch.nn.Linear(16, 48, bias=False)

    def attention(x):
        q, k, v = linear(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)  # each [B, H, S, D]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    x = torch.randn(2, 8, 16, requires_grad=True)
    for backend, kernel in ((SDPBackend.MATH, []),
                            (SDPBackend.FLASH_ATTENTION, ["aten._scaled_dot_product_flash_attention_for_cpu.default"])):
        saved.clear()
        seen.clear()
        with sdpa_kernel(backend):
            out = checkpoint(attention, x, use_reentrant=False,
                             context_fn=lambda: create_selective_checkpoint_contexts(policy))
            out.sum().backward()
        assert saved == ["aten.mm.default", *kernel], (backend, saved)
        assert ("aten.bmm.default" in seen) == (backend == SDPBackend.MATH), seen
