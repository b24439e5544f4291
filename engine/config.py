"""Tessera's configuration: typed dataclasses, TOML loading, `--section.key value` overrides, validation.

Data flow: ``parse_args(argv)`` -> TOML file (``--config``) -> command-line overrides -> ``validate()``
(cross-field rules) -> the trainer. Every field carries a docstring; ``--help`` prints them all.

A user error raises ``ConfigError`` (a ``ValueError``) whose message names the field; the entry point prints
it as one ``error:`` line and exits non-zero before anything is written.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import math
import os
import sys
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Optional
from functools import lru_cache

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A user error in the configuration; the message names the offending field."""


def read_json_object(path: str, field: str) -> dict:
    """The JSON object in the file ``path`` (a checkpoint's or an HF folder's metadata); ConfigError naming
    ``field`` when the file is missing, is not JSON, or holds something else."""
    import json

    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{field}: {path} is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{field}: cannot read '{path}' as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{field}: '{path}' does not hold a JSON object")
    return data


def is_hf_folder(path: str) -> bool:
    """Whether ``path`` is a Hugging Face checkpoint folder (it holds config.json) rather than a Tessera step folder:
    the two kinds checkpoint.initial_load_path takes."""
    return os.path.isfile(os.path.join(path, "config.json"))


# --------------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------------


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Run folder: the resolved config.toml, metrics.jsonl, tensorboard/wandb logs and checkpoints go here."""
    description: str = "Tessera training run"
    """Free text describing the run; written into the dumped config."""
    print_config: bool = False
    """Print the resolved configuration on rank 0 before training."""
    owner_timeout_seconds: float = 60.0
    """The run owns dump_folder (its OWNER.json) while it lives; an owner on another host whose heartbeat stops
    for this long is gone and its folder is taken over (one on this host is checked by its process)."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family, a key of the ModelSpec registry (models/<name>/)."""
    flavor: str = "debugmodel"
    """Shape preset of the model family, e.g. debugmodel, 8B, 70B, 405B for llama3."""
    attn: str = "sdpa"
    """Attention backend: sdpa (torch scaled_dot_product_attention), flex (flex_attention), flash_attn
    (FlashAttention 4 from flash-attn-4 on Hopper and Blackwell, else 3 or 2 from flash-attn, when installed)."""
    attn_mask: str = "causal"
    """Attention mask: causal, or block_causal (causal within each packed document; needs attn = flex; with
    context parallelism the ring attention applies it)."""
    sdpa_backend: str = "auto"
    """With attn = sdpa: the kernel scaled_dot_product_attention may use: auto (torch's choice; flash on
    Hopper), flash, cudnn or efficient (CUDA; for efficient, which lacks grouped-query support, K/V are repeated
    to the query heads, and for cudnn too unless a one-step probe at start-up shows that it takes grouped-query
    attention), or math. Not with context parallelism (its ring calls its kernels directly)."""
    hf_assets_path: str = ""
    """Folder with a Hugging Face tokenizer.json (and config.json); its tokenizer is used when
    data.tokenizer is empty."""
    vocab_size: int = -1
    """Vocabulary size of the embedding and output layers; -1 takes the flavor's size, or the tokenizer's
    size for flavors that do not fix one (debugmodel)."""


@dataclass
class Data:
    dataset: str = "tessera_docs"
    """A built-in dataset (tessera_docs: English prose from the Python distribution's docstrings, shipped
    with Tessera) or a Hugging Face dataset name such as allenai/c4. Ignored when data.path is set."""
    dataset_config: str = ""
    """Hugging Face dataset configuration name (e.g. en for allenai/c4); empty for none."""
    path: str = ""
    """A local data file or folder (json, jsonl, parquet or txt files); overrides data.dataset. A folder's files
    of the format that holds most of its bytes are read (the log names the others)."""
    split: str = "train"
    """Dataset split to read."""
    text_field: str = "text"
    """Name of the column/key holding the document text (json, jsonl, parquet, HF datasets)."""
    streaming: bool = True
    """Stream Hugging Face and local datasets instead of loading them into memory first."""
    tokenizer: str = ""
    """Path to a Hugging Face tokenizer.json (or a folder holding one); empty uses model.hf_assets_path, else the
    built-in tokenizer."""
    num_shards: int = -1
    """Logical shards the dataset is split into; each data-parallel rank reads its shards in turn. -1 means
    one per data-parallel rank; it must be a multiple of the data-parallel degree (every rank reads as many
    shards). A checkpoint keeps its shard count, so a run can resume on another data-parallel degree that
    divides num_shards without repeating or skipping samples: set it to a multiple of every dp degree you may
    resume on (e.g. 64)."""


@dataclass
class Training:
    steps: int = 200
    """Number of optimizer steps to train."""
    seq_len: int = 512
    """Tokens per sample (packed documents)."""
    local_batch_size: int = 8
    """Samples per data-parallel rank per forward/backward pass (a microbatch)."""
    global_batch_size: int = -1
    """Samples per optimizer step over all data-parallel ranks; -1 means local_batch_size x dp degree. A
    multiple of that product turns on gradient accumulation."""
    max_norm: float = 1.0
    """Gradient clipping: maximum total L2 norm of the gradients (> 0; grad_norm is logged before clipping)."""
    mixed_precision_param: str = "bfloat16"
    """On CUDA: dtype of the compute (bfloat16 autocast, or float32 for none). On CPU training runs in
    float32 regardless."""
    mixed_precision_reduce: str = "float32"
    """On CUDA: dtype of gradient reductions across data-parallel ranks."""
    bf16_weights: bool = True
    """On one CUDA GPU with bfloat16 compute (autocast: no FSDP, no other parallelism) and no gradient
    accumulation: store the linear layers' weights in bf16, each fp32 weight kept exactly as its bf16 value plus
    a 16-bit low half that the optimizer updates with it, instead of autocast casting every fp32 weight in each
    forward, recomputation and backward: no casts, bf16 gradients, the same memory for weights, autocast's
    numbers and the same (fp32) checkpoints (parallelize/bf16_weights.py). false = plain autocast."""
    loss_chunk_tokens: int = 0
    """Fuse the output projection with the cross-entropy over chunks of this many tokens: each chunk's logits,
    loss and gradients are computed in the forward and the [tokens, vocabulary] logits never exist whole
    (GiBs less peak memory at a 128k vocabulary, the same FLOPs). 0 = off (logits, then the loss). Under
    tensor parallelism each rank computes its vocabulary slice of every chunk; under pipeline parallelism the
    last stage does."""
    empty_cache_after_first_step: bool = True
    """On CUDA: after a run's first step (compilation, Inductor's autotuning, the optimizer's state created), hand
    the caching allocator's free blocks back to the GPU once (torch.cuda.empty_cache), so that memory only that
    step used is not held, reserved and idle, for the rest of the run (NCCL's and cuBLAS's own buffers, and other
    processes, cannot use it). The first step's logged peak still counts it. false: keep it reserved."""
    gc_freq: int = 50
    """Python's garbage collector runs between steps, every this many steps, instead of whenever its allocation
    counters say (a collection in the middle of a step on one rank holds up every other rank at the next
    collective). 0 = Python's automatic collection."""


@dataclass
class Parallelism:
    dp_replicate: int = 1
    """Data-parallel replicas: DDP when dp_shard is 1, HSDP (replicas of FSDP groups) when dp_shard > 1."""
    dp_shard: int = -1
    """FSDP2 sharding degree; -1 takes the ranks left over once the other degrees are set."""
    cp: int = 1
    """Context-parallel degree: each sample's sequence is split over cp ranks (ring attention)."""
    tp: int = 1
    """Tensor-parallel degree (with sequence parallel norms); must divide n_heads and n_kv_heads."""
    pp: int = 1
    """Pipeline-parallel degree: the layers are split into stages on pp ranks."""
    pp_schedule: str = "1F1B"
    """Pipeline schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or
    DualPipeV. The zero-bubble ones (the last three) split each backward into input and weight passes: they
    take no compiled blocks, no activation checkpointing and no float8 layers (each would rerun its forward
    or its whole backward per pass), and torch 2.11 cannot run them through the fused loss (2.13 can)."""
    pp_schedule_csv: str = ""
    """A CSV file with a custom schedule (torch.distributed.pipelining's format); overrides pp_schedule's
    actions (pp_schedule still names the stage placement)."""
    pp_microbatches: int = -1
    """Microbatches each local batch is split into for the pipeline; -1 = the number of stages. With gradient
    accumulation one schedule step runs the microbatches of all the step's local batches (pp_microbatches x
    accumulation steps), so the pipeline fills and drains once per optimizer step (GPipe then holds the
    activations of all of them at once; the 1F1B family at most a few per stage)."""
    pp_virtual_stages: int = 2
    """Stages per pp rank for the looped schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble);
    the V schedules always use 2, the others 1."""
    pp_layers_per_stage: list[int] = field(default_factory=list)
    """Layers of each stage, e.g. 3,4,4,3 (empty: an even split, first and last stages lighter)."""
    cp_rotate: str = "allgather"
    """How context parallelism moves keys and values between ranks: allgather, or alltoall (a ring of
    point-to-point transfers overlapped with compute)."""
    fsdp_reshard_after_forward: str = "default"
    """FSDP: free gathered parameters after forward: default (every block's but the last one's, which the
    backward needs first, and not the root's; with pipeline parallelism none, as the stages keep them
    gathered over the step's microbatches anyway), always, or never (faster, more memory)."""
    fsdp_single_rank: bool = False
    """On a world of one rank, wrap the model in FSDP2 anyway (a one-rank mesh): its mixed precision (bf16
    compute from fp32 weights) replaces autocast, exactly as on many ranks."""
    fsdp_cpu_offload: bool = False
    """FSDP: keep sharded parameters, gradients and optimizer state in CPU memory (CUDA only)."""
    disable_loss_parallel: bool = False
    """With tp > 1, gather the full vocabulary logits before the loss instead of computing the
    cross-entropy on vocabulary shards. No effect with training.loss_chunk_tokens: the fused loss never
    forms the logits and always works on the vocabulary shards."""
    enable_async_tp: bool = False
    """Overlap TP communication with matmuls (CUDA, tp > 1 and compile.enable only)."""


@dataclass
class ActivationCheckpoint:
    mode: str = "none"
    """none, full (recompute every block in backward) or selective (see selective_option)."""
    selective_option: str = "op"
    """For mode = selective: "op" keeps the outputs of matmuls and attention and recomputes the rest;
    an integer N (at most the model's number of layers) checkpoints every N-th block fully, from the first one
    (blocks 0, N, 2N, ...), counted within each pipeline stage (as torchtitan counts)."""
    op_matmuls: str = "all"
    """For selective_option = op: the matmul outputs kept, all (the least recompute) or alternate (torchtitan's
    per-op policy: every other matmul of a block, so wk, wo and w3 are recomputed in backward, about 9% more
    compute for a third less activation memory; under float8 every float8 matmul is recomputed, as torchtitan
    does)."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (fullgraph) and the loss."""
    autotune: bool = True
    """Inductor benchmarks launch configurations of each elementwise kernel (two) and reduction kernel (several)
    at its first launch and keeps the fastest; it runs them on clones of the tensors the kernel writes, which can
    leave the first step's memory reserved for the rest of the run. false: one configuration per kernel
    (Inductor's default block size for elementwise kernels, the one its deterministic mode picks for
    reductions), no clones (needs compile.enable; the split bf16 weights' optimizer update runs with one
    configuration always)."""


@dataclass
class Float8:
    enable: bool = False
    """Run the matmuls of the transformer blocks' linear layers in float8 (torchao Float8Linear; needs torchao,
    pip install 'tessera[float8]', and a GPU of compute capability >= 8.9 such as the H100, or emulate)."""
    recipe: str = "tensorwise"
    """Scaling recipe: tensorwise (one dynamic scale per tensor; fastest) or rowwise (one per row, power-of-two
    scales; more accurate, slower)."""
    emulate: bool = False
    """Emulate the float8 matmuls in float32 on the float8-rounded values: float8 numerics on a CPU or a GPU
    without float8 (tests), no speed-up."""
    filter_fqns: list[str] = field(default_factory=list)
    """Linear layers kept in high precision, by substring of their name (e.g. attention.wk,feed_forward). The
    output layer and layers whose dimensions (per TP rank) are not multiples of 16 are never converted."""
    fsdp_float8_all_gather: bool = False
    """tensorwise with FSDP: cast the weights to float8 before FSDP's all-gather (half the bytes of bf16);
    ignored without data parallelism."""
    precompute_scale: bool = False
    """With fsdp_float8_all_gather: compute every float8 weight's scale in one all-reduce after each optimizer
    step, instead of one all-reduce per layer during the forward."""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Optimizer: AdamW or Adam."""
    lr: float = 8e-4
    """Peak learning rate."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Weight decay, applied to matrices only, the embedding and output included (never to norms and biases, as
    Megatron-LM does): decoupled with AdamW, added to the gradient (L2) with Adam."""
    implementation: str = "auto"
    """Optimizer kernel: auto (fused on CUDA, foreach on CPU), fused, foreach or for-loop."""


@dataclass
class LRScheduler:
    warmup_steps: int = 20
    """Steps of linear warmup: step s of them (from 1) runs at s / warmup_steps of the peak lr, the last at the
    peak. It may exceed training.steps (a short test of a long run's config): the lr then ramps up to the last
    step, each step at the lr it has in the long run."""
    decay_ratio: float = -1.0
    """Fraction of the steps spent decaying at the end (warmup-stable-decay); -1 decays over every step
    after warmup."""
    decay_type: str = "linear"
    """Shape of the decay: linear, cosine or sqrt."""
    min_lr_factor: float = 0.0
    """The lr of the last step (the end of the decay), as a fraction of the peak lr."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log metrics every this many steps (the first and last steps are always logged); the logged loss is
    the mean over the steps since the previous multiple of log_freq (the first step is also logged alone)."""
    enable_tensorboard: bool = False
    """Write tensorboard event files to <dump_folder>/tb (a fresh run sets an earlier run's aside as tb.<n>; a
    resumed run hides the earlier events of the steps it trains again)."""
    enable_wandb: bool = False
    """Log to Weights & Biases (files under <dump_folder>/wandb). A resumed run goes on in the same wandb run (its
    id is kept in <dump_folder>/wandb_run_id); a fresh run starts a new one."""
    wandb_project: str = "tessera"
    """Weights & Biases project name."""
    wandb_mode: str = "auto"
    """Weights & Biases mode: online, offline (no network needed; sync later), disabled, or auto: the WANDB_MODE
    environment variable where set, else online."""
    wandb_rewind: bool = False
    """A run resumed from a checkpoint older than the last logged step (a crash or kill between checkpoints)
    retrains steps the wandb run already has, and wandb drops steps at or below its last one (a warning names
    them). True rewinds the wandb run to the checkpoint's step instead (wandb.init(resume_from=...): W&B's rewind,
    a preview feature your W&B account must have), so the retrained steps replace the abandoned ones."""
    save_for_all_ranks: bool = False
    """Every rank writes metrics (metrics_rank<N>.jsonl; a fresh run sets an earlier run's aside as
    metrics_rank<N>.<n>.jsonl); otherwise rank 0 only."""
    peak_flops: float = -1.0
    """Peak FLOP/s of one device for MFU; -1 looks the device up in a table (H100 bf16 989e12, ...)."""


@dataclass
class Validation:
    enable: bool = False
    """Every validation.freq steps, compute the loss of validation.steps batches without gradients (through
    the whole pipeline with PP), on the same batches each time; logged as validation_loss at that step."""
    freq: int = 100
    """Validate every this many optimizer steps (at its multiples; with validation.enable, at most
    training.steps)."""
    steps: int = 4
    """Batches (of training.local_batch_size samples per data-parallel rank) per validation. Validation data that
    holds fewer is read again from its start, counting documents twice (a start-up warning says how many fit)."""
    dataset: str = ""
    """Validation data: a built-in or Hugging Face dataset; empty takes data.dataset."""
    dataset_config: str = ""
    """Hugging Face dataset configuration name of validation.dataset (e.g. wikitext-2-raw-v1); empty: none, or
    data.dataset_config when validation.dataset is data.dataset (or empty)."""
    path: str = ""
    """Validation data: a local file or folder; empty takes data.path (when validation.dataset is empty)."""
    split: str = ""
    """Split to read; empty takes data.split. With the training data and split, validation reads the first
    batches of the training order: a fixed probe set, not held-out data."""
    text_field: str = ""
    """Column holding the validation documents' text; empty takes data.text_field."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints and resume from the newest complete one found in checkpoint.folder."""
    folder: str = "checkpoint"
    """Where the step-N folders go; relative paths are inside job.dump_folder."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 0
    """Keep only the newest k complete checkpoints (0 keeps all); incomplete and model-only ones never count
    and are never removed."""
    load_step: int = -1
    """Resume from this step's checkpoint (with checkpoint.enable); -1 takes the newest complete one, 0 starts
    fresh."""
    async_mode: str = "disabled"
    """disabled (training waits for the save), async (written by a background thread while training goes
    on), or async_with_pinned_mem (async, staged through pinned host memory on CUDA)."""
    last_save_model_only: bool = False
    """The save at the last step holds the model weights only, in checkpoint.export_dtype (for inference
    or fine-tuning)."""
    export_dtype: str = "float32"
    """dtype of a model-only save and of the last_save_hf folder: float32, bfloat16 or float16."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts of the checkpoint a resumed run does not load: dataloader (read the data from its beginning, e.g.
    after changing data.path or data.dataset; the data position of another dataset means nothing)."""
    initial_load_path: str = ""
    """When no checkpoint of this run exists yet, start from these weights: a Tessera step folder (e.g. a
    seed checkpoint) or a Hugging Face folder (config.json + safetensors; each rank reads only the slices it
    holds). The model only."""
    initial_load_hf: bool = False
    """checkpoint.initial_load_path must be a Hugging Face folder (torchtitan's initial_load_in_hf): checked at
    start-up, so a step folder given by mistake fails before anything is built. false: either kind, told apart by
    the folder's config.json."""
    last_save_hf: bool = False
    """Once the last step's checkpoint is committed, also write it as a Hugging Face folder
    <checkpoint.folder>/step-<N>-hf (config.json, safetensors in checkpoint.export_dtype, the run's tokenizer) that
    transformers' from_pretrained loads. The ranks share the output shards (at most 5 GB each, one rank per node
    first); a rank holds one shard and its float32 source in CPU memory at a time. `python -m
    engine.tools.convert_hf to-hf` does the same in one process. A run resumed after it exists leaves it alone."""
    create_seed_checkpoint: bool = False
    """Write the initialized model as step-0 (model only, for initial_load_path) and exit without training. Any
    layout writes the same weights (initialization does not depend on the layout), sharded: make a large model's
    seed on as many ranks as it needs."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces (CPU ops, CUDA kernels, shapes) of training steps: one trace per rank every
    profiling.profile_freq steps, at <dump_folder>/<save_traces_folder>/iteration_<step>/rank<R>_trace.json
    (open in Perfetto or chrome://tracing)."""
    save_traces_folder: str = "profile_traces"
    """Where the traces go; relative paths are inside job.dump_folder."""
    profile_freq: int = 10
    """Trace the steps that end at every multiple of this step count (resumed runs included)."""
    profiler_warmup: int = 3
    """Steps the profiler runs untraced before each traced window (its start-up costs stay out of the trace);
    profiler_warmup + profiler_active must not exceed profile_freq."""
    profiler_active: int = 1
    """Steps in each trace."""
    enable_memory_snapshot: bool = False
    """CUDA: record the caching allocator's history and write a snapshot every profiling.profile_freq steps,
    and once more on an out-of-memory error, to <dump_folder>/<save_memory_snapshot_folder>/ as
    iteration_<step>/rank<R>_memory_snapshot.pickle (drag it onto pytorch.org/memory_viz)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Where the memory snapshots go; relative paths are inside job.dump_folder."""


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Timeout of every collective from the process group's creation to the end of the first training step
    (model building, checkpoint loading and compilation make the first step slow)."""
    train_timeout_seconds: int = 100
    """Timeout of every collective after the first step: a rank that hangs (or a deadlock) fails the job after
    this long instead of holding the allocation until it ends."""
    checkpoint_timeout_seconds: int = 1800
    """Timeout of the collectives of a checkpoint save and its commit (every rank waits there for the slowest
    rank's writes to a shared filesystem, which may take longer than comm.train_timeout_seconds)."""
    trace_buf_size: int = 20000
    """NCCL flight recorder: each rank keeps its last this many collectives and, on a timeout, writes them to
    <dump_folder>/comm_traces/rank_<R> (read them with torch's fr_trace tool); 0 turns it off (torch's own
    2,000-entry recorder too). A TORCH_FR_BUFFER_SIZE or TORCH_NCCL_TRACE_BUFFER_SIZE in the environment wins."""


@dataclass
class Debug:
    seed: int = 42
    """Random seed for weight initialization and dropout-free training; the data order is fixed by it too."""
    deterministic: bool = False
    """Use deterministic algorithms only (torch.use_deterministic_algorithms) for bit-identical reruns."""


@dataclass
class Config:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {f.name: type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)}


# --------------------------------------------------------------------------------------------------------
# Field documentation (attribute docstrings, read from the source)
# --------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Map each field of a dataclass to the string literal that follows it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _field_type(cls: type, name: str) -> type:
    return typing.get_type_hints(cls)[name]


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (list, typing.List):
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def help_text() -> str:
    lines = [
        "usage: ./run_train.sh [--config FILE] [--section.key VALUE | --section.key=VALUE ...]",
        "",
        "Booleans also take --section.key (true) and --section.no-key (false). Lists are comma-separated.",
        "Environment (run_train.sh):",
        "  NGPU             processes on this node (default 1; gloo on a CPU-only machine)",
        "  LOG_RANK         comma-separated ranks whose output is shown (default 0)",
        "  CONFIG_FILE      the TOML file when no --config is given (default train_configs/debug_model.toml)",
        "  PYTHON           the interpreter (default python3)",
        "  TESSERA_BACKEND  the process-group backend instead of nccl (CUDA) / gloo (CPU): gloo or nccl",
        "  DRY_RUN          1: build for NGPU simulated ranks on the meta device, print the per-rank memory, train",
        "                   nothing; 0 (default): train",
        "  GPU_MEMORY_GIB   with DRY_RUN=1: the memory of one GPU in GiB (default 80)",
        "",
    ]
    defaults = Config()
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, section), f.name)
            lines.append(f"  --{section}.{f.name} ({_type_name(_field_type(cls, f.name))}, default {default!r})")
            lines.append(textwrap.fill(docs.get(f.name, ""), width=100, initial_indent=" " * 6, subsequent_indent=" " * 6))
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------
# Value conversion
# --------------------------------------------------------------------------------------------------------

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _toml_text(value) -> str:
    """A TOML value as a TOML file writes it."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_text(v) for v in value) + "]"
    return str(value)


def _shown(value, from_cli: bool) -> str:
    """A value in an error message: a command-line string quoted; a TOML value as the file writes it, a string
    as the string "..." (its quotes are what make it one)."""
    if from_cli:
        return repr(value)
    if isinstance(value, dict):
        return "a table"
    return f"the string {_toml_text(value)}" if isinstance(value, str) else _toml_text(value)


def _convert(key: str, tp, value, from_cli: bool):
    """Convert a TOML value (typed) or a CLI string to the field's type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (list, typing.List):
        (item_tp,) = typing.get_args(tp)
        if from_cli:
            value = [v.strip() for v in value.split(",")] if value.strip() else []
            if "" in value:  # '1,,2' or '1,2,': a value left out
                raise ConfigError(f"{key}: an empty item in the list '{','.join(value)}'; give comma-separated "
                                  "values with none left out")
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {_shown(value, from_cli)}")
        return [_convert(key, item_tp, v, from_cli) for v in value]
    if tp is bool:
        if from_cli:
            low = value.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
        elif isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {_shown(value, from_cli)}")
    if tp is int:
        number = None
        if from_cli:
            for base in (0, 10):  # 0x1f, 0o17, 1_000; base 10 for leading zeros (042), which base 0 refuses
                try:
                    number = int(value, base)
                    break
                except ValueError:
                    pass
        elif isinstance(value, int) and not isinstance(value, bool):
            number = value
        if number is None:
            raise ConfigError(f"{key}: expected an integer, got {_shown(value, from_cli)}")
        if not -2**63 <= number < 2**63:  # torch and the collectives' timeouts take 64-bit integers
            raise ConfigError(f"{key}: {number} does not fit in a 64-bit integer; give a smaller value")
        return number
    if tp is float:
        number = None
        if from_cli:
            try:
                number = float(value)
            except ValueError:
                pass
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {_shown(value, from_cli)}")
        if not math.isfinite(number):  # TOML and float() both take nan and inf
            raise ConfigError(f"{key}: expected a finite number, got {_shown(value, from_cli)}")
        return number
    if tp is str:
        if from_cli or isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {_shown(value, from_cli)}")
    raise AssertionError(f"unsupported config type {tp} for {key}")


def _did_you_mean(word: str, choices) -> str:
    same_letters = [c for c in choices if c.lower() == word.lower()]  # '8b' for '8B'
    close = same_letters or difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _names(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def _sections_with(name: str) -> list[str]:
    """The sections that have a key ``name``."""
    return [section for section in SECTIONS if name in _names(section)]


def _or_list(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


# torchtitan's (0.2 and nearby) names of the options that Tessera names otherwise, with Tessera's name; the
# torchtitan options without a Tessera counterpart are left out (they get the ordinary suggestion, if any).
TORCHTITAN_NAMES: dict[str, str] = {
    "job.config_file": "--config",
    "job.print_args": "job.print_config",
    "model.tokenizer_path": "model.hf_assets_path",
    "model.converters": "float8.enable",
    "training.dataset": "data.dataset",
    "training.dataset_path": "data.path",
    "training.batch_size": "training.local_batch_size",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
    "training.enable_cpu_offload": "parallelism.fsdp_cpu_offload",
    "training.compile": "compile.enable",
    "training.seed": "debug.seed",
    "training.deterministic": "debug.deterministic",
    "lr_scheduler.lr_min": "lr_scheduler.min_lr_factor",
    "parallelism.data_parallel_replicate_degree": "parallelism.dp_replicate",
    "parallelism.data_parallel_shard_degree": "parallelism.dp_shard",
    "parallelism.tensor_parallel_degree": "parallelism.tp",
    "parallelism.enable_async_tensor_parallel": "parallelism.enable_async_tp",
    "parallelism.context_parallel_degree": "parallelism.cp",
    "parallelism.context_parallel_rotate_method": "parallelism.cp_rotate",
    "parallelism.pipeline_parallel_degree": "parallelism.pp",
    "parallelism.pipeline_parallel_schedule": "parallelism.pp_schedule",
    "parallelism.pipeline_parallel_schedule_csv": "parallelism.pp_schedule_csv",
    "parallelism.pipeline_parallel_microbatch_size": "parallelism.pp_microbatches",
    "parallelism.pipeline_parallel_layers_per_stage": "parallelism.pp_layers_per_stage",
    "checkpoint.enable_checkpoint": "checkpoint.enable",
    "checkpoint.last_save_in_hf": "checkpoint.last_save_hf",
    "activation_checkpoint.selective_ac_option": "activation_checkpoint.selective_option",
    "float8.recipe_name": "float8.recipe",
    "float8.enable_fsdp_float8_all_gather": "float8.fsdp_float8_all_gather",
    "float8.precompute_float8_dynamic_scale_for_fsdp": "float8.precompute_scale",
    "validation.enabled": "validation.enable",
    "validation.dataset_path": "validation.path",
}
# Where Tessera's option takes another kind of value than torchtitan's.
_TORCHTITAN_NOTES = {
    "job.config_file": "a command-line option, not a config key",
    "model.tokenizer_path": "the folder with tokenizer.json; data.tokenizer takes it too, or the file",
    "model.converters": "converters = [\"float8\"] is float8.enable = true",
    "parallelism.pipeline_parallel_microbatch_size": "the number of microbatches: training.local_batch_size / "
                                                     "the microbatch size",
    "parallelism.pipeline_parallel_layers_per_stage": "a list: the layers of each stage",
}


def _unknown_key(key: str) -> ConfigError:
    """The error for a key that no section has: Tessera's name when it is torchtitan's name of a Tessera option,
    else the nearest keys, if any are near."""
    if key in TORCHTITAN_NAMES:
        note = _TORCHTITAN_NOTES.get(key)
        return ConfigError(f"unknown config key '{key}' (torchtitan's name); Tessera's is '{TORCHTITAN_NAMES[key]}'"
                           + (f" ({note})" if note else ""))
    if key in SECTIONS:  # a section given as if it were a key (`--compile`)
        return ConfigError(f"unknown config key '{key}': it is a section; give one of its keys, e.g. "
                           f"'{key}.{_names(key)[0]}'")
    return ConfigError(f"unknown config key '{key}'{_suggest_keys(key)}")


def _suggest_keys(key: str) -> str:
    """' (did you mean ...?)' for a mistyped key, '' when nothing is close: a close name of its section (the names
    compared without the section, whose shared prefix makes any two keys of a section look alike), a close key
    when the section is mistyped, else the sections that have the name (or, given no section, a close one)."""
    section, _, name = key.partition(".")
    if not name:  # no section
        section, name = "", section
    if section in SECTIONS:
        close = [f"{section}.{n}" for n in difflib.get_close_matches(name, _names(section), n=1, cutoff=0.75)]
    elif section:
        close = difflib.get_close_matches(key, _all_keys(), n=1, cutoff=0.75)
    else:  # the name in whichever sections have it
        names = sorted({n for s in SECTIONS for n in _names(s)})
        name = (difflib.get_close_matches(name, names, n=1, cutoff=0.75) or [name])[0]
        close = []
    close = close or [f"{s}.{name}" for s in _sections_with(name)]
    return f" (did you mean {_or_list([repr(k) for k in close])}?)" if close else ""


# Fields that hold a file or folder path: a leading ~ is expanded when the value is read (from the TOML file or
# the command line, where bash leaves `--key=~/x` alone), so that every consumer sees the same path.
PATH_FIELDS = frozenset({
    "job.dump_folder", "model.hf_assets_path", "data.path", "data.tokenizer", "parallelism.pp_schedule_csv",
    "validation.path", "checkpoint.folder", "checkpoint.initial_load_path", "profiling.save_traces_folder",
    "profiling.save_memory_snapshot_folder",
})


def set_value(cfg: Config, key: str, value, from_cli: bool) -> None:
    """Set ``section.name`` on cfg from a TOML value or a CLI string, checking the key and the type (and
    expanding ~ in PATH_FIELDS)."""
    section, _, name = key.partition(".")
    if section not in SECTIONS or name not in _names(section):
        raise _unknown_key(key)
    cls = SECTIONS[section]
    value = _convert(key, _field_type(cls, name), value, from_cli)
    setattr(getattr(cfg, section), name, os.path.expanduser(value) if key in PATH_FIELDS else value)


# --------------------------------------------------------------------------------------------------------
# Loading: TOML file, then command-line overrides
# --------------------------------------------------------------------------------------------------------


def load_toml(cfg: Config, path: str) -> None:
    if os.path.isdir(path):
        raise ConfigError(f"--config: '{path}' is a folder; pass a TOML file such as train_configs/debug_model.toml")
    if not os.path.exists(path):  # a file, or a pipe such as --config <(...)
        raise ConfigError(f"--config: file '{path}' not found; pass an existing TOML file such as train_configs/debug_model.toml")
    if not os.path.isfile(path) and os.environ.get("WORLD_SIZE", "1").strip() not in ("", "1"):
        raise ConfigError(f"--config: '{path}' is not a file (a pipe, such as <(...)?), which the launcher's processes "
                          "cannot each read; save it to a file")
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8-sig")  # a byte-order mark (some Windows editors write one) is dropped
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config: '{path}' is not valid TOML ({e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config: '{path}' is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"--config: cannot read '{path}': {e.strerror}") from None
    for section, values in data.items():
        if section not in SECTIONS and not isinstance(values, dict):  # a key above every [section] header
            where = _sections_with(section)
            fix = (f"put it under {_or_list([f'[{s}]' for s in where])}" if where else
                   f"no section has such a key{_suggest_keys(section)}")
            raise ConfigError(f"{section}: the key '{section}' in {path} must sit in a section; {fix}")
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section '[{section}]' in {path}{_did_you_mean(section, SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a [{section}] table in {path}, got {values!r}")
        for name, value in values.items():
            set_value(cfg, f"{section}.{name}", value, from_cli=False)


def _is_bool_key(key: str) -> bool:
    section, _, name = key.partition(".")
    cls = SECTIONS.get(section)
    if cls is None or name not in {f.name for f in dataclasses.fields(cls)}:
        return False
    return _field_type(cls, name) is bool


def _negated_bool(key: str) -> str:
    """For ``section.no-name`` where ``section.name`` is a boolean: ``section.name``; else ''."""
    section, _, name = key.partition(".")
    if name.startswith("no-") and _is_bool_key(f"{section}.{name[3:]}"):
        return f"{section}.{name[3:]}"
    return ""


def parse_args(argv: list[str] | None = None) -> Config:
    """Build the Config from ``--config FILE`` and ``--section.key value`` overrides (file first)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_file = None
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}': options look like --section.key value")
        body = arg[2:]
        key, eq, inline = body.partition("=")
        if key == "config":
            if eq:
                value = inline
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
            else:
                raise ConfigError("--config: expects a TOML file path" + (f" before {argv[i + 1]}" if i + 1 < len(argv)
                                                                         else ""))
            if config_file is not None:
                raise ConfigError(f"--config: given twice ('{config_file}', then '{value}'); pass one file and "
                                  "override its values with --section.key value")
            config_file = os.path.expanduser(value)
        elif _negated_bool(key) and (eq or (i + 1 < len(argv) and not argv[i + 1].startswith("--"))):
            value = inline if eq else argv[i + 1]
            raise ConfigError(f"--{key}: takes no value (got '{value}'); use --{_negated_bool(key)} false or "
                              f"--{key}")
        elif eq:
            overrides.append((key, inline))
        elif _negated_bool(key):
            overrides.append((_negated_bool(key), "false"))
        elif _is_bool_key(key) and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
            overrides.append((key, "true"))
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            overrides.append((key, argv[i + 1]))
            i += 1
        elif key not in _all_keys():
            raise _unknown_key(key)
        else:
            raise ConfigError(f"--{key}: expects a value")
        i += 1
    cfg = Config()
    if config_file is not None:
        load_toml(cfg, config_file)
    for key, value in overrides:
        set_value(cfg, key, value, from_cli=True)
    return cfg


# --------------------------------------------------------------------------------------------------------
# Validation: every cross-field rule known so far, before any model memory or file is touched
# --------------------------------------------------------------------------------------------------------


def _choice(key: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: '{value}' is not one of {', '.join(choices)}{_did_you_mean(value, choices)}")


MAX_SEQ_LEN = 2**24  # sanity bounds: a value past them is a typo, and would fail later with a traceback
MAX_TIMEOUT_SECONDS = 10**8


def _positive(key: str, value) -> None:
    if not value > 0:
        raise ConfigError(f"{key}: must be > 0, got {value}")


@dataclass(frozen=True)
class Machine:
    """What validation assumes about the GPUs a run will have: this machine's (a launch), or the cluster's (a
    dry run, which plans on a CPU login node for GPUs it does not see)."""

    cuda: bool
    """CUDA GPUs are present."""
    cuda_capability: Optional[tuple[int, int]]
    """Their compute capability (float8 matmuls need >= 8.9); None without CUDA."""
    flash_attn: bool
    """A FlashAttention package these GPUs run is installed (4: flash-attn-4; 3: its Hopper build; 2: flash-attn)."""

    @staticmethod
    def this() -> "Machine":
        """This machine, as a launch here will find it."""
        import torch

        from models.attention import flash_attn_available
        from parallelize.float8 import cuda_capability

        cuda = torch.cuda.is_available()
        return Machine(cuda=cuda, cuda_capability=cuda_capability() if cuda else None,
                       flash_attn=flash_attn_available())


# What a dry run plans for: Hopper GPUs (H100) with flash-attn installed.
HOPPER = Machine(cuda=True, cuda_capability=(9, 0), flash_attn=True)


def check_shard_split(num_shards: int, dp: int, origin: str, fix: str) -> None:
    """The data.num_shards rule: every data-parallel rank reads as many shards (a rank with fewer would read
    them faster and oversample them). ``origin`` says where the count comes from, ``fix`` what to do."""
    if num_shards % dp:
        raise ConfigError(
            f"data.num_shards: {origin} {num_shards} shards, which do not split evenly over {dp} data-parallel "
            f"ranks (a rank with fewer shards would read them faster and oversample them); {fix}"
        )


def validate(cfg: Config, world_size: int = 1, machine: Optional[Machine] = None, check_paths: bool = True) -> None:
    """Check every rule that does not need the model or the data built. Raises ConfigError naming the field.

    ``machine``: the GPUs the run will have (default: this machine's). ``check_paths``: False skips the checks that
    the files and folders the layout does not depend on exist (assets, tokenizer, data, validation data, initial
    weights), for planning a cluster's run on a machine that lacks them; every other rule still applies."""
    from models import get_model_spec, model_names  # local: models import torch
    from models.attention import BACKENDS, SDPA_BACKENDS

    machine = machine or Machine.this()

    if not cfg.job.dump_folder.strip():
        raise ConfigError("job.dump_folder: must not be empty")
    _positive("job.owner_timeout_seconds", cfg.job.owner_timeout_seconds)
    if cfg.job.owner_timeout_seconds > MAX_TIMEOUT_SECONDS:
        raise ConfigError(f"job.owner_timeout_seconds: at most {MAX_TIMEOUT_SECONDS:,} seconds, got "
                          f"{cfg.job.owner_timeout_seconds:,}")

    # model
    _choice("model.name", cfg.model.name, model_names())
    spec = get_model_spec(cfg.model.name)
    _choice("model.flavor", cfg.model.flavor, list(spec.flavors))
    _choice("model.attn", cfg.model.attn, BACKENDS)
    _choice("model.attn_mask", cfg.model.attn_mask, ["causal", "block_causal"])
    if cfg.model.attn_mask == "block_causal" and cfg.model.attn != "flex":
        raise ConfigError("model.attn_mask: block_causal document masking needs model.attn = flex")
    if cfg.model.attn == "flash_attn":
        if not machine.flash_attn:
            raise ConfigError("model.attn: flash_attn is not installed for this GPU; pip install flash-attn-4 (Hopper, "
                              "Blackwell) or flash-attn, or use model.attn = sdpa")
        if not machine.cuda:
            raise ConfigError("model.attn: flash_attn needs a CUDA GPU; use model.attn = sdpa on this machine")
    _choice("model.sdpa_backend", cfg.model.sdpa_backend, SDPA_BACKENDS)
    if cfg.model.sdpa_backend != "auto":
        if cfg.model.attn != "sdpa":
            raise ConfigError(f"model.sdpa_backend: picks the kernel of attn = sdpa, not of {cfg.model.attn}; "
                              "leave it at auto")
        if cfg.model.sdpa_backend in ("cudnn", "efficient") and not machine.cuda:
            raise ConfigError(f"model.sdpa_backend: {cfg.model.sdpa_backend} needs a CUDA GPU; use auto, flash or "
                              "math on this machine")
    if cfg.model.vocab_size != -1 and cfg.model.vocab_size <= 0:
        raise ConfigError(f"model.vocab_size: must be > 0 or -1, got {cfg.model.vocab_size}")
    if check_paths and cfg.model.hf_assets_path and not os.path.isdir(cfg.model.hf_assets_path):
        raise ConfigError(f"model.hf_assets_path: folder '{cfg.model.hf_assets_path}' not found")

    # data
    if cfg.data.path:
        if check_paths and not os.path.exists(cfg.data.path):
            raise ConfigError(f"data.path: '{cfg.data.path}' not found; give a json, jsonl, parquet or txt file or folder")
    elif not cfg.data.dataset:
        raise ConfigError("data.dataset: empty; name a built-in dataset (tessera_docs), a Hugging Face dataset, or set data.path")
    # A folder: its tokenizer.json is checked later.
    if check_paths and cfg.data.tokenizer and not os.path.exists(cfg.data.tokenizer):
        raise ConfigError(f"data.tokenizer: '{cfg.data.tokenizer}' not found; give a Hugging Face tokenizer.json or "
                          "the folder holding one")
    if not cfg.data.text_field:
        raise ConfigError("data.text_field: must not be empty")

    # training
    t = cfg.training
    _positive("training.steps", t.steps)
    _positive("training.seq_len", t.seq_len)
    if t.seq_len > MAX_SEQ_LEN:
        raise ConfigError(f"training.seq_len: at most {MAX_SEQ_LEN:,} tokens (2**24), got {t.seq_len:,}")
    _positive("training.local_batch_size", t.local_batch_size)
    dp = validate_parallelism(cfg, world_size, spec, machine).dp
    ac, n_layers = cfg.activation_checkpoint, spec.flavors[cfg.model.flavor].n_layers
    if ac.mode == "selective" and ac.selective_option != "op" and int(ac.selective_option) > n_layers:
        raise ConfigError(
            f"activation_checkpoint.selective_option: {ac.selective_option} exceeds the {n_layers} layers of "
            f"{cfg.model.flavor}, and checkpointing every {ac.selective_option}-th block checkpoints the first one "
            f"only; give an N from 1 to {n_layers} (2 checkpoints every other block), or set "
            f"activation_checkpoint.mode to none"
        )
    _positive("training.max_norm", t.max_norm)
    if t.gc_freq < 0:
        raise ConfigError(f"training.gc_freq: must be >= 0 (0 = Python's automatic collection), got {t.gc_freq}")
    _choice("training.mixed_precision_param", t.mixed_precision_param, ["bfloat16", "float32"])
    _choice("training.mixed_precision_reduce", t.mixed_precision_reduce, ["float32", "bfloat16"])
    if t.loss_chunk_tokens < 0:
        raise ConfigError(f"training.loss_chunk_tokens: must be >= 0 (0 = off), got {t.loss_chunk_tokens}")
    _validate_float8(cfg, machine)

    # compile
    if not cfg.compile.autotune and not cfg.compile.enable:
        raise ConfigError("compile.autotune: false applies to compiled kernels; set compile.enable = true as well, "
                          "or drop it")

    # optimizer
    o = cfg.optimizer
    _choice("optimizer.name", o.name, ["AdamW", "Adam"])
    if o.lr < 0:
        raise ConfigError(f"optimizer.lr: must be >= 0, got {o.lr}")
    for key, beta in (("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"{key}: must be in [0, 1), got {beta}")
    _positive("optimizer.eps", o.eps)
    if o.weight_decay < 0:
        raise ConfigError(f"optimizer.weight_decay: must be >= 0, got {o.weight_decay}")
    _choice("optimizer.implementation", o.implementation, ["auto", "fused", "foreach", "for-loop"])

    # lr schedule
    s = cfg.lr_scheduler
    if s.warmup_steps < 0:
        raise ConfigError(f"lr_scheduler.warmup_steps: must be >= 0, got {s.warmup_steps}")
    if s.decay_ratio != -1.0 and not 0.0 <= s.decay_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_ratio: must be in [0, 1] or -1, got {s.decay_ratio}")
    _choice("lr_scheduler.decay_type", s.decay_type, ["linear", "cosine", "sqrt"])
    if not 0.0 <= s.min_lr_factor <= 1.0:
        raise ConfigError(f"lr_scheduler.min_lr_factor: must be in [0, 1], got {s.min_lr_factor}")

    # validation
    v = cfg.validation
    _positive("validation.freq", v.freq)
    _positive("validation.steps", v.steps)
    if v.enable and v.freq > t.steps:  # it validates at the multiples of freq
        raise ConfigError(f"validation.freq: {v.freq} exceeds training.steps = {t.steps}, so validation would never "
                          f"run; set validation.freq to at most {t.steps}, or turn validation.enable off")
    if v.dataset_config and not v.dataset:
        raise ConfigError(f"validation.dataset_config: '{v.dataset_config}' is set without validation.dataset; set "
                          "validation.dataset too (validation reading data.dataset takes data.dataset_config)")
    if check_paths and v.path and not os.path.exists(v.path):
        raise ConfigError(f"validation.path: '{v.path}' not found; give a json, jsonl, parquet or txt file or folder")

    # checkpoint
    c = cfg.checkpoint
    _positive("checkpoint.interval", c.interval)
    if c.keep_latest_k < 0:
        raise ConfigError(f"checkpoint.keep_latest_k: must be >= 0 (0 keeps all), got {c.keep_latest_k}")
    if c.load_step < -1:
        raise ConfigError(f"checkpoint.load_step: must be >= 0, or -1 for the newest, got {c.load_step}")
    _choice("checkpoint.async_mode", c.async_mode, ["disabled", "async", "async_with_pinned_mem"])
    _choice("checkpoint.export_dtype", c.export_dtype, ["float32", "bfloat16", "float16"])
    if not c.folder.strip():
        raise ConfigError("checkpoint.folder: must not be empty")
    if check_paths and c.initial_load_path and not os.path.isdir(c.initial_load_path):
        raise ConfigError(f"checkpoint.initial_load_path: folder '{c.initial_load_path}' not found")
    if c.initial_load_hf and not c.initial_load_path:
        raise ConfigError("checkpoint.initial_load_hf: no folder to load; set checkpoint.initial_load_path to the "
                          "Hugging Face folder (config.json + safetensors)")
    if check_paths and c.initial_load_hf and not is_hf_folder(c.initial_load_path):
        raise ConfigError(f"checkpoint.initial_load_hf: '{c.initial_load_path}' (checkpoint.initial_load_path) has no "
                          "config.json, so it is not a Hugging Face folder; give the folder that holds config.json "
                          "and the .safetensors files, or set checkpoint.initial_load_hf = false for a Tessera step "
                          "folder")
    if c.initial_load_path and c.create_seed_checkpoint:
        raise ConfigError("checkpoint.initial_load_path: a seed checkpoint (checkpoint.create_seed_checkpoint) is the "
                          "freshly initialized model, not loaded weights; drop one of the two (python -m "
                          "engine.tools.convert_hf from-hf turns a Hugging Face folder into a checkpoint)")
    for part in c.exclude_from_loading:
        _choice("checkpoint.exclude_from_loading", part, ["dataloader"])
    if c.load_step != -1 and not c.enable:
        raise ConfigError(f"checkpoint.load_step: loading step {c.load_step} needs checkpoint.enable = true (it reads "
                          "this run's checkpoint folder); for initial weights use checkpoint.initial_load_path")
    for key in ("last_save_hf", "last_save_model_only"):
        if getattr(c, key) and not c.enable:
            raise ConfigError(f"checkpoint.{key}: the export is made from the last step's checkpoint; set "
                              "checkpoint.enable = true as well")
    if cfg.data.num_shards != -1:
        _positive("data.num_shards", cfg.data.num_shards)
        check_shard_split(cfg.data.num_shards, dp, "the data is split into", f"use a multiple of {dp}")

    # profiling, comm
    pr = cfg.profiling
    _positive("profiling.profile_freq", pr.profile_freq)
    _positive("profiling.profiler_active", pr.profiler_active)
    if pr.profiler_warmup < 0:
        raise ConfigError(f"profiling.profiler_warmup: must be >= 0, got {pr.profiler_warmup}")
    if pr.enable_profiling and pr.profiler_warmup + pr.profiler_active > pr.profile_freq:
        raise ConfigError(
            f"profiling.profile_freq: {pr.profile_freq} is shorter than profiler_warmup + profiler_active = "
            f"{pr.profiler_warmup} + {pr.profiler_active}; raise it or shorten the warm-up"
        )
    if pr.enable_profiling and pr.profile_freq > cfg.training.steps:
        raise ConfigError(
            f"profiling.profile_freq: {pr.profile_freq} exceeds training.steps = {cfg.training.steps}, so no step "
            f"would be traced; set profiling.profile_freq to at most {cfg.training.steps}, or turn "
            "profiling.enable_profiling off"
        )
    for key in ("save_traces_folder", "save_memory_snapshot_folder"):
        if not getattr(pr, key).strip():
            raise ConfigError(f"profiling.{key}: must not be empty")
    if pr.enable_memory_snapshot and not machine.cuda:
        raise ConfigError("profiling.enable_memory_snapshot: records the CUDA caching allocator and needs CUDA "
                          "GPUs; turn it off on this machine (profiling.enable_profiling traces CPU runs)")
    for key in ("init_timeout_seconds", "train_timeout_seconds", "checkpoint_timeout_seconds"):
        seconds = getattr(cfg.comm, key)
        _positive(f"comm.{key}", seconds)
        if seconds > MAX_TIMEOUT_SECONDS:  # Python's timedelta, which the collectives take, stops at 10**9 days
            raise ConfigError(f"comm.{key}: at most {MAX_TIMEOUT_SECONDS:,} seconds (about 3 years), got {seconds:,}")
    if cfg.comm.trace_buf_size < 0:
        raise ConfigError(f"comm.trace_buf_size: must be >= 0 (0 = off), got {cfg.comm.trace_buf_size}")

    # metrics, debug
    _positive("metrics.log_freq", cfg.metrics.log_freq)
    _choice("metrics.wandb_mode", cfg.metrics.wandb_mode, ["auto", "online", "offline", "disabled"])
    if cfg.metrics.wandb_rewind and not cfg.metrics.enable_wandb:
        raise ConfigError("metrics.wandb_rewind: rewinds the run's wandb run; set metrics.enable_wandb = true as "
                          "well, or drop it")
    if cfg.metrics.peak_flops != -1.0:
        _positive("metrics.peak_flops", cfg.metrics.peak_flops)
    if not 0 <= cfg.debug.seed <= 2**32 - 1:  # what torch.manual_seed and numpy take
        raise ConfigError(f"debug.seed: must be in [0, 2**32 - 1], got {cfg.debug.seed}")


def validate_parallelism(cfg: Config, world_size: int, spec, machine: Optional[Machine] = None):
    """The parallel layout: degrees, their product, and the model shapes they must divide."""
    from parallelize.mesh import ParallelDims

    p, t = cfg.parallelism, cfg.training
    _validate_values(cfg)
    dims = ParallelDims.from_config(p, world_size)
    if t.global_batch_size != -1:  # gradient accumulation: whole local batches on every data-parallel rank
        _positive("training.global_batch_size", t.global_batch_size)
        if t.global_batch_size % (t.local_batch_size * dims.dp):
            raise ConfigError(
                f"training.global_batch_size: {t.global_batch_size} is not a multiple of local_batch_size x dp "
                f"= {t.local_batch_size} x {dims.dp}"
            )
    args = spec.flavors[cfg.model.flavor]
    if dims.tp > 1:
        for name, heads in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads)):
            if heads % dims.tp:
                raise ConfigError(
                    f"parallelism.tp: {dims.tp} does not divide the {cfg.model.flavor} flavor's {name} = {heads}; "
                    f"tensor parallelism gives each rank whole heads (KV heads are not replicated), so pick a tp "
                    f"that divides {args.n_kv_heads}"
                )
    cuda = (machine or Machine.this()).cuda
    if p.enable_async_tp:
        if dims.tp == 1 or not cfg.compile.enable or not cuda:
            raise ConfigError(
                "parallelism.enable_async_tp: needs parallelism.tp > 1, compile.enable and CUDA GPUs"
            )
    if p.fsdp_cpu_offload:
        if not cuda:
            raise ConfigError("parallelism.fsdp_cpu_offload: offloading to CPU memory needs CUDA GPUs")
        if not dims.data_parallel:
            raise ConfigError("parallelism.fsdp_cpu_offload: FSDP does the offloading, and this layout has no FSDP; "
                              "set parallelism.fsdp_single_rank = true on one GPU, or use data parallelism")
    if dims.pp > 1:
        _validate_pipeline(cfg, dims, args)
    if dims.cp > 1:
        if cfg.model.attn not in ("sdpa", "flex"):
            raise ConfigError("model.attn: context parallelism runs its own ring attention; use model.attn = sdpa "
                              "(or flex, with model.attn_mask = block_causal)")
        if cfg.model.sdpa_backend != "auto":
            raise ConfigError("model.sdpa_backend: context parallelism's ring attention calls its kernels directly; "
                              "leave it at auto")
    chunks = 2 * dims.cp * dims.tp if dims.cp > 1 else dims.tp
    if cfg.training.seq_len % chunks:
        raise ConfigError(
            f"training.seq_len: {cfg.training.seq_len} is not divisible by 2 x cp x tp = {chunks} (context "
            f"parallelism cuts each sequence into 2 x cp chunks, sequence parallelism each chunk into tp)"
        )
    return dims


def _validate_values(cfg: Config) -> None:
    """The parallelism and activation checkpointing options' own values (names, signs), whether or not the layout
    uses them: a config valid at pp = 1 stays valid at pp = 2 as far as they go."""
    from parallelize.pipeline_parallel import SCHEDULES

    p = cfg.parallelism
    _choice("parallelism.fsdp_reshard_after_forward", p.fsdp_reshard_after_forward, ["default", "always", "never"])
    _choice("parallelism.pp_schedule", p.pp_schedule, list(SCHEDULES))
    if p.pp_schedule_csv and not os.path.isfile(p.pp_schedule_csv):
        raise ConfigError(f"parallelism.pp_schedule_csv: file '{p.pp_schedule_csv}' not found")
    _positive("parallelism.pp_virtual_stages", p.pp_virtual_stages)
    if p.pp_microbatches != -1 and p.pp_microbatches < 1:
        raise ConfigError(f"parallelism.pp_microbatches: must be >= 1 or -1, got {p.pp_microbatches}")
    if any(n < 0 for n in p.pp_layers_per_stage):
        raise ConfigError(f"parallelism.pp_layers_per_stage: layer counts must be >= 0, got {p.pp_layers_per_stage}")
    _choice("parallelism.cp_rotate", p.cp_rotate, ["allgather", "alltoall"])
    ac = cfg.activation_checkpoint
    _choice("activation_checkpoint.mode", ac.mode, ["none", "full", "selective"])
    _choice("activation_checkpoint.op_matmuls", ac.op_matmuls, ["all", "alternate"])
    if ac.selective_option != "op":
        try:
            every = int(ac.selective_option)
        except ValueError:
            every = 0
        if every <= 0:
            raise ConfigError(
                f"activation_checkpoint.selective_option: {ac.selective_option!r} is neither \"op\" nor a "
                f"positive integer N (checkpoint every N-th block)"
            )


def _validate_float8(cfg: Config, machine: Machine) -> None:
    """float8: the recipe and its options, then whether this machine can run it (torchao installed; a GPU
    with float8 matmuls, unless emulated)."""
    f8 = cfg.float8
    _choice("float8.recipe", f8.recipe, ["tensorwise", "rowwise"])
    if any(not name.strip() for name in f8.filter_fqns):
        raise ConfigError("float8.filter_fqns: an empty name would match every layer; list layer names such as attention.wk")
    if not f8.enable:
        return
    if f8.fsdp_float8_all_gather and f8.recipe != "tensorwise":
        raise ConfigError(
            f"float8.fsdp_float8_all_gather: the FSDP float8 all-gather needs float8.recipe = tensorwise (got "
            f"{f8.recipe}); turn it off for {f8.recipe}"
        )
    if f8.precompute_scale and not f8.fsdp_float8_all_gather:
        raise ConfigError(
            "float8.precompute_scale: it precomputes the scales of the FSDP float8 all-gather; set "
            "float8.fsdp_float8_all_gather = true, or turn it off"
        )
    from parallelize.float8 import check_float8_supported

    check_float8_supported(f8.emulate, machine.cuda_capability)


def _check_split_backward(cfg: Config) -> None:
    """A zero-bubble schedule runs each stage's backward in two passes (input gradients, later the weights'),
    both through the same autograd graph, the weight pass as one ``autograd.grad`` call per group of weights.
    Features that cannot run their part of that graph again, or would redo their whole backward in each call
    (measured on 2 CPU ranks, ZBVZeroBubble, debug model), are refused."""
    import torch

    from parallelize.pipeline_parallel import split_backward_takes_custom_functions

    p, ac = cfg.parallelism, cfg.activation_checkpoint
    field = "parallelism.pp_schedule_csv" if p.pp_schedule_csv else "parallelism.pp_schedule"
    head = f"{field}: {p.pp_schedule_csv or p.pp_schedule} splits the backward into input and weight passes"
    fix = ("use a CSV schedule with whole backwards (B) instead of I and W actions, or" if p.pp_schedule_csv else
           "use GPipe, 1F1B, Interleaved1F1B or LoopedBFS, or")
    if cfg.compile.enable:  # a compiled block's backward donates its buffers: it may run once per forward
        raise ConfigError(
            f"{head}, and a compiled block's backward (compile.enable) runs only once per forward; {fix} turn "
            f"compile.enable off"
        )
    if ac.mode == "selective" and ac.selective_option == "op":  # the saved activations serve one backward
        raise ConfigError(
            f"{head}, and per-op selective activation checkpointing keeps its saved activations for one backward "
            f"pass only; {fix} set activation_checkpoint.mode to none"
        )
    if ac.mode != "none":  # each autograd.grad call is a new graph task: checkpoint recomputes per task
        raise ConfigError(
            f"{head}, and activation checkpointing ({ac.mode}) recomputes a block's forward for the input pass "
            f"and again for each weight group of the weight pass (10x the forwards); {fix} set "
            f"activation_checkpoint.mode to none"
        )
    if cfg.float8.enable:  # torchao's float8 matmul is one autograd node: both its gradients, in each pass
        raise ConfigError(
            f"{head}, but float8 linear layers (float8.enable) compute both gradients in each pass (twice the "
            f"backward matmuls, so the split saves nothing); {fix} turn float8.enable off"
        )
    # The fused loss's node takes the output weight directly: the weight pass goes through its Python function
    # (its backward only scales the gradients its forward computed, so running it twice costs nothing).
    if cfg.training.loss_chunk_tokens and not split_backward_takes_custom_functions():
        raise ConfigError(
            f"{head}, which torch {torch.__version__} cannot run through the fused output loss "
            f"(training.loss_chunk_tokens; torch 2.13 can); {fix} set training.loss_chunk_tokens to 0"
        )


def _validate_pipeline(cfg: Config, dims, args) -> None:
    from models import get_model_spec
    from parallelize.pipeline_parallel import num_stages, splits_backward

    p = cfg.parallelism
    if get_model_spec(cfg.model.name).pipeline_fn is None:
        raise ConfigError(f"parallelism.pp: model {cfg.model.name!r} has no pipeline split (its ModelSpec registers "
                          "no pipeline_fn); set parallelism.pp = 1")
    stages = num_stages(dims.pp, p.pp_schedule, p.pp_virtual_stages)
    if p.pp_layers_per_stage:
        if len(p.pp_layers_per_stage) != stages or sum(p.pp_layers_per_stage) != args.n_layers:
            raise ConfigError(
                f"parallelism.pp_layers_per_stage: {p.pp_layers_per_stage} must list {stages} stages adding up "
                f"to the {args.n_layers} layers of {cfg.model.flavor}"
            )
        if any(n == 0 for n in p.pp_layers_per_stage[1:-1]):
            raise ConfigError(
                f"parallelism.pp_layers_per_stage: {p.pp_layers_per_stage} leaves a middle stage without layers "
                "(only the first and last stages, which hold the embedding and the output, may have 0)"
            )
    elif stages > args.n_layers + 2:
        from parallelize.pipeline_parallel import V_SCHEDULES, is_multi_stage

        if not is_multi_stage(p.pp_schedule):
            fix = "lower parallelism.pp"
        elif p.pp_schedule in V_SCHEDULES:  # two stages per rank, whatever pp_virtual_stages says
            fix = "lower parallelism.pp, or use a schedule of one stage per rank (1F1B, GPipe)"
        else:
            fix = "lower parallelism.pp or parallelism.pp_virtual_stages"
        raise ConfigError(
            f"parallelism.pp: {stages} pipeline stages ({p.pp_schedule} on pp = {dims.pp}) but {cfg.model.flavor} "
            f"has only {args.n_layers} layers (plus the embedding and the output, which may be stages of their "
            f"own); {fix}"
        )
    if splits_backward(p.pp_schedule, p.pp_schedule_csv):
        _check_split_backward(cfg)
    micro = p.pp_microbatches if p.pp_microbatches != -1 else stages
    # One schedule step runs the microbatches of every gradient-accumulation batch of the optimizer step.
    accum = grad_accumulation_steps(cfg, dims.dp)
    total = micro * accum
    got = f"{total} ({micro} x {accum} gradient accumulation batches)" if accum > 1 else f"{total}"
    if total < dims.pp:
        raise ConfigError(
            f"parallelism.pp_microbatches: {got} microbatches per step cannot keep {dims.pp} pipeline ranks busy; "
            f"use at least {-(-dims.pp // accum)}"
        )
    if p.pp_schedule in ("Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS") and total % dims.pp:
        raise ConfigError(
            f"parallelism.pp_microbatches: {p.pp_schedule} needs a multiple of pp = {dims.pp} microbatches per "
            f"step, got {got}"
        )
    if p.pp_schedule == "DualPipeV" and not p.pp_schedule_csv and total < stages:
        raise ConfigError(
            f"parallelism.pp_microbatches: DualPipeV needs at least as many microbatches per step as stages "
            f"({stages} on pp = {dims.pp}), got {got}"
        )
    if p.pp_schedule_csv:
        from parallelize.pipeline_parallel import check_schedule_csv

        try:
            check_schedule_csv(p.pp_schedule_csv, dims.pp, p.pp_schedule, p.pp_virtual_stages, micro, accum)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.training.local_batch_size % micro:
        raise ConfigError(
            f"training.local_batch_size: {cfg.training.local_batch_size} samples do not split into "
            f"{micro} pipeline microbatches (parallelism.pp_microbatches)"
        )


def pp_microbatches(cfg: Config, dims) -> int:
    from parallelize.pipeline_parallel import num_stages

    p = cfg.parallelism
    if p.pp_microbatches != -1:
        return p.pp_microbatches
    return num_stages(dims.pp, p.pp_schedule, p.pp_virtual_stages)


def grad_accumulation_steps(cfg: Config, dp: int) -> int:
    """Microbatches per optimizer step on each data-parallel rank."""
    t = cfg.training
    if t.global_batch_size == -1:
        return 1
    return t.global_batch_size // (t.local_batch_size * dp)


# --------------------------------------------------------------------------------------------------------
# Dump
# --------------------------------------------------------------------------------------------------------


def to_toml(cfg: Config) -> str:
    import tomli_w

    return tomli_w.dumps(cfg.to_dict())


def dump(cfg: Config, folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "config.toml")
    with open(path, "w") as f:
        f.write(to_toml(cfg))
    return path
