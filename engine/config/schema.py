"""The configuration's schema: one typed dataclass per section of the TOML file, every field with its default
and a docstring (``--help`` prints them). Declarations only, and the one path derived from two fields
(``checkpoint_root``): loading is in loading.py, the cross-field rules in validation.py.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

__all__ = ["Job", "Model", "Data", "Training", "Parallelism", "ActivationCheckpoint", "Compile", "Float8", "Optimizer",
           "LRScheduler", "Metrics", "Validation", "Checkpoint", "Profiling", "Comm", "Debug", "Config", "SECTIONS",
           "checkpoint_root"]

@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Run folder: the resolved config.toml, metrics.jsonl, tensorboard/wandb logs and checkpoints go here."""
    description: str = "Tessera training run"
    """Free text describing the run; written into the dumped config."""
    print_config: bool = False
    """Print the resolved configuration on rank 0 before training."""
    owner_timeout_seconds: float = 60.0
    """The run owns dump_folder (its OWNER.json), and checkpoint.folder when outside it, while it lives; an
    owner on another host whose heartbeat stops this long is gone, its folder taken over (one on this host: its
    process is checked)."""


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
    """With attn = sdpa: the kernel scaled_dot_product_attention may use: auto (torch's choice; flash on Hopper),
    flash, cudnn, efficient (CUDA; K/V repeated to the query heads where the kernel lacks grouped-query support) or
    math. Not with context parallelism (its ring calls its kernels directly)."""
    hf_assets_path: str = ""
    """Folder with a Hugging Face tokenizer.json (and config.json); its tokenizer is used when
    data.tokenizer is empty."""
    vocab_size: int = -1
    """Vocabulary size of the embedding and output layers; -1 takes the flavor's size, or the tokenizer's
    size for flavors that do not fix one (debugmodel)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the Mixture-of-Experts auxiliary load-balancing loss in the trained loss (0: off; Hugging Face
    configs call it router_aux_loss_coef). Trained, it is computed over each forward's tokens on every rank, as
    one process computes it on the whole batch. Logged for MoE flavors either way, with each layer's expert load."""


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
    """Logical shards the dataset is split into, read in turn by each data-parallel rank; -1 = one per rank, else a
    multiple of the dp degree. A checkpoint keeps it, so a run resumes exactly on any dp degree that divides it:
    set it to a multiple of every dp degree you may resume on (e.g. 64)."""


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
    """One CUDA GPU, bf16 autocast, no parallelism or gradient accumulation: keep the matmul weights (linear, MoE
    experts) in bf16 plus a 16-bit low half (exactly the fp32 weight) instead of casting them in every pass; same
    numbers, memory and fp32 checkpoints (parallelize/bf16_weights.py). false = plain autocast."""
    fsdp_bf16_weights: bool = False
    """On CUDA under FSDP2 (FSDP, HSDP or fsdp_single_rank) with bf16 mixed precision: keep every parameter's
    shard as bf16 plus a 16-bit low half, so the all-gather reads bf16 with no cast and gradients are kept in
    bf16; fp32 checkpoints as before. Not with CPU offload, float8 all-gather or gradient accumulation."""
    loss_chunk_tokens: int = 0
    """Fuse the output projection with the cross-entropy over chunks of this many tokens, so the [tokens,
    vocabulary] logits never exist whole (GiBs less peak memory at a 128k vocabulary, the same FLOPs); works with
    TP and PP. 0 = off (logits, then the loss)."""
    empty_cache_after_first_step: bool = False
    """On CUDA: after the first step (compilation, autotuning, optimizer state created), synchronize the GPU and
    return the caching allocator's free blocks to it once, so memory only that step used is not held idle. Off
    by default until the GPU check has run it on every path, FSDP2 included."""
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
    ep: int = 1
    """Expert-parallel degree (Mixture-of-Experts flavors): each expert lives on one of ep ranks drawn from
    dp_shard x cp, tokens reach it by all-to-all; must divide dp_shard x cp and the experts."""
    pp_schedule: str = "1F1B"
    """Pipeline schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or
    DualPipeV. The zero-bubble ones (the last three) take no compile, activation checkpointing or float8 layers,
    and on torch 2.11 no fused loss (training.loss_chunk_tokens)."""
    pp_schedule_csv: str = ""
    """A CSV file with a custom schedule (torch.distributed.pipelining's format); overrides pp_schedule's
    actions (pp_schedule still names the stage placement)."""
    pp_microbatches: int = -1
    """Microbatches each local batch is split into for the pipeline; -1 = the number of stages. With gradient
    accumulation one schedule step runs all of the optimizer step's microbatches (pp_microbatches x accumulation
    steps), so the pipeline fills and drains once per optimizer step."""
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
    """For selective_option = op: the matmul outputs kept: all (the least recompute) or alternate (torchtitan's
    per-op policy: every other matmul of a block, about 9% more compute for a third less activation memory)."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (fullgraph) and the loss."""
    backend: str = "inductor"
    """The torch.compile backend: inductor (generated kernels: the speed-up), aot_eager (the same Dynamo graphs
    and AOT autograd partition, run by eager kernels: tells a code-generation problem from a tracing one) or
    eager (Dynamo's graphs alone)."""
    autotune: bool = True
    """Inductor benchmarks several launch configurations of each kernel at its first launch (on clones of its
    outputs, which can leave the first step's memory reserved) and keeps the fastest. false: one configuration
    per kernel, no clones (needs compile.enable)."""


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
    """Optimizer kernel: auto (fused on CUDA, foreach on CPU), fused, foreach or for-loop (per tensor, each
    DTensor parameter stepped on its local shard)."""


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
    """On resuming from a checkpoint older than the last logged step, rewind the wandb run to the checkpoint's step
    (wandb.init(resume_from=...), a W&B preview feature) so the retrained steps replace the abandoned ones. false:
    wandb drops the retrained steps (a warning names them)."""
    save_for_all_ranks: bool = False
    """Every rank writes metrics (metrics_rank<N>.jsonl; a fresh run sets an earlier run's aside as
    metrics_rank<N>.<n>.jsonl); otherwise rank 0 only."""
    peak_flops: float = -1.0
    """Peak FLOP/s of one device for MFU; -1 looks the device up in a table (H100 bf16 989e12, ...)."""
    plots: bool = True
    """At the end of the run, draw loss.png and throughput.png (experts.png for MoE) into job.dump_folder from
    metrics.jsonl; `python -m engine.plot FOLDER` draws them at any time."""


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
    checksums: bool = True
    """The commit marker lists each saved file's checksum (XXH3; each rank's read back once written), and a resume,
    initial weights from a step folder and convert_hf check them first, every rank its share: a file whose bytes
    changed after the save is one error line. false: neither (such a file may then load without a word)."""
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
    transformers' from_pretrained loads; the ranks share the work. A resumed run leaves an existing one alone."""
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


def checkpoint_root(cfg: Config) -> str:
    """The folder of the run's step folders: checkpoint.folder, relative to job.dump_folder unless absolute."""
    folder = cfg.checkpoint.folder
    return folder if os.path.isabs(folder) else os.path.join(cfg.job.dump_folder, folder)


SECTIONS: dict[str, type] = {f.name: type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)}
