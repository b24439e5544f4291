"""Pipeline parallelism: split a model into stages by layers and drive them with a pipelining schedule.

The model is split on the meta device: each stage is a copy of the whole model with the layers of other
stages deleted (and the embedding or the norm/output removed where they belong to another stage), so a
stage keeps the parameter names of the whole model and checkpoints do not depend on the split.

Stages per rank: one for the single-stage schedules (GPipe, 1F1B); ``virtual_stages`` (default 2) for the
looped ones. Interleaved1F1B, LoopedBFS and InterleavedZeroBubble place stage ``s`` on pp rank
``s % pp``; the V-shaped ZBVZeroBubble and DualPipeV place stages ``r`` and ``2 pp - 1 - r`` on rank ``r``.
A CSV file may give any other schedule, one action list per rank, in torch's CSV format.
"""

from __future__ import annotations

import functools
import io
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

# Schedule name -> (torch.distributed.pipelining.schedules class, whether it runs several stages per rank).
# torch's pipelining package imports torch._dynamo (about a second per process), so it is imported only by a
# run that builds a pipeline; tests/test_parallel.py checks the flags against torch's classes.
SCHEDULES = {
    "GPipe": ("ScheduleGPipe", False),
    "1F1B": ("Schedule1F1B", False),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", True),
    "LoopedBFS": ("ScheduleLoopedBFS", True),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", True),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", True),
    "DualPipeV": ("ScheduleDualPipeV", True),
}
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


# Schedules that split a stage's backward into its input half and, later, its weight half (zero-bubble).
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def read_schedule_csv(csv: str) -> str:
    """The text of the CSV schedule file ``csv``; ``ValueError`` naming parallelism.pp_schedule_csv when it is not
    UTF-8 text."""
    try:
        with open(csv, newline="", encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"parallelism.pp_schedule_csv: '{csv}' is not UTF-8 text (byte {e.start}: {e.reason}); "
                         "save it as UTF-8") from None


def splits_backward(schedule: str, csv: str = "") -> bool:
    """Whether the schedule (or the CSV schedule file) runs weight-gradient actions apart from the backward."""
    if csv:
        import re

        return re.search(r"\b\d+W\d+\b", read_schedule_csv(csv)) is not None
    return schedule in SPLIT_BACKWARD_SCHEDULES


@functools.cache
def split_backward_takes_custom_functions() -> bool:
    """Whether this torch's split backward can take the weight half through a custom autograd.Function (the fused
    output loss is one). torch 2.11's cannot (it reads the node's input metadata, which a Python function's node
    refuses once its backward has run); 2.13's can. Probed on a two-element product, once per process."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    class Product(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return grad * w, grad * x

    x, w = torch.ones(2, requires_grad=True), nn.Parameter(torch.ones(2))
    with torch.enable_grad():
        out = Product.apply(x * 1, w).sum()
        try:
            _, groups = stage_backward_input([out], None, [x], iter([w]))
            stage_backward_weight(iter([w]), groups)
        except RuntimeError:
            return False
    return w.grad is not None


def schedule_class(schedule: str) -> type:
    """torch's class for the schedule named ``schedule`` (a key of SCHEDULES)."""
    from torch.distributed.pipelining import schedules

    return getattr(schedules, SCHEDULES[schedule][0])


def is_multi_stage(schedule: str) -> bool:
    """Whether ``schedule``'s placement puts several stages on a rank. A CSV schedule follows the placement of
    the schedule it is given with (parallelism.pp_schedule: GPipe or 1F1B, one stage per rank)."""
    return SCHEDULES[schedule][1]


def num_stages(pp: int, schedule: str, virtual_stages: int) -> int:
    """Stages in the whole pipeline."""
    if not is_multi_stage(schedule):
        return pp
    return pp * (2 if schedule in V_SCHEDULES else virtual_stages)


def stage_ids(pp_rank: int, pp: int, schedule: str, virtual_stages: int) -> list[int]:
    """The stages this pp rank runs, in order."""
    if not is_multi_stage(schedule):
        return [pp_rank]
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(virtual_stages)]


def check_schedule_csv(csv: str, pp: int, schedule: str, virtual_stages: int, microbatches: int,
                       accumulation: int = 1) -> None:
    """Raise ``ValueError`` (naming parallelism.pp_schedule_csv) when the CSV schedule does not fit the layout
    Tessera builds: one row per pp rank, each row running only the stages its rank holds (``stage_ids``: the
    placement of ``schedule`` with ``virtual_stages``), every stage running a forward of every microbatch of the
    step (``microbatches`` per local batch, for each of ``accumulation`` gradient-accumulation batches).
    torch checks none of this before the model is built, and some of it never (a rank that meets an action
    for a stage it does not hold fails mid-step)."""
    import csv as csv_module

    from torch.distributed.pipelining.schedules import _Action, _ComputationType, _validate_schedule

    from collections import Counter

    field = f"parallelism.pp_schedule_csv: '{csv}'"
    rows = list(csv_module.reader(io.StringIO(read_schedule_csv(csv))))
    for line, row in enumerate(rows, 1):
        if not any(cell.strip() for cell in row):  # torch's loader takes every line for a pp rank's
            raise ValueError(f"{field}: line {line} is blank; each line is one pp rank's actions: remove it")
    if len(rows) != pp:
        raise ValueError(f"{field} has {len(rows)} row{'s' * (len(rows) != 1)}; it needs one per pipeline rank "
                         f"(parallelism.pp = {pp})")
    n_stages = num_stages(pp, schedule, virtual_stages)
    forwards: dict[int, set[int]] = {s: set() for s in range(n_stages)}
    runs: Counter = Counter()  # (stage, microbatch, F / B / I / W) -> times the CSV runs it
    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B",
             _ComputationType.BACKWARD_INPUT: "I", _ComputationType.BACKWARD_WEIGHT: "W"}
    actions: dict[int, list] = {}  # each row's parsed cells (None for an empty one), for torch's order check below
    for rank, row in enumerate(rows):
        held = stage_ids(rank, pp, schedule, virtual_stages)
        actions[rank] = []
        for cell in row:
            try:
                action = _Action.from_str(cell.strip())
            except (ValueError, RuntimeError) as e:
                raise ValueError(f"{field}: row {rank}: {e}") from None
            actions[rank].append(action)
            if action is None:
                continue
            if action.computation_type not in (*kinds, _ComputationType.OVERLAP_F_B):
                raise ValueError(f"{field}: row {rank}: {cell.strip()} is a communication or sharding action; the "
                                 "file lists compute actions only (F, B, I, W), the communication is derived from them")
            for part in getattr(action, "sub_actions", None) or [action]:  # OVERLAP_F_B: a forward and a backward
                if part.stage_index not in held:
                    raise ValueError(
                        f"{field}: row {rank} runs stage {part.stage_index} ({cell.strip()}), but pp rank {rank} "
                        f"holds stages {held} ({schedule} placement with parallelism.pp_virtual_stages = "
                        f"{virtual_stages}); set parallelism.pp_schedule to the schedule whose placement the CSV "
                        "follows"
                    )
                if part.computation_type in kinds:
                    runs[part.stage_index, part.microbatch_index, kinds[part.computation_type]] += 1
                if part.computation_type == _ComputationType.FORWARD:
                    forwards[part.stage_index].add(part.microbatch_index)
    n_microbatches = microbatches * accumulation
    expected = set(range(n_microbatches))
    count = (f"{n_microbatches} (parallelism.pp_microbatches = {microbatches} x {accumulation} gradient "
             "accumulation batches)" if accumulation > 1 else f"{n_microbatches} (parallelism.pp_microbatches)")
    for stage, seen in forwards.items():
        if seen != expected:
            raise ValueError(
                f"{field}: stage {stage} runs forwards of microbatches {sorted(seen)}, but the step has {count}; "
                "make them agree"
            )
    # Each stage runs every microbatch's forward once and its backward once: whole (B), or split into its input
    # and weight halves (I, then W). torch checks the backwards only once the model is built, with a traceback.
    for stage in range(n_stages):
        for mb in range(n_microbatches):
            f, b, i, w = (runs[stage, mb, k] for k in "FBIW")
            if f != 1 or not ((b, i, w) == (1, 0, 0) or (b, i, w) == (0, 1, 1)):
                raise ValueError(
                    f"{field}: stage {stage}, microbatch {mb}: {f} forward(s) (F), {b} whole backward(s) (B), {i} "
                    f"input backward(s) (I) and {w} weight backward(s) (W); a stage runs each microbatch's forward "
                    "once and its backward once, as B or as I and W"
                )
    # The order within each row: a microbatch's forward before its backward, I before W (torch checks it once the
    # model is built, with a traceback).
    try:
        _validate_schedule(actions, pp, n_stages, n_microbatches)
    except AssertionError as e:
        raise ValueError(f"{field}: {str(e).splitlines()[0].strip()}") from None


def split_layers(n_layers: int, n_stages: int, layers_per_stage: list[int] | None = None) -> list[range]:
    """Which layers each stage holds: the given counts, or an even split where the first and last stages
    take fewer when the layers do not divide (they also hold the embedding and the output)."""
    if layers_per_stage:
        assert len(layers_per_stage) == n_stages and sum(layers_per_stage) == n_layers, (layers_per_stage, n_layers)
        counts = list(layers_per_stage)
    else:
        base, extra = divmod(n_layers, n_stages)
        counts = [base] * n_stages
        # The extra layers go to the middle stages first.
        order = list(range(1, n_stages - 1)) + [0, n_stages - 1] if n_stages > 2 else list(range(n_stages))
        for i in order[:extra]:
            counts[i] += 1
    starts = [sum(counts[:i]) for i in range(n_stages)]
    return [range(s, s + c) for s, c in zip(starts, counts)]


def _stage_class():
    """torch's PipelineStage, with two changes that reach into its private methods (this is the one place):

    - torch learns a stage's output shapes by running the first microbatch through it once more (its metadata
      inference); the stage's buffers are put back as they were afterwards, so that what a forward counts (a MoE
      layer's tokens per expert) counts the step's microbatches once;
    - on torch whose schedules open the stage-to-stage connections by sending a message to each neighbouring stage
      (torch 2.11; 2.13 has a warm-up vote instead), the messages to stages on its own rank are left out: V
      schedules (ZBVZeroBubble, DualPipeV) put adjacent stages on one rank, and gloo cannot send from a rank to
      itself."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules

    opens_by_messages = not hasattr(schedules.PipelineScheduleMulti, "_warmup_p2p")  # torch < 2.13
    inference = next((name for name in ("_forward_metadata_inference", "_shape_inference")
                      if hasattr(PipelineStage, name)), None)

    class Stage(PipelineStage):
        if opens_by_messages:
            def _get_init_p2p_neighbors_ops(self):
                me = dist.get_rank(self.group)
                return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != me]

    if inference is not None:
        def infer_keeping_buffers(self, *args, **kwargs):
            saved = [(b, b.clone()) for b in self.submod.buffers()]
            try:
                return getattr(PipelineStage, inference)(self, *args, **kwargs)
            finally:
                with torch.no_grad():  # only those that changed: the others may be saved for the backward
                    for buffer, value in saved:
                        if not torch.equal(buffer, value):
                            buffer.copy_(value)

        setattr(Stage, inference, infer_keeping_buffers)
    return Stage


class TiedEmbedding:
    """An output projection tied to the input embedding, on two pipeline stages.

    The first stage holds the embedding, the last stage a copy of it as its output projection, drawn as the
    embedding (the model's ``init_weights``) or loaded from the same tensor. After each backward ``sum_gradients``
    adds the two gradients, over the pair of pp ranks holding them (the same coordinates on every other mesh
    dimension, so the same shards), or on one rank when a V schedule puts both stages there: both copies take the
    same update and stay equal, as one shared weight would. ``uncounted`` is the copy, whose gradient the clip's
    norm counts once (on the embedding's stage).
    """

    def __init__(self, parts: list[nn.Module], owners: list[int], root_mesh, device: torch.device):
        self.device = device
        self.embedding = next((p.tok_embeddings.weight for p in parts if p.tok_embeddings is not None), None)
        self.output = next((p.output.weight for p in parts if p.output is not None), None)
        self.group = None
        first, last = owners[0], owners[-1]
        if first != last and root_mesh.mesh.shape[0] == 2:  # root_mesh's dim 0 is pp: the pair is the pp group
            self.group = root_mesh.get_group("pp")
        elif first != last:  # every rank takes part in making every pair's group
            columns = root_mesh.mesh.reshape(root_mesh.mesh.shape[0], -1).T
            pairs = [[int(ranks[first]), int(ranks[last])] for ranks in columns]
            self.group, _ = dist.new_subgroups_by_enumeration(pairs)

    @property
    def uncounted(self) -> list[nn.Parameter]:
        return [self.output] if self.output is not None else []

    @torch.no_grad()
    def sum_gradients(self) -> None:
        held = [w for w in (self.embedding, self.output) if w is not None]
        for w in held:
            assert w.grad is not None, "a tied weight without a gradient"
            if isinstance(w.grad, DTensor) and w.grad.placements != w.placements:
                # The vocabulary-parallel embedding's gradient comes back replicated: to the weight's shards (a
                # local slice), as the output's is, so that the two ranks' local tensors are the same rows.
                w.grad = w.grad.redistribute(w.device_mesh, w.placements)
        grads = [w.grad.to_local() if isinstance(w.grad, DTensor) else w.grad for w in held]
        if len(grads) == 2:  # both stages on this rank
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif grads:
            # CPU offload keeps gradients in host memory, which NCCL cannot reduce: through the device
            g = grads[0]
            work = g if g.device == self.device else g.to(self.device)
            dist.all_reduce(work, group=self.group)
            if work is not g:
                g.copy_(work)


def build_stages(modules: list[nn.Module], ids: list[int], n_stages: int, pp_group, device) -> list:
    """One torch PipelineStage per module of this rank."""
    stage = _stage_class()
    return [stage(m, stage_index=i, num_stages=n_stages, device=device, group=pp_group)
            for m, i in zip(modules, ids)]


def build_schedule(stages: list, schedule: str, n_microbatches: int, loss_fn: Callable,
                   csv: str = ""):
    """The schedule driving ``stages``. Gradients are not scaled by the microbatch count: the loss is
    already normalized by the global number of target tokens."""
    if csv:
        from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

        runtime = _PipelineScheduleRuntime(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        runtime._load_csv(csv)
        return runtime
    cls = schedule_class(schedule)
    if not is_multi_stage(schedule):
        assert len(stages) == 1
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


# ------------------------------------------------------------------------------------------------------------
# Forward only (evaluation)
# ------------------------------------------------------------------------------------------------------------

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
_HEADER = 8  # ndim, dtype index, up to 6 sizes


def _send(x: torch.Tensor, dst: int, group) -> None:
    assert x.ndim <= _HEADER - 2, x.shape
    header = torch.tensor([x.ndim, _DTYPES.index(x.dtype), *x.shape] + [0] * (_HEADER - 2 - x.ndim),
                          dtype=torch.int64, device=x.device)
    _p2p(dist.isend, header, dst, group)
    _p2p(dist.isend, x.contiguous(), dst, group)


def _recv(src: int, group, device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    _p2p(dist.irecv, header, src, group)
    ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
    x = torch.empty([int(n) for n in header[2 : 2 + ndim]], dtype=dtype, device=device)
    _p2p(dist.irecv, x, src, group)
    return x


def _p2p(op, x: torch.Tensor, peer: int, group) -> None:
    """One send or receive with ``peer`` (its rank in ``group``), batched as the schedules' are: on NCCL a batch
    runs on the group's communicator, while a plain send/recv creates a communicator for each pair of ranks."""
    for work in dist.batch_isend_irecv([dist.P2POp(op, x, group=group, group_peer=peer)]):
        work.wait()


@torch.no_grad()
def forward_only(parts: list[nn.Module], ids: list[int], n_stages: int, owners: list[int], pp_rank: int,
                 pp_group, inputs: torch.Tensor, kwargs: dict | None = None) -> torch.Tensor | None:
    """One batch through every stage without gradients, stage after stage (no overlap: for evaluation).

    ``owners[s]`` is the pp rank holding stage ``s``; ``parts``/``ids`` are this rank's stages; ``kwargs`` go
    to every stage's forward, as the training schedule passes them. Returns the last stage's output (the
    logits, or the loss sum of the fused output loss) on the rank holding it, None on the others.
    """
    mine = dict(zip(ids, parts))
    x = inputs
    for s in range(n_stages):
        if owners[s] != pp_rank:
            continue
        if s > 0 and owners[s - 1] != pp_rank:
            x = _recv(owners[s - 1], pp_group, inputs.device)
        x = mine[s](x, **(kwargs or {}))
        if s < n_stages - 1 and owners[s + 1] != pp_rank:
            _send(x, owners[s + 1], pp_group)
    return x if owners[n_stages - 1] == pp_rank else None


def stage_owners(pp: int, schedule: str, virtual_stages: int) -> list[int]:
    """The pp rank of every stage."""
    owners = [-1] * num_stages(pp, schedule, virtual_stages)
    for rank in range(pp):
        for s in stage_ids(rank, pp, schedule, virtual_stages):
            owners[s] = rank
    assert -1 not in owners, owners
    return owners
