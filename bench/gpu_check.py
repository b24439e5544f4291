"""The GPU check: every CUDA code path of Tessera, one PASS or FAIL line each, in one command.

    python3 bench/gpu_check.py [--only NAME,...] [--budget SECONDS] [--jobs N] [--list]

On a freshly started Hopper machine (device call: carry .whl, filled by bench/prepare_device.sh; about 8
minutes). Every path trains at a small shape (the debug model, seq 512, 10 steps unless said) and checks what
can fail:

- the reference runs (one GPU, eager, no AC) must log every step with a finite loss that falls by 10%;
- a path that computes the same thing another way (AC, compile, FSDP2 on one rank, the fused loss, ...) must
  give the reference's loss curve within the tolerance its line states (relative, at every step);
- a resumed checkpoint must give the uninterrupted run's losses and gradient norms bit for bit (deterministic
  mode, the math attention kernel);
- an exported Hugging Face folder must give transformers' logits on CUDA;
- processes sharing the GPU over gloo (NCCL refuses two ranks on one GPU) must match one process;
- a launcher SIGKILLed mid-run must leave no process on the GPU 10 s later.

The runs go to RUNS (default /tmp/tessera_gpu_check), up to --jobs at a time; the PASS/FAIL lines, with each
failed run's last lines, go to the console and to $OUT/gpu_check.txt. Exit status 1 if any path failed. A run
that did not finish inside --budget fails its paths ("no result"): nothing is assumed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the model registry, for the shipped configs' flavors
    sys.path.insert(0, str(ROOT))

from engine import lifetime  # noqa: E402  (the processes of a killed launcher)

SMALL = ["--config", "train_configs/debug_model.toml", "--training.steps", "10", "--training.seq_len", "512",
         "--training.local_batch_size", "8", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2",
         "--optimizer.lr", "2e-3", "--data.num_shards", "4", "--comm.init_timeout_seconds", "180",
         "--comm.train_timeout_seconds", "60"]
FSDP = ["--parallelism.fsdp_single_rank"]
COMPILE = ["--compile.enable"]
OP_AC = ["--activation_checkpoint.mode", "selective"]
FULL_AC = ["--activation_checkpoint.mode", "full"]
FLOAT8 = ["--float8.enable"]
FP32 = ["--training.mixed_precision_param", "float32"]
CKPT = ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3", "--debug.deterministic",
        "--model.sdpa_backend", "math"]
MOE = ["--config", "train_configs/qwen3_moe_debug.toml", *SMALL[2:]]  # Qwen3-MoE debug: 8 experts, top 2
EMPTY_CACHE = ["--training.empty_cache_after_first_step"]
BF16_WEIGHTS = ["--training.fsdp_bf16_weights"]
L2_8B = ["--model.flavor", "8B_L2", "--training.seq_len", "8192", "--training.local_batch_size", "1",
         "--training.steps", "5"]
L2_8B_GIB = 36.0  # tools.memory estimates a 26 GiB peak; the allocator's cache and compilation take more


@dataclasses.dataclass
class Run:
    label: str
    args: list[str]
    ngpu: int = 1
    env: dict = dataclasses.field(default_factory=dict)
    after: Optional[str] = None  # a run that must have finished first (a resume of its folder)
    folder: Optional[str] = None  # another run's folder (a resume); default: its own
    expect_kill: bool = False  # it kills itself (a fault point): ends with SIGKILL
    gib: float = 4.0  # GPU memory it may take (all its processes): runs start only while the sum fits the GPU


def shipped_config_runs() -> list[Run]:
    """Every train_configs/*.toml with the debug model (its MoE or tied-embedding one where the config's model is)
    and the built-in data, its other options kept; its parallel degrees (tp, cp, dp_replicate) capped at 2 and run
    as that many processes over gloo. Not pp: stages pass activations by send/recv, which gloo does not take for
    CUDA tensors (and NCCL refuses two ranks on one GPU), so one GPU cannot run a pipeline; the CPU tests prove it."""
    import tomllib

    from models.registry import get_model_spec

    runs = []
    for path in sorted((ROOT / "train_configs").glob("*.toml")):
        with open(path, "rb") as f:
            config = tomllib.load(f)
        p, model = config.get("parallelism", {}), config.get("model", {})
        spec = get_model_spec(model.get("name", "llama3"))
        shipped = spec.flavors[model.get("flavor", "debugmodel")]
        moe = getattr(shipped, "moe", None) is not None
        tied = getattr(shipped, "tie_embeddings", False) and "debugmodel_tied" in spec.flavors
        small = "debugmodel_moe" if moe else "debugmodel_tied" if tied else "debugmodel"
        degrees = {k: min(int(p.get(k, 1)), 2) for k in ("dp_replicate", "tp", "cp", "ep")}
        degrees["pp"] = 1
        # Expert parallelism draws its ranks from dp_shard x cp: an ep of 2 without cp takes dp_shard 2.
        dp_shard = 2 if degrees["ep"] > degrees["cp"] else 1
        world = math.prod(v for k, v in degrees.items() if k != "ep") * dp_shard
        args = ["--config", str(path.relative_to(ROOT)), "--model.flavor", small,
                "--model.hf_assets_path", "", "--data.dataset", "tessera_docs", "--data.streaming", "false",
                "--training.steps", "3", "--training.seq_len", "256", "--metrics.log_freq", "1",
                "--metrics.enable_tensorboard", "false", "--parallelism.dp_shard", str(dp_shard) if world > 1 else "-1"]
        for key, value in degrees.items():
            args += [f"--parallelism.{key}", str(value)]
        runs.append(Run(f"config_{path.stem}", args, ngpu=world, env={"TESSERA_BACKEND": "gloo"} if world > 1 else {}))
    return runs


def runs() -> list[Run]:
    out = [
        # One GPU: the reference (eager, no AC), AC, compile.
        Run("eager", SMALL), Run("eager_op_ac", SMALL + OP_AC), Run("eager_full_ac", SMALL + FULL_AC),
        Run("compile", SMALL + COMPILE), Run("compile_op_ac", SMALL + COMPILE + OP_AC),
        Run("compile_full_ac", SMALL + COMPILE + FULL_AC),
        Run("float8_tensorwise", SMALL + COMPILE + FLOAT8),
        Run("float8_rowwise", SMALL + COMPILE + FLOAT8 + ["--float8.recipe", "rowwise"]),
        Run("fused_loss", SMALL + ["--training.loss_chunk_tokens", "1024"]),
        Run("fused_loss_compile", SMALL + COMPILE + ["--training.loss_chunk_tokens", "1024"]),
        Run("flex_causal", SMALL + COMPILE + ["--model.attn", "flex"]),
        Run("flex_documents", SMALL + COMPILE + ["--model.attn", "flex", "--model.attn_mask", "block_causal"]),
        Run("flash_attn", SMALL + ["--model.attn", "flash_attn"]),
        # FSDP2 on one rank: the code path of every FSDP, HSDP and FSDP x TP run.
        Run("fsdp", SMALL + FSDP), Run("fsdp_compile", SMALL + FSDP + COMPILE),
        Run("fsdp_compile_op_ac", SMALL + FSDP + COMPILE + OP_AC),
        Run("fsdp_float8", SMALL + FSDP + COMPILE + FLOAT8 + ["--float8.fsdp_float8_all_gather",
                                                             "--float8.precompute_scale"]),
        Run("fsdp_cpu_offload", SMALL + FSDP + ["--parallelism.fsdp_cpu_offload"]),
        Run("fsdp_reshard_never", SMALL + FSDP + ["--parallelism.fsdp_reshard_after_forward", "never"]),
        Run("fsdp_grad_accumulation", SMALL + FSDP + ["--training.local_batch_size", "4",
                                                      "--training.global_batch_size", "8"]),
        Run("fsdp_fused_adamw", SMALL + FSDP + ["--optimizer.implementation", "fused"]),
        Run("fsdp_foreach_adamw", SMALL + FSDP + ["--optimizer.implementation", "foreach"]),
        # FSDP2's shards stored as bf16 + low half (training.fsdp_bf16_weights).
        Run("fsdp_bf16_weights", SMALL + FSDP + COMPILE + OP_AC + BF16_WEIGHTS),
        # The crash of FSDP2 + compile with the default (fused) AdamW, at the shape it was found at, with the
        # cache emptied after the first step (the device synchronized first), which it crashed with.
        Run("fsdp_compile_8b_l2", SMALL + FSDP + COMPILE + L2_8B + EMPTY_CACHE, gib=L2_8B_GIB),
        Run("fsdp_compile_op_ac_float8_8b_l2", SMALL + FSDP + COMPILE + OP_AC + FLOAT8 + L2_8B + EMPTY_CACHE,
            gib=L2_8B_GIB),
        # Mixture-of-Experts (torch._grouped_mm on Hopper): eager, compiled, FSDP2 on one rank with per-op AC.
        Run("moe_eager", MOE), Run("moe_compile", MOE + COMPILE),
        Run("moe_fsdp_compile_op_ac", MOE + FSDP + COMPILE + OP_AC),
        Run("moe_deterministic", MOE + ["--debug.deterministic"]),  # only deterministic kernels (the expert counts)
        # Checkpoints on CUDA: an uninterrupted run; each save mode killed after step 3's commit, then resumed.
        Run("ckpt_whole", SMALL + CKPT),
        # Hugging Face export, then transformers' logits.
        Run("hf_export", SMALL + ["--training.steps", "3", "--checkpoint.enable", "--checkpoint.last_save_hf",
                                  "--checkpoint.export_dtype", "float32"]),
        # Processes sharing the GPU over gloo, against one process (fp32: the comparison is tight).
        Run("one_fp32", SMALL + FP32),
        Run("gloo_fsdp2", SMALL + FP32 + ["--parallelism.dp_shard", "2", "--training.local_batch_size", "4"],
            ngpu=2, env={"TESSERA_BACKEND": "gloo"}),
        # FSDP 2 in bf16 on split shards, against FSDP2 on the one rank (the same global batch).
        Run("gloo_fsdp2_bf16_weights", SMALL + BF16_WEIGHTS + ["--parallelism.dp_shard", "2",
                                                               "--training.local_batch_size", "4"],
            ngpu=2, env={"TESSERA_BACKEND": "gloo"}),
        Run("gloo_hsdp2x2", SMALL + FP32 + ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2",
                                            "--training.local_batch_size", "2"], ngpu=4, env={"TESSERA_BACKEND": "gloo"}),
        Run("gloo_tp2", SMALL + FP32 + ["--parallelism.tp", "2", "--parallelism.dp_shard", "1"], ngpu=2,
            env={"TESSERA_BACKEND": "gloo"}),
        Run("gloo_cp2", SMALL + FP32 + ["--parallelism.cp", "2", "--parallelism.dp_shard", "1"], ngpu=2,
            env={"TESSERA_BACKEND": "gloo"}),
        # Expert parallelism: the token all-to-alls on CUDA tensors, against the MoE model in one process.
        Run("moe_one_fp32", MOE + FP32),
        Run("gloo_ep2", MOE + FP32 + ["--parallelism.dp_shard", "2", "--parallelism.ep", "2",
                                      "--training.local_batch_size", "4"], ngpu=2, env={"TESSERA_BACKEND": "gloo"}),
        Run("gloo_ep2_tp2", MOE + FP32 + ["--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--parallelism.tp",
                                          "2", "--training.local_batch_size", "4"], ngpu=4,
            env={"TESSERA_BACKEND": "gloo"}),
    ]
    for mode in ("disabled", "async", "async_with_pinned_mem"):
        args = SMALL + CKPT + ["--checkpoint.async_mode", mode]
        out.append(Run(f"ckpt_{mode}_killed", args, env={"TESSERA_FAULT_AT": "3:committed"}, expect_kill=True))
        out.append(Run(f"ckpt_{mode}_resumed", args, after=f"ckpt_{mode}_killed", folder=f"ckpt_{mode}_killed"))
    return out + shipped_config_runs()


# ------------------------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    returncode: Optional[int]  # None: not run (no time left, or the run it follows failed)
    seconds: float
    log: str


def launch(run: Run, runs_dir: Path, deadline: float) -> Result:
    folder = runs_dir / (run.folder or run.label)
    log_path = runs_dir / f"{run.label}.log"
    if run.folder is None:
        shutil.rmtree(folder, ignore_errors=True)
    left = deadline - time.time()
    if left < 20:
        return Result(None, 0.0, "not run: the time budget was spent")
    env = {**os.environ, "NGPU": str(run.ngpu), "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1", **run.env}
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(ROOT / "run_train.sh"), *run.args, "--job.dump_folder", str(folder)],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    text = log_path.read_text(errors="replace")
    if code is None:
        text += f"\n(killed at the time budget, after {time.time() - t0:.0f} s)"
    return Result(code, time.time() - t0, text)


def query_gpu(field: str) -> list[int]:
    """nvidia-smi's ``field`` (memory.total, memory.used: MiB) of each GPU; none where there is no nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    return [int(line) for line in out.split() if line.strip().isdigit()]


def gpu_memory_used_mib() -> int:
    return sum(query_gpu("memory.used"))


def gpu_memory_gib() -> float:
    """The GPU's memory (nvidia-smi), or infinity where there is none."""
    total = query_gpu("memory.total")
    return total[0] / 1024 if total else math.inf


def run_all(plan: list[Run], runs_dir: Path, jobs: int, deadline: float,
            memory_gib: float = math.inf) -> dict[str, Result]:
    """Every run of ``plan``, ``jobs`` at a time and no more than ``memory_gib`` of their ``gib`` at once (a run
    alone may take more); a run waits for the one it follows."""
    results: dict[str, Result] = {}
    pending = list(plan)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        running: dict[concurrent.futures.Future, Run] = {}
        while pending or running:
            for run in [r for r in pending if r.after is None or r.after in results]:
                if len(running) >= jobs:
                    break
                if running and sum(r.gib for r in running.values()) + run.gib > memory_gib:
                    continue
                pending.remove(run)
                before = results.get(run.after) if run.after else None
                if before is not None and before.returncode is None:
                    results[run.label] = Result(None, 0.0, f"not run: {run.after} did not run")
                    continue
                running[pool.submit(launch, run, runs_dir, deadline)] = run
            if not running:
                continue
            done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                run = running.pop(future)
                results[run.label] = future.result()
                print(f"  ran {run.label}: exit {results[run.label].returncode} in {results[run.label].seconds:.0f} s",
                      flush=True)
    return results


# ------------------------------------------------------------------------------------------------------------
# Checking
# ------------------------------------------------------------------------------------------------------------


class Check:
    """One path's verdict: ok, and what was measured."""

    def __init__(self, ok: bool, detail: str):
        self.ok, self.detail = ok, detail


def records(folder: Path) -> dict[int, dict]:
    """step -> the training record of that step (a resumed segment's record replaces the earlier one)."""
    out: dict[int, dict] = {}
    path = folder / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if "loss" in r and "step" in r:
                out[r["step"]] = r
    return out


class Checker:
    def __init__(self, plan: list[Run], results: dict[str, Result], runs_dir: Path, device: str = "cuda"):
        self.plan = {r.label: r for r in plan}
        self.results = results
        self.runs_dir = runs_dir
        self.device = device  # where the logits are compared (the CPU in the tests of the check itself)

    def folder(self, label: str) -> Path:
        return self.runs_dir / (self.plan[label].folder or label)

    def given(self, label: str) -> dict[str, str]:
        """``label``'s arguments as flag -> the token after it (the last one given wins, as on the command line)."""
        args = self.plan[label].args
        return {a: args[i + 1] if i + 1 < len(args) else "" for i, a in enumerate(args)}

    def steps(self, label: str) -> int:
        return int(self.given(label)["--training.steps"])

    def says(self, label: str) -> list[str]:
        """What the trainer's start-up lines (the model line, the plan line read from the modules) must say for
        ``label`` to have run the path its arguments ask for, so that an option quietly not applied FAILs."""
        given = self.given(label)
        out = []
        for dim in ("dp_replicate", "dp_shard", "tp", "cp"):
            if int(given.get(f"--parallelism.{dim}", 1)) > 1:
                out.append(f"{dim} {given[f'--parallelism.{dim}']}")
        if int(given.get("--parallelism.ep", 1)) > 1:
            out.append(f"(ep {given['--parallelism.ep']})")
        sharded = "--parallelism.fsdp_single_rank" in given or any(
            int(given.get(f"--parallelism.{d}", 1)) > 1 for d in ("dp_replicate", "dp_shard"))
        if sharded:
            out.append("FSDP2 on")
            reshard = given.get("--parallelism.fsdp_reshard_after_forward")
            if reshard in ("never", "always"):
                out.append(f"({'none' if reshard == 'never' else 'all'} resharded after forward)")
        if "--compile.enable" in given:
            out.append("modules compiled")
        mode = given.get("--activation_checkpoint.mode")
        if mode in ("selective", "full"):
            out.append("blocks checkpointed " + ("per op" if mode == "selective" else "whole"))
        if "--float8.enable" in given:
            out.append(f"float8 {given.get('--float8.recipe', 'tensorwise')}"
                       + (" (emulated)" if "--float8.emulate" in given else "") + ": ")
        if "--float8.fsdp_float8_all_gather" in given:
            out.append("weights all-gathered in float8")
        if "--training.loss_chunk_tokens" in given:
            out.append(f"output loss fused in {given['--training.loss_chunk_tokens']}-token chunks")
        if "--model.attn" in given:
            out.append(f"attention {given['--model.attn']}")
        if "--parallelism.fsdp_cpu_offload" in given and self.device == "cuda":
            out.append("parameters in CPU memory")
        if "--training.fsdp_bf16_weights" in given and self.device == "cuda":
            out.append("FSDP2 on bf16 weights")
        elif "--optimizer.implementation" in given:
            out.append(f"AdamW {given['--optimizer.implementation']}")
        elif sharded and self.device == "cuda":
            out.append("AdamW fused")  # the default on CUDA, the one FSDP2 + compile crashed with
        if "--training.global_batch_size" in given and self.plan[label].ngpu == 1:
            accumulation = int(given["--training.global_batch_size"]) // int(given["--training.local_batch_size"])
            out.append(f"grad accumulation {accumulation}")
        return out

    def finished(self, label: str) -> Optional[Check]:
        """None if ``label`` ran to its end and logged every step with a finite loss; else the failure."""
        result = self.results.get(label)
        if result is None or result.returncode is None:
            return Check(False, f"{label}: no result ({result.log if result else 'not planned'})")
        if result.returncode != 0:
            lines = [line for line in result.log.splitlines() if line.strip()][-3:]
            return Check(False, f"{label}: exit {result.returncode}: " + " | ".join(lines)[-600:])
        unsaid = [text for text in self.says(label) if text not in result.log]
        if unsaid:
            return Check(False, f"{label}: its log does not say {unsaid}: the path it checks did not run as asked")
        recs = records(self.folder(label))
        missing = [s for s in range(1, self.steps(label) + 1) if s not in recs]
        if missing:
            return Check(False, f"{label}: steps {missing[:5]} not logged")
        bad = [s for s, r in recs.items() if not (isinstance(r["loss"], float) and math.isfinite(r["loss"]))]
        if bad:
            return Check(False, f"{label}: loss not finite at steps {bad[:5]}")
        return None

    def falls(self, label: str, by: float = 0.10) -> Check:
        failed = self.finished(label)
        if failed:
            return failed
        recs = records(self.folder(label))
        first, last = recs[1]["loss"], recs[self.steps(label)]["loss"]
        return Check(last < first * (1 - by), f"{label}: loss {first:.3f} -> {last:.3f} (must fall {by:.0%})")

    def close(self, label: str, reference: str, rtol: float, first_rtol: Optional[float] = None) -> Check:
        """The losses of ``label`` within ``rtol`` of ``reference``'s at every step; with ``first_rtol``, the first
        step's within it (the same initial weights: a loss curve's tolerance would let other weights pass)."""
        for run in (reference, label):
            failed = self.finished(run)
            if failed:
                return failed
        got, want = records(self.folder(label)), records(self.folder(reference))
        steps = range(1, min(self.steps(label), self.steps(reference)) + 1)
        gaps = {s: abs(got[s]["loss"] - want[s]["loss"]) / abs(want[s]["loss"]) for s in steps}
        worst = max(gaps.values())
        first = "" if first_rtol is None else f", step 1 within {gaps[1]:.1e} (tolerance {first_rtol:g})"
        ok = worst <= rtol and (first_rtol is None or gaps[1] <= first_rtol)
        return Check(ok, f"{label}: losses within {worst:.1e} of {reference}'s (tolerance {rtol:g}){first}, "
                         f"last {got[steps[-1]]['loss']:.4f} vs {want[steps[-1]]['loss']:.4f}")

    def exact_resume(self, mode: str) -> Check:
        killed, resumed = f"ckpt_{mode}_killed", f"ckpt_{mode}_resumed"
        result = self.results.get(killed)
        if result is None or result.returncode != -signal.SIGKILL:
            return Check(False, f"{killed}: expected to die of SIGKILL after step 3's commit, got "
                                f"{result.returncode if result else 'no result'}")
        for run in ("ckpt_whole", resumed):
            failed = self.finished(run)
            if failed:
                return failed
        if "resumed from step 3" not in self.results[resumed].log:
            return Check(False, f"{resumed}: did not resume from step 3")
        if "files matched their checksums" not in self.results[resumed].log:  # (written from the CUDA save)
            return Check(False, f"{resumed}: its checkpoint's files were not checked against their checksums")
        got, want = records(self.folder(resumed)), records(self.folder("ckpt_whole"))
        same = all((got[s]["loss"], got[s]["grad_norm"]) == (want[s]["loss"], want[s]["grad_norm"]) for s in (4, 5, 6))
        return Check(same, f"{mode}: steps 4-6 after the resume {'are' if same else 'are NOT'} bit-identical to the "
                           f"uninterrupted run ({[got[s]['loss'] for s in (4, 5, 6)]} vs "
                           f"{[want[s]['loss'] for s in (4, 5, 6)]})")

    def hf_logits(self) -> Check:
        failed = self.finished("hf_export")
        if failed:
            return failed
        folder = self.folder("hf_export") / "checkpoint" / "step-000003-hf"
        code = HF_LOGITS.format(folder=str(folder), device=self.device)
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
        if proc.returncode != 0:
            return Check(False, "hf logits: " + proc.stderr.strip().splitlines()[-1][-400:] if proc.stderr.strip()
                         else f"exit {proc.returncode}")
        diff = float(proc.stdout.split()[-1])
        return Check(diff <= 1e-3, f"max |Tessera - transformers| logits on {self.device} (fp32) = {diff:.2e} "
                                   "(tolerance 1e-3)")


HF_LOGITS = """
import json, torch, transformers
from engine.hf import load_hf, model_args_for
from models.registry import get_model_spec
torch.backends.cuda.matmul.allow_tf32 = False
folder, device = {folder!r}, {device!r}
vocab = json.load(open(folder + "/config.json"))["vocab_size"]
args = model_args_for("llama3", "debugmodel", vocab)
with torch.device("meta"):
    model = get_model_spec("llama3").model_cls(args)
model.to_empty(device=device)
model.init_weights()  # the RoPE table is a buffer, not in the folder: to_empty leaves it uninitialized
model.load_state_dict(load_hf(folder, args))
model.eval()
hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").to(device).eval()
tokens = torch.randint(0, vocab, (2, 256), generator=torch.Generator().manual_seed(0)).to(device)
with torch.no_grad():
    print((model(tokens) - hf(tokens).logits).abs().max().item())
"""


def killed_launcher_frees_the_gpu(runs_dir: Path, deadline: float) -> Check:
    """Two processes sharing the GPU over gloo, their launcher's process group SIGKILLed once they train: 10 s
    later no process the launcher started is alive and the GPU's used memory is back within 1 GiB of what it was
    before the run. (nvidia-smi's list of compute processes is empty in some sandboxes, gVisor's among them, so
    the workers are found from /proc and the GPU is read by its used memory.)"""
    folder = runs_dir / "killed_launcher"
    shutil.rmtree(folder, ignore_errors=True)
    if deadline - time.time() < 60:
        return Check(False, "no result: the time budget was spent")
    if not shutil.which("nvidia-smi"):
        return Check(False, "no nvidia-smi: not a GPU machine")
    before = gpu_memory_used_mib()
    env = {**os.environ, "NGPU": "2", "PYTHON": sys.executable, "TESSERA_BACKEND": "gloo"}
    with open(runs_dir / "killed_launcher.log", "w") as log:
        proc = subprocess.Popen([str(ROOT / "run_train.sh"), *SMALL, "--training.steps", "100000",
                                 "--job.dump_folder", str(folder)], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while len(records(folder)) < 3:
            if proc.poll() is not None or time.time() > deadline - 20:
                return Check(False, f"the run did not reach step 3 (exit {proc.poll()})")
            time.sleep(0.2)
        started = lifetime.descendants(proc.pid)
        held = gpu_memory_used_mib() - before
        if held < 256:
            return Check(False, f"the running workers hold {held} MiB of the GPU by nvidia-smi: cannot tell")
        os.killpg(proc.pid, signal.SIGKILL)
        t0 = time.time()
        while True:
            alive, used = [p for p in started if lifetime.running(p)], gpu_memory_used_mib()
            if not alive and used <= before + 1024:
                return Check(True, f"{time.time() - t0:.1f} s after the kill no process of the run was alive "
                                   f"({len(started)} before) and the GPU held {used - before} MiB more than before "
                                   f"the run ({held} MiB while it trained)")
            if time.time() - t0 > 10:
                return Check(False, f"10 s after the kill processes {alive} were alive and the GPU held "
                                    f"{used - before} MiB more than before the run ({held} MiB while it trained)")
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def checks(c: Checker) -> list[tuple[str, list[str], Callable[[], Check]]]:
    """(path, the runs it reads, its verdict)."""
    def close(label: str, reference: str, rtol: float, first_rtol: Optional[float] = None):
        return [label, reference], lambda: c.close(label, reference, rtol, first_rtol)

    def trains(label: str, what: str):
        return [label], lambda: c.finished(label) or Check(True, what)

    out = [
        ("one GPU eager", ["eager"], lambda: c.falls("eager")),
        ("one GPU eager, per-op AC", *close("eager_op_ac", "eager", 1e-2)),
        ("one GPU eager, full AC", *close("eager_full_ac", "eager", 1e-2)),
        ("one GPU compiled", *close("compile", "eager", 2e-2)),
        ("one GPU compiled, per-op AC", *close("compile_op_ac", "compile", 1e-2)),
        ("one GPU compiled, full AC", *close("compile_full_ac", "compile", 1e-2)),
        ("float8 tensorwise", *close("float8_tensorwise", "compile", 5e-2)),
        ("float8 rowwise", *close("float8_rowwise", "compile", 5e-2)),
        ("fused output loss", *close("fused_loss", "eager", 1e-2)),
        ("fused output loss, compiled", *close("fused_loss_compile", "compile", 1e-2)),
        ("flex attention, causal", *close("flex_causal", "compile", 2e-2)),
        ("flex attention, document masking", ["flex_documents"], lambda: c.falls("flex_documents")),
        ("flash_attn", *close("flash_attn", "eager", 2e-2)),
        ("FSDP2 one rank", *close("fsdp", "eager", 2e-2)),
        ("FSDP2 one rank, compiled", *close("fsdp_compile", "fsdp", 2e-2)),
        ("FSDP2 one rank, compiled, per-op AC", *close("fsdp_compile_op_ac", "fsdp_compile", 1e-2)),
        ("FSDP2 one rank, float8 with float8 all-gather", *close("fsdp_float8", "float8_tensorwise", 5e-2)),
        ("FSDP2 one rank, CPU offload", *close("fsdp_cpu_offload", "fsdp", 1e-2, first_rtol=1e-4)),
        ("FSDP2 one rank, reshard after forward never", *close("fsdp_reshard_never", "fsdp", 1e-2)),
        ("FSDP2 one rank, gradient accumulation", *close("fsdp_grad_accumulation", "fsdp", 2e-2)),
        ("FSDP2 one rank, fused AdamW", *close("fsdp_fused_adamw", "fsdp", 1e-2)),
        ("FSDP2 one rank, foreach AdamW", *close("fsdp_foreach_adamw", "fsdp", 1e-2)),
        ("FSDP2 one rank, bf16 weights, compiled, per-op AC",
         *close("fsdp_bf16_weights", "fsdp_compile_op_ac", 1e-2)),
        ("FSDP2 one rank, compiled, 8B_L2 seq 8192, default AdamW",
         *trains("fsdp_compile_8b_l2", "5 steps, finite losses")),
        ("FSDP2 one rank, compiled, per-op AC, float8, 8B_L2 seq 8192",
         *trains("fsdp_compile_op_ac_float8_8b_l2", "5 steps, finite losses")),
    ]
    out += [
        ("MoE one GPU eager", ["moe_eager"], lambda: c.falls("moe_eager")),
        ("MoE one GPU compiled", *close("moe_compile", "moe_eager", 2e-2)),
        ("MoE FSDP2 one rank, compiled, per-op AC", *close("moe_fsdp_compile_op_ac", "moe_compile", 2e-2)),
        ("MoE one GPU, deterministic kernels", *close("moe_deterministic", "moe_eager", 2e-2)),
    ]
    for mode, name in (("disabled", "sync"), ("async", "async"), ("async_with_pinned_mem", "async, pinned memory")):
        out.append((f"checkpoint {name}, killed and resumed",
                    ["ckpt_whole", f"ckpt_{mode}_killed", f"ckpt_{mode}_resumed"],
                    lambda mode=mode: c.exact_resume(mode)))
    out += [
        ("HF export, transformers' logits", ["hf_export"], c.hf_logits),
        ("gloo FSDP 2 (2 processes)", *close("gloo_fsdp2", "one_fp32", 1e-3)),
        ("gloo FSDP 2, bf16 weights (2 processes)", *close("gloo_fsdp2_bf16_weights", "fsdp", 2e-2)),
        ("gloo HSDP 2 x 2 (4 processes)", *close("gloo_hsdp2x2", "one_fp32", 1e-3)),
        ("gloo TP 2 (2 processes)", *close("gloo_tp2", "one_fp32", 1e-3)),
        ("gloo CP 2 (2 processes)", *close("gloo_cp2", "one_fp32", 1e-3)),
        ("gloo MoE EP 2 (2 processes)", *close("gloo_ep2", "moe_one_fp32", 1e-3)),
        ("gloo MoE EP 2 x TP 2 (4 processes)", *close("gloo_ep2_tp2", "moe_one_fp32", 1e-3)),
    ]
    for run in shipped_config_runs():
        out.append((f"{run.label.removeprefix('config_')}.toml, debug model, {run.ngpu} process(es)",
                    *trains(run.label, "3 steps, finite losses")))
    return out


def install_carried_wheels() -> None:
    """The packages the GPU machine lacks, carried in .whl (bench/prepare_device.sh), into /tmp/site for this
    process and the runs."""
    wheels = sorted(str(p) for p in (ROOT / ".whl").glob("*.whl"))
    if not wheels:
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", "/tmp/site", *wheels], check=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in ("/tmp/site", os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, "/tmp/site")


def add_flash_attn4() -> None:
    """FlashAttention 4, unzipped by bench/fa4_carry.sh (FA4_SITE), on the runs' path when it is there."""
    site = os.environ.get("FA4_SITE", "/tmp/site_fa4")
    if os.path.isdir(site):
        paths = (site, os.path.join(site, "nvidia_cutlass_dsl", "dsl_packages"), os.environ.get("PYTHONPATH"))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated run labels (default: all)")
    parser.add_argument("--budget", type=float, default=420, help="seconds for all runs (default 420)")
    parser.add_argument("--jobs", type=int, default=6, help="runs at a time (default 6)")
    parser.add_argument("--list", action="store_true", help="print the runs and their arguments, run nothing")
    args = parser.parse_args(argv)
    t0 = time.time()
    if not args.list:
        install_carried_wheels()  # before the plan: it reads the model registry (transformers and the rest)
        add_flash_attn4()
    plan = runs()
    if args.only:
        wanted = set(args.only.split(","))
        plan = [r for r in plan if r.label in wanted or r.after in wanted]
    if args.list:
        for run in plan:
            print(f"{run.label}: NGPU={run.ngpu} {' '.join(f'{k}={v}' for k, v in run.env.items())} "
                  f"./run_train.sh {' '.join(run.args)}")
        return 0
    deadline = t0 + args.budget
    runs_dir = Path(os.environ.get("RUNS") or "/tmp/tessera_gpu_check")  # (an empty RUNS too)
    runs_dir.mkdir(parents=True, exist_ok=True)
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    import torch

    memory = 0.9 * gpu_memory_gib()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}; {len(plan)} runs, {args.jobs} at a time "
          f"within {memory:.0f} GiB", flush=True)
    results = run_all(plan, runs_dir, args.jobs, deadline, memory)
    checker = Checker(plan, results, runs_dir, "cuda" if torch.cuda.is_available() else "cpu")
    lines = []
    labels = {r.label for r in plan}
    for name, needs, check in checks(checker):
        if not set(needs) <= labels:  # left out by --only
            continue
        verdict = check()
        lines.append(f"{'PASS' if verdict.ok else 'FAIL'} {name}: {verdict.detail}")
        print(lines[-1], flush=True)
    if not args.only or "killed_launcher" in args.only.split(","):
        verdict = killed_launcher_frees_the_gpu(runs_dir, deadline + 60)
        lines.append(f"{'PASS' if verdict.ok else 'FAIL'} a killed launcher frees the GPU within 10 s: {verdict.detail}")
        print(lines[-1], flush=True)
    failed = [line for line in lines if line.startswith("FAIL")]
    summary = f"{len(lines) - len(failed)} of {len(lines)} paths passed in {time.time() - t0:.0f} s"
    print(summary, flush=True)
    out = Path(os.environ.get("OUT", "/tmp/tessera_gpu_check_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.txt").write_text("\n".join(lines + [summary]) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
