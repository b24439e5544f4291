"""Layout planner: which parallel layout to train a model with on a given number of GPUs.

    python -m tools.planner --model llama3 --flavor 70B --gpus 256 --gpu-memory-gib 80 \\
        --seq-len 8192 --global-batch 256 [--gpus-per-node 8] [--out best.toml] [--top 15]

Enumerates layouts: degrees (dp_replicate, dp_shard, cp, tp, pp; ep for MoE models), activation checkpointing
(none, selective op, full), the local batch (and so gradient accumulation) and, with pp > 1, the pipeline schedule
(1F1B or Interleaved1F1B with 2 stages per rank) and its microbatches, and the fused output loss
(training.loss_chunk_tokens = ``--loss-chunk-tokens``, default 2048) where the plain loss's logits do not
fit: the same FLOPs, so it is tried only for a candidate that would otherwise not fit. Each candidate is a full Config (the model's
train_configs TOML with the layout's fields overridden); it is dropped when ``engine.config.validate`` rejects
it (tools.memory.validate_layout: every launch rule, without the tokenizer/data files) or when the
largest per-rank peak of tools/memory.py exceeds the usable memory (``--gpu-memory-gib`` minus
``--memory-margin``, default 10%, left to the allocator's fragmentation, the CUDA context and NCCL). The rest
are ranked by the step time of this cost model (per GPU, per optimizer step):

    compute   = FLOPs per token x tokens per step / GPUs x (1 + recompute) / (peak FLOP/s x MFU)
                FLOPs per token: the model spec's count (6 N + 12 L H D S, as the metrics' MFU); recompute:
                full AC 1/3 (the forward again), selective op 0.07; MFU: --mfu (default 0.40); peak:
                --peak-tflops (989, H100 bf16). docs/scale.md gives the measurements behind these defaults
    bubble    = compute x (pp - 1) / (microbatches x accumulation x stages per rank)   pipeline fill and
                drain, once per optimizer step (one schedule step runs every accumulation batch)
    tp        = per block and pass, 4 all-gathers/reduce-scatters of the T x d activations forward and 4 in
                backward (and the forward's 4 again with full AC): (tp - 1) / tp x T d x 2 bytes each; on the
                critical path
    cp        = per block and pass, the k/v all-gather forward, again in backward plus the fp32 dk/dv
                reduce-scatter (and the forward's again with full AC): (cp - 1) x T x 2 hkv / tp x (2 + 2 + 4)
                bytes; on the critical path
    ep        = MoE models, per MoE layer and pass: each token's k routed rows to their experts' ranks and back,
                forward and backward (and the forward's again with full AC): 4 x (ep - 1) / ep x k T / tp x d x 2
                bytes; on the critical path
    experts   = MoE models, per MoE layer and pass: the time the expert GEMMs wait on memory beyond their FLOPs
                (a roofline): the rank's E / ep experts' bf16 weights (3 d h each) read from HBM 3 times (forward,
                input and weight gradients; 4 with full AC), against the FLOPs of its k T / tp routed rows at the
                compute's rate; max(0, read - FLOPs time). Few tokens per expert (T k ep / (E tp), below
                peak x MFU / HBM bandwidth, about 118 on an H100 at 40%) leave the GEMMs bound by the weights;
                ep raises it. HBM: --hbm-gbps (3350, H100 SXM)
    pp p2p    = per microbatch and local stage, the activation forward and its gradient back: 2 x T d / tp x 2
    fsdp      = (n - 1) / n x params after TP x (2 per all-gather + 4 per reduce-scatter) bytes, n = dp_shard x cp:
                per pass a bf16 all-gather of the stage's parameters forward and one again in backward (forward
                only with fsdp_reshard_after_forward = never), and per gradient-accumulation step one fp32
                reduce-scatter of their gradients. Under PP the one schedule step of an optimizer step keeps
                its stage gathered over all its microbatches and reduces at its end: one all-gather and one
                reduce-scatter per step (unless reshard "always": the forward's gathers return)
    replicate = HSDP/DDP: all-reduce of the gradient shards over dp_replicate, once per optimizer step (the
                accumulation batches before the last only reduce-scatter): 2 (r - 1) / r x 4 bytes
    step      = compute + bubble + tp + cp + ep + experts + pp p2p + max(0, fsdp + replicate - overlap x compute)
FSDP and replicate traffic is prefetched and overlaps the compute (``--dp-overlap``, default 0.8 of it);
TP, CP and PP transfers are waited on. Each transfer takes volume / bandwidth, where the bandwidth is
``--intra-node-gbps`` (default 450 GB/s, NVLink on H100) when the dimension's group lies within one node and
``--inter-node-gbps`` (default 50 GB/s per GPU, 400 Gb/s InfiniBand) when it does not. The mesh order
decides: tp is innermost (stride 1), then cp, dp_shard, dp_replicate, and pp outermost; a group of size k and
stride s fits in a node when s x k <= --gpus-per-node. tokens/s/GPU = global batch x seq_len / step / GPUs.

The best layout is written as a TOML (``--out``) that ``./run_train.sh --config`` takes: the base TOML
(``--config``, default the train_configs file of the model and flavor) with the chosen fields set.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from engine.config import ArgumentParser
from tools import memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AC_MODES = (("none", "op"), ("selective", "op"), ("full", "op"))
RECOMPUTE = {"none": 0.0, "selective": 0.07, "full": 1.0 / 3.0}
SCHEDULES = ("1F1B", "Interleaved1F1B")


@dataclass
class CostModel:
    """The stated constants of the cost model (see the module docstring)."""

    peak_tflops: float = 989.0
    mfu: float = 0.40
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    gpus_per_node: int = 8
    dp_overlap: float = 0.8
    hbm_gbps: float = 3350.0


@dataclass
class Candidate:
    """One layout with its memory and cost."""

    cfg: object
    dims: object
    peak_gib: float
    step_s: float
    tokens_per_s_per_gpu: float
    costs: dict[str, float] = field(default_factory=dict)
    """Seconds per step by part: compute, bubble, tp, cp, ep, experts, pp, dp (exposed); and "dp traffic" (all of
    it)."""
    links: dict[str, str] = field(default_factory=dict)
    """For each communicating dimension: NVLink (in a node) or network."""

    @property
    def reason(self) -> str:
        """The step's largest costs besides compute, in words."""
        parts = [f"compute {self.costs['compute']:.2f}s"]
        for name in ("bubble", "tp", "cp", "ep", "experts", "pp"):
            seconds = self.costs.get(name, 0.0)
            if seconds >= 0.005 * self.step_s:
                link = f" {self.links[name]}" if name in self.links else ""
                parts.append(f"{name} {seconds:.2f}s{link}")
        traffic = self.costs.get("dp traffic", 0.0)
        if traffic >= 0.005 * self.step_s:
            parts.append(f"dp {traffic:.2f}s {self.links['dp']} ({self.costs['dp']:.2f}s exposed)")
        return ", ".join(parts)


# --------------------------------------------------------------------------------------------------------
# Enumeration
# --------------------------------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def base_config_path(model: str, flavor: str) -> Optional[str]:
    """The train_configs TOML whose [model] name and flavor match, if any."""
    from engine.config import parse_args

    for path in sorted(glob.glob(os.path.join(ROOT, "train_configs", "*.toml"))):
        cfg = parse_args(["--config", path])
        if cfg.model.name == model and cfg.model.flavor == flavor:
            return path
    return None


def layouts(gpus: int, shape: memory.ModelShape, seq_len: int, gpus_per_node: int):
    """Degrees (dp_replicate, dp_shard, cp, tp, pp, ep) worth trying: tp within a node and dividing the KV heads,
    cp and pp powers of two (pp at most half the layers), every dp_replicate that divides what is left; for a MoE
    model, every ep dividing the experts and dp_shard x cp whose all-to-all stays within a node (tp x ep GPUs)."""
    for tp in divisors(gpus):
        if tp > gpus_per_node or shape.n_kv_heads % tp:
            continue
        for cp in (1, 2, 4, 8, 16):
            if gpus % (tp * cp) or seq_len % (2 * cp * tp if cp > 1 else tp):
                continue
            for pp in (1, 2, 4, 8, 16, 32, 64):
                if gpus % (tp * cp * pp) or pp > max(1, shape.n_layers // 2):
                    continue
                rest = gpus // (tp * cp * pp)
                for dp_replicate in divisors(rest):
                    dp_shard = rest // dp_replicate
                    for ep in divisors(dp_shard * cp) if shape.experts else (1,):
                        if ep == 1 or (shape.experts % ep == 0 and tp * ep <= gpus_per_node):
                            yield dp_replicate, dp_shard, cp, tp, pp, ep


def batch_options(per_dp: int, pp: int) -> list[tuple[int, int, str]]:
    """(local_batch_size, pipeline microbatches, schedule) for ``per_dp`` samples per data-parallel rank and
    step: without PP a local batch of 1 to 8 samples (the rest by gradient accumulation); with PP a local
    batch of up to 64 split into pp, 2 pp, 4 pp or 8 pp microbatches of at most 4 samples."""
    options = []
    for lbs in divisors(per_dp):
        if pp == 1:
            if lbs <= 8:
                options.append((lbs, 1, ""))
            continue
        if lbs > 64:
            continue
        for m in (pp, 2 * pp, 4 * pp, 8 * pp):
            if lbs % m or lbs // m > 4:
                continue
            options.extend((lbs, m, schedule) for schedule in SCHEDULES)
    return options


def candidate_config(base, dp_replicate, dp_shard, cp, tp, pp, lbs, micro, schedule, ac, seq_len, global_batch,
                     loss_chunk_tokens=0, ep=1):
    cfg = memory.copy_config(base)
    cfg.training.loss_chunk_tokens = loss_chunk_tokens
    p = cfg.parallelism
    p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp, p.ep = dp_replicate, dp_shard, cp, tp, pp, ep
    p.pp_layers_per_stage, p.pp_schedule_csv = [], ""  # the base's own split or schedule fits its own layout only
    if pp > 1:
        p.pp_schedule, p.pp_microbatches = schedule, micro
        p.pp_virtual_stages = 2
    cfg.training.seq_len = seq_len
    cfg.training.local_batch_size = lbs
    cfg.training.global_batch_size = global_batch
    cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_option = ac
    return cfg


# --------------------------------------------------------------------------------------------------------
# Cost
# --------------------------------------------------------------------------------------------------------


def _in_node(stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether every group of a mesh dimension (``size`` ranks, ``stride`` apart) lies within one node. A group
    spans a block of stride x size consecutive ranks, the blocks laid end to end from rank 0, so every block
    sits inside a node only when its size divides the node's GPU count (tp 4 on 6-GPU nodes: ranks 4-7 cross)."""
    return size == 1 or gpus_per_node % (stride * size) == 0


def step_cost(cfg, dims, shape: memory.ModelShape, flops_per_token: float, rows: list[memory.RankRow],
              model: CostModel) -> tuple[dict[str, float], dict[str, str]]:
    """Seconds per optimizer step by part (see the module docstring), for the busiest pipeline rank."""
    from engine.config.validation import grad_accumulation_steps, pp_microbatches

    t = cfg.training
    gpus = dims.world_size
    tokens_step = t.global_batch_size * t.seq_len
    ga = grad_accumulation_steps(cfg, dims.dp)
    micro = pp_microbatches(cfg, dims) if dims.pp > 1 else 1
    local_stages = len(rows[0].stages)
    T = t.local_batch_size // micro * t.seq_len // dims.cp  # tokens of one microbatch on a rank
    passes = ga * micro  # forward/backward passes per step
    layers = max(sum(s.layers for s in row.stages) for row in rows)
    ac = cfg.activation_checkpoint.mode
    G = model.gpus_per_node

    def bandwidth(stride: int, size: int) -> tuple[float, str]:
        if _in_node(stride, size, G):
            return model.intra_node_gbps * 1e9, "NVLink"
        return model.inter_node_gbps * 1e9, "network"

    costs: dict[str, float] = {}
    links: dict[str, str] = {}
    compute = flops_per_token * tokens_step / gpus * (1 + RECOMPUTE[ac]) / (model.peak_tflops * 1e12 * model.mfu)
    costs["compute"] = compute
    costs["bubble"] = compute * (dims.pp - 1) / (micro * ga * local_stages) if dims.pp > 1 else 0.0

    tp, cp = dims.tp, dims.cp
    if tp > 1:
        ops = 8 + (4 if ac == "full" else 0)
        volume = ops * (tp - 1) / tp * T * shape.dim * 2 * layers * passes
        bw, links["tp"] = bandwidth(1, tp)
        costs["tp"] = volume / bw
    if cp > 1:
        per_layer = (cp - 1) * T * 2 * shape.hkv / tp * (2 + 2 + 4 + (2 if ac == "full" else 0))
        bw, links["cp"] = bandwidth(tp, cp)
        costs["cp"] = per_layer * layers * passes / bw
    if dims.ep > 1:  # each routed token to its expert's rank and back, forward and backward (and the forward again)
        moe_layers = layers if shape.experts else 0
        ops = 4 + (2 if ac == "full" else 0)
        volume = ops * (dims.ep - 1) / dims.ep * shape.top_k * T / tp * shape.dim * 2 * moe_layers * passes
        bw, links["ep"] = bandwidth(tp, dims.ep)
        costs["ep"] = volume / bw
    if shape.experts:  # the expert GEMMs' roofline: their weights read from HBM against their FLOPs
        reads = 3 + (1 if ac == "full" else 0)
        expert_params = 3 * shape.dim * shape.expert_hidden
        read_s = reads * shape.experts / dims.ep * expert_params * 2 / (model.hbm_gbps * 1e9)
        flops_s = 2 * reads * shape.top_k * T / tp * expert_params / (model.peak_tflops * 1e12 * model.mfu)
        costs["experts"] = max(0.0, read_s - flops_s) * layers * passes
        links["experts"] = "HBM"
    if dims.pp > 1:
        volume = 2 * T * shape.dim / tp * 2 * micro * local_stages * ga
        bw, links["pp"] = bandwidth(tp * cp * dims.dp_shard * dims.dp_replicate, dims.pp)
        costs["pp"] = volume / bw
    held = max((sum((s.total for s in row.stages), memory.PartSizes()) for row in rows), key=lambda p: p.tp)
    dp_time = 0.0
    n = dims.dp_shard * cp
    if n > 1:
        policy = cfg.parallelism.fsdp_reshard_after_forward
        if dims.pp > 1:  # a pipeline step() keeps its stage gathered after each backward
            gathers = passes if policy == "always" else 1  # "always": gathered again for each backward
        else:
            gathers = passes if policy == "never" else 2 * passes
        reduce_scatters = 1 if dims.pp > 1 else ga
        volume = (n - 1) / n * held.tp * (2 * gathers + 4 * reduce_scatters)
        bw, links["dp"] = bandwidth(tp, n)
        dp_time += volume / bw
    r = dims.dp_replicate
    if r > 1:
        volume = 2 * (r - 1) / r * held.local * 4  # once per step: the trainer defers it to the last backward
        bw, link = bandwidth(tp * n, r)
        links["dp"] = link if links.get("dp", "NVLink") == "NVLink" else links["dp"]
        dp_time += volume / bw
    costs["dp"] = max(0.0, dp_time - model.dp_overlap * compute)
    costs["dp traffic"] = dp_time  # not part of the step: only its exposed share ("dp") is
    return costs, links


def step_time(costs: dict[str, float]) -> float:
    """Seconds per step: compute, bubble, tp, cp, ep, experts, pp and the exposed data-parallel traffic."""
    return sum(v for k, v in costs.items() if k != "dp traffic")


# --------------------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    candidates: list[Candidate]
    """Layouts that validate and fit, best first."""
    rejected_by_validation: int
    rejected_by_memory: int
    examined: int
    smallest_rejected_gib: float = float("inf")
    """The smallest estimated peak of the layouts that do not fit (GiB; inf when none was estimated)."""


def plan(base, gpus: int, seq_len: int, global_batch: int, gpu_memory_gib: float, memory_margin: float,
         model: CostModel, loss_chunk_tokens: int = 2048) -> Plan:
    """Every layout of ``base``'s model on ``gpus`` GPUs that validates and fits, ranked by step time; a layout
    whose plain loss does not fit is tried with the fused loss (``loss_chunk_tokens``; 0: never)."""
    from engine.config import ConfigError
    from models.registry import get_model_spec

    probe = memory.copy_config(base)
    probe.training.seq_len = seq_len
    shape = memory.model_shape(probe)
    spec = get_model_spec(base.model.name)
    args = spec.flavors[base.model.flavor].update_from_config(base.model, shape.vocab_size, seq_len)
    flops_per_token = spec.flops_per_token(args, seq_len)
    usable = gpu_memory_gib * (1 - memory_margin) * memory.GIB

    candidates, by_validation, by_memory, examined, smallest = [], 0, 0, 0, float("inf")
    for dp_replicate, dp_shard, cp, tp, pp, ep in layouts(gpus, shape, seq_len, model.gpus_per_node):
        dp = dp_replicate * dp_shard
        if global_batch % dp:
            by_validation += 1  # validation would refuse the global batch; no need to build it
            examined += 1
            continue
        for lbs, micro, schedule in batch_options(global_batch // dp, pp):
            for ac in AC_MODES:
                # The plain loss first; the fused loss (same FLOPs, less memory) only where that does not fit.
                examined += 1
                fitted, rejected_by = None, ""
                for chunk in (0, loss_chunk_tokens) if loss_chunk_tokens else (0,):
                    cfg = candidate_config(base, dp_replicate, dp_shard, cp, tp, pp, lbs, micro, schedule, ac,
                                           seq_len, global_batch, chunk, ep)
                    try:
                        dims = memory.validate_layout(cfg, gpus)
                    except ConfigError:
                        rejected_by = "validation"
                        break
                    rows = memory.analytic_rows(cfg, dims, shape)
                    peak = max(row.estimate.peak for row in rows)
                    if peak <= usable:
                        fitted = cfg, dims, rows, peak
                        break
                    rejected_by, smallest = "memory", min(smallest, peak / memory.GIB)
                if fitted is None:
                    by_validation += rejected_by == "validation"
                    by_memory += rejected_by == "memory"
                    continue
                cfg, dims, rows, peak = fitted
                costs, links = step_cost(cfg, dims, shape, flops_per_token, rows, model)
                step = step_time(costs)
                candidates.append(Candidate(cfg, dims, peak / memory.GIB, step,
                                            global_batch * seq_len / step / gpus, costs, links))
    candidates.sort(key=lambda c: (c.step_s, c.peak_gib))
    return Plan(candidates, by_validation, by_memory, examined, smallest)


# --------------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------------


def _ac_text(cfg) -> str:
    ac = cfg.activation_checkpoint
    return "op" if ac.mode == "selective" else ac.mode


def _loss_text(cfg) -> str:
    chunk = cfg.training.loss_chunk_tokens
    return f"fused {chunk}" if chunk else "plain"


def format_plan(result: Plan, top: int) -> str:
    header = ["#", "dp_rep", "dp_shard", "cp", "tp", "pp", "ep", "schedule", "micro", "lbs", "accum", "AC", "loss",
              "mem GiB", "step s", "tok/s/GPU", "reason"]
    from engine.config.validation import grad_accumulation_steps

    lines, shown, folded = [], set(), 0
    for c in result.candidates:
        if len(lines) == top:
            break
        d, p = c.dims, c.cfg.parallelism
        row = [
            str(d.dp_replicate), str(d.dp_shard), str(d.cp), str(d.tp), str(d.pp), str(d.ep),
            p.pp_schedule if d.pp > 1 else "-", str(p.pp_microbatches) if d.pp > 1 else "-",
            str(c.cfg.training.local_batch_size), str(grad_accumulation_steps(c.cfg, d.dp)), _ac_text(c.cfg),
            _loss_text(c.cfg),
            f"{c.peak_gib:.1f}", f"{c.step_s:.2f}", f"{c.tokens_per_s_per_gpu:,.0f}", c.reason,
        ]
        # Batch splits of one layout with the same estimate as shown (pipeline microbatches of one size in a larger
        # or smaller local batch) are one choice: its first row stands for them.
        key = (*row[:7], *row[10:14])  # all but microbatches, local batch and accumulation (and the reason)
        if key in shown:
            folded += 1
            continue
        shown.add(key)
        lines.append([str(len(lines) + 1), *row])
    if not lines:
        return "no layout to rank (the error line says why)"
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w) if i < len(header) - 1 else h for i, (h, w) in enumerate(zip(header, widths)))]
    for line in lines:
        out.append("  ".join(v.rjust(w) if i < len(line) - 1 else v for i, (v, w) in enumerate(zip(line, widths))))
    if folded:
        out.append(f"({folded} more rows differ from a row above only in local batch and microbatches, with the "
                   "same estimate: not shown)")
    return "\n".join(out)


def write_toml(best: Candidate, base_path: Optional[str], path: str, summary: str) -> None:
    """The base TOML with the chosen layout's fields set; run_train.sh takes it as --config."""
    import tomli_w

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib

    data: dict = {}
    if base_path:
        with open(base_path, "rb") as f:
            data = tomllib.load(f)
    cfg = best.cfg
    p, t, ac = cfg.parallelism, cfg.training, cfg.activation_checkpoint
    data.setdefault("model", {}).update(name=cfg.model.name, flavor=cfg.model.flavor)
    par = data.setdefault("parallelism", {})
    par.update(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp, pp=p.pp, ep=p.ep,
               pp_layers_per_stage=p.pp_layers_per_stage, pp_schedule_csv=p.pp_schedule_csv)
    if p.pp > 1:
        par.update(pp_schedule=p.pp_schedule, pp_microbatches=p.pp_microbatches,
                   pp_virtual_stages=p.pp_virtual_stages)
    data.setdefault("training", {}).update(seq_len=t.seq_len, local_batch_size=t.local_batch_size,
                                           global_batch_size=t.global_batch_size,
                                           loss_chunk_tokens=t.loss_chunk_tokens)
    # Every setting of the section, the base config's op_matmuls among them: the estimate was made with them.
    data["activation_checkpoint"] = {"mode": ac.mode, "selective_option": ac.selective_option,
                                     "op_matmuls": ac.op_matmuls}
    header = "".join(f"# {line}\n" for line in summary.splitlines())
    with open(path, "w") as f:
        f.write(header + tomli_w.dumps(data))


# --------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m tools.planner", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3", help="model.name (default llama3)")
    p.add_argument("--flavor", required=True, help="model.flavor, e.g. 8B, 70B, 405B")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU (default 80)")
    p.add_argument("--memory-margin", type=float, default=0.10,
                   help="fraction of the GPU memory kept free (fragmentation, CUDA context, NCCL; default 0.10)")
    p.add_argument("--seq-len", type=int, required=True, help="training.seq_len")
    p.add_argument("--global-batch", type=int, required=True, help="training.global_batch_size (samples)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--mfu", type=float, default=0.40, help="model FLOPs utilization of the compute (default 0.40)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="peak bf16 TFLOP/s of one GPU (H100: 989)")
    p.add_argument("--intra-node-gbps", type=float, default=450.0, help="GB/s per GPU within a node (NVLink)")
    p.add_argument("--inter-node-gbps", type=float, default=50.0, help="GB/s per GPU between nodes")
    p.add_argument("--hbm-gbps", type=float, default=3350.0,
                   help="GB/s of one GPU's memory, for the expert GEMMs' weight reads (default 3350, H100 SXM)")
    p.add_argument("--dp-overlap", type=float, default=0.8,
                   help="fraction of the compute time that hides FSDP/HSDP/DDP traffic (default 0.8)")
    p.add_argument("--loss-chunk-tokens", type=int, default=2048,
                   help="training.loss_chunk_tokens of the fused output loss, tried where the plain loss does "
                        "not fit (default 2048; 0: never)")
    p.add_argument("--config", default="", help="base TOML (default: the train_configs file of the model/flavor)")
    p.add_argument("--top", type=int, default=15, help="rows of the table (default 15)")
    p.add_argument("--out", default="", help="write the best layout as a TOML here")
    return p


def _check_args(a) -> None:
    from engine.config import ConfigError, did_you_mean
    from models.registry import get_model_spec

    flavors = list(get_model_spec(a.model, field="--model").flavors)
    if a.flavor not in flavors:
        raise ConfigError(f"--flavor: '{a.flavor}' is not a flavor of {a.model}: {', '.join(flavors)}"
                          f"{did_you_mean(a.flavor, flavors)}")
    for name in ("gpus", "seq_len", "global_batch", "gpus_per_node", "top"):
        if getattr(a, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(a, name)}")
    if a.loss_chunk_tokens < 0:
        raise ConfigError(f"--loss-chunk-tokens: must be >= 0 (0: never the fused loss), got {a.loss_chunk_tokens}")
    for name in ("gpu_memory_gib", "mfu", "peak_tflops", "intra_node_gbps", "inter_node_gbps", "hbm_gbps"):
        if not getattr(a, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be > 0, got {getattr(a, name)}")
    if not 0 <= a.memory_margin < 1 or not 0 <= a.dp_overlap <= 1 or a.mfu > 1:
        raise ConfigError("--memory-margin must be in [0, 1), --dp-overlap in [0, 1] and --mfu in (0, 1]")
    if a.out:  # before the search, not after it
        folder = os.path.dirname(os.path.abspath(a.out))
        if os.path.isdir(a.out) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ConfigError(f"--out: cannot write the TOML to '{a.out}'; give a file path in an existing folder "
                              "you can write to")


def main(argv: Optional[list[str]] = None) -> int:
    a = _parser().parse_args(argv)
    start = time.perf_counter()
    try:
        from engine.config import ConfigError, parse_args

        _check_args(a)
        base_path = a.config or base_config_path(a.model, a.flavor)
        base = parse_args(["--config", base_path] if base_path else [])
        base.model.name, base.model.flavor = a.model, a.flavor
        memory.validate_layout(candidate_config(base, 1, 1, 1, 1, 1, 1, 1, "", ("none", "op"), a.seq_len, -1), 1)
        model = CostModel(a.peak_tflops, a.mfu, a.intra_node_gbps, a.inter_node_gbps, a.gpus_per_node, a.dp_overlap,
                          a.hbm_gbps)
        result = plan(base, a.gpus, a.seq_len, a.global_batch, a.gpu_memory_gib, a.memory_margin, model,
                      a.loss_chunk_tokens)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"planner: {a.model}/{a.flavor} on {a.gpus} GPUs ({a.gpus_per_node} per node, {a.gpu_memory_gib:g} GiB "
          f"each, {a.memory_margin:.0%} kept free), seq_len {a.seq_len}, global batch {a.global_batch} samples")
    print(f"cost model: MFU {a.mfu:.2f} of {a.peak_tflops:g} TFLOP/s; {a.intra_node_gbps:g} GB/s in a node, "
          f"{a.inter_node_gbps:g} GB/s between nodes; data-parallel traffic hidden behind {a.dp_overlap:.0%} of "
          f"the compute" + (f"; HBM {a.hbm_gbps:g} GB/s for the expert weights"
                            if result.candidates and "experts" in result.candidates[0].links else ""))
    print(f"examined {result.examined} candidates: {result.rejected_by_validation} rejected by validation, "
          f"{result.rejected_by_memory} do not fit, {len(result.candidates)} ranked "
          f"({time.perf_counter() - start:.1f} s)")
    print(format_plan(result, a.top))
    if result.candidates and a.out:
        best = result.candidates[0]
        summary = (f"Planned by tools.planner for {a.gpus} GPUs ({a.gpus_per_node} per node, "
                   f"{a.gpu_memory_gib:g} GiB): {best.dims.describe()}, AC {_ac_text(best.cfg)}, "
                   f"{_loss_text(best.cfg)} loss; estimated peak "
                   f"{best.peak_gib:.1f} GiB,\nstep {best.step_s:.2f} s, {best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU "
                   f"({best.reason}).\nLaunch on {a.gpus} GPUs, e.g. DRY_RUN=1 NGPU={a.gpus} ./run_train.sh "
                   f"--config {a.out} first.")
        write_toml(best, base_path, a.out, summary)
        print(f"best layout written to {a.out}")
    if not result.candidates:  # the scenario asks for what cannot be: a user error, one line
        if result.rejected_by_memory:
            usable = a.gpu_memory_gib * (1 - a.memory_margin)
            print(f"error: --gpu-memory-gib: no layout of {a.model}/{a.flavor} on {a.gpus} GPUs fits {usable:.1f} GiB "
                  f"per GPU (the smallest estimate is {result.smallest_rejected_gib:.1f} GiB); add GPUs, shorten "
                  "--seq-len or lower --global-batch", file=sys.stderr, flush=True)
        else:
            print(f"error: --global-batch: no layout of {a.model}/{a.flavor} on {a.gpus} GPUs validates with a global "
                  f"batch of {a.global_batch} samples at seq_len {a.seq_len}; pick a global batch that the "
                  "data-parallel degrees can divide", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    from engine.lifetime import exit_now

    exit_now(main())  # without the interpreter's slow teardown of torch
