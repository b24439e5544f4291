"""Expert parallelism (parallelize/expert_parallel.py) against one process: the 2-layer MoE debug flavor of qwen3 on
gloo ranks (CPU, fp32, deterministic), its experts spread over ep ranks and composed with FSDP, TP, PP, CP and HSDP.

Each layout trains the same global batches from the same initial weights as one process and must give its losses
and gradient norms (relative 1e-5), its first-step gradients of every parameter, and its routing: the tokens each
expert received in the first step, summed over the ranks, equal to the single process's. The load-balancing loss is
trained (its statistics over every rank's tokens, as one process's over the batch), except under the pipeline,
whose microbatches are forwards of their own (as gradient accumulation's): that layout is held to a run without
it."""

import shutil

import pytest
import torch

from tests.parallel_harness import AOT_EAGER, global_batches, run_layout, run_world

STEPS = 3
GLOBAL = 8
MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe_L2"]  # 2 layers: depth adds nothing here
# A weight at which the loss's gradient moves the router's gradients well past the tolerances.
AUX = ["--model.moe_aux_loss_coeff", "0.1"]


def _layout(local: int, *args: str, aux: bool = True) -> list[str]:
    return [*MOE, "--training.local_batch_size", str(local), *args, *(AUX if aux else [])]


def _dims(**degrees: int) -> list[str]:
    return [arg for name, value in degrees.items() for arg in (f"--parallelism.{name}", str(value))]


LAYOUTS = {
    2: {
        "ep2": _layout(4, *_dims(dp_shard=2, ep=2)),
        # ep drawn from cp: the two halves of each sequence route to each other's experts; full AC recomputes the
        # dispatch in backward (and counts the tokens once)
        "cp2_ep2_ac_full": _layout(8, *_dims(dp_shard=1, cp=2, ep=2), "--activation_checkpoint.mode", "full"),
        # compiled blocks around the dispatch (it stays out of the graphs), under per-op AC, whose recomputation
        # all-gathers the experts inside the checkpointed block; the graphs run by eager kernels (AOT_EAGER, as
        # test_parallel's TP and CP layouts), Inductor's MoE kernels being test_moe's
        "ep2_compile_ac_op": _layout(4, *_dims(dp_shard=2, ep=2), *AOT_EAGER, "--activation_checkpoint.mode",
                                     "selective"),
    },
    4: {
        "ep4": _layout(2, *_dims(dp_shard=4, ep=4)),
        # the experts sharded by FSDP over the 2 ranks holding the same ones
        "ep2_fsdp2": _layout(2, *_dims(dp_shard=4, ep=2)),
        # attention TP-split, the MoE layers on each rank's sequence shard, FSDP over tp too
        "ep2_tp2": _layout(4, *_dims(dp_shard=2, tp=2, ep=2)),
        "fsdp2_tp2": _layout(4, *_dims(dp_shard=2, tp=2)),
        "pp2_ep2": _layout(4, *_dims(pp=2, dp_shard=2, ep=2), "--parallelism.pp_schedule", "1F1B", aux=False),
        "hsdp2_ep2": _layout(2, *_dims(dp_replicate=2, dp_shard=2, ep=2)),
    },
}


def routing(trainer) -> dict:
    """A probe (every rank, after the first step): the step's tokens per expert of this rank's MoE layers, summed
    over the ranks, and the placements of the first MoE layer's experts."""
    from tests.parallel_harness import _placements

    block = next(iter(trainer.model_parts[0].layers.values()))
    return {"counts": trainer.balance.last_counts.clone(),
            "experts": _placements(getattr(block, "_checkpoint_wrapped_module", block).feed_forward.experts.w1)}


@pytest.fixture(scope="module")
def batches():
    return global_batches(GLOBAL, STEPS)


@pytest.fixture(scope="module")
def references(batches, tmp_path_factory):
    """One process's run, with the load-balancing loss trained (True) and without it (False)."""
    results = {}
    for aux in (True, False):
        dump = tmp_path_factory.mktemp("ref")
        results[aux] = run_layout(_layout(GLOBAL, aux=aux), 1, 0, batches, str(dump), probe=routing)
        shutil.rmtree(dump)
    return results


@pytest.fixture(scope="module")
def reference(references):
    return references[True]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def world_results(request, batches, tmp_path_factory):
    layouts = LAYOUTS[request.param]
    out = tmp_path_factory.mktemp(f"w{request.param}")
    results = run_world(request.param, layouts, {name: batches for name in layouts}, str(out), probe=routing)
    shutil.rmtree(out)
    return results


def test_reference_trains_and_routes_every_token(reference):
    assert reference["losses"][-1] < reference["losses"][0]
    counts = reference["probe"]["counts"]
    assert counts.shape == (2, 8) and bool((counts.sum(1) == GLOBAL * 64 * 2).all())  # 2 layers, 8 experts, top-2


def test_the_trained_load_balancing_loss_changes_the_gradients(references):
    """What makes the layouts' check of it one that can fail."""
    assert references[True]["grad_norms"] != pytest.approx(references[False]["grad_norms"], rel=1e-4)


def test_layouts_match_one_process(world_results, references):
    for name, result in world_results.items():
        assert "error" not in result, (name, result.get("error"))
        reference = references[AUX[0] in next(ls[name] for ls in LAYOUTS.values() if name in ls)]
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5), name
        assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5), name
        assert set(result["grads"]) == set(reference["grads"]), name
        for key, g in result["grads"].items():
            torch.testing.assert_close(g, reference["grads"][key], rtol=1e-4, atol=1e-7,
                                       msg=lambda m: f"{name} {key}: {m}")
        counts = result["probe"]["counts"]  # a pipeline's first stage holds the first layers only
        assert torch.equal(counts, reference["probe"]["counts"][:len(counts)]), name
        experts = result["probe"]["experts"]
        if "ep" in name:
            assert experts["ep"] == "Shard(0)", (name, experts)
        assert result["built"]["dtensor_params"], name
    built = {name: result["built"] for name, result in world_results.items()}
    if "ep2_compile_ac_op" in built:
        assert built["ep2_compile_ac_op"]["compiled"] == built["ep2_compile_ac_op"]["checkpointed"] == 2
        assert built["cp2_ep2_ac_full"]["checkpointed"] == 2


def test_a_checkpoint_saved_on_ep2_resumes_on_ep4_and_on_one_process(tmp_path):
    """A MoE run on EP 2 saves at step 2 of 4; resumed from that checkpoint on EP 4 (the experts' shards
    regrouped over twice the ranks) and on one process (whole), steps 3 and 4 give the uninterrupted run's losses
    and gradient norms. The global batch is the same on every layout (gradient accumulation makes up the ranks)."""
    from engine.plot import read_metrics
    from tests.parallel_harness import run_jobs, train_job

    common = [*MOE, "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.global_batch_size",
              "8", "--data.num_shards", "4", "--training.steps", "4", "--checkpoint.enable",
              "--checkpoint.interval", "2", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
              "--debug.deterministic", "--optimizer.implementation", "for-loop"]

    def curve(dump) -> dict[int, tuple[float, float]]:
        return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(str(dump / "metrics.jsonl"))}

    saved = tmp_path / "ep2"
    run_jobs(2, train_job, {"run": ([*common, "--job.dump_folder", str(saved), *_dims(dp_shard=2, ep=2)], {})},
             str(tmp_path / "jobs_ep2"))
    uninterrupted = curve(saved)
    assert sorted(uninterrupted) == [1, 2, 3, 4]
    for world, dims in ((4, _dims(dp_shard=4, ep=4)), (1, [])):
        dump = tmp_path / f"world{world}"
        shutil.copytree(saved / "checkpoint" / "step-000002", dump / "checkpoint" / "step-000002")
        run_jobs(world, train_job, {"run": ([*common, "--job.dump_folder", str(dump), *dims], {})},
                 str(tmp_path / f"jobs{world}"))
        resumed = curve(dump)  # resumed at step 2, not started over
        assert sorted(resumed) == [3, 4], (world, sorted(resumed))
        for step in (3, 4):
            loss, norm = resumed[step]
            assert loss == pytest.approx(uninterrupted[step][0], rel=1e-5), (world, step)
            assert norm == pytest.approx(uninterrupted[step][1], rel=1e-5), (world, step)
