"""Typed configuration: one dataclass per section of `conf/`.

Hydra merges the YAML groups onto these dataclasses (registered in `store.py`), so an unknown key
or a value of the wrong type is refused while the config is composed. `OmegaConf.to_object` turns
the composed config into these objects once, in `main.py`; each `__post_init__` then checks its own
section, and `validate.py` checks what spans sections. Choices are `str` enums because OmegaConf
2.3 does not accept `typing.Literal`; they compare equal to their plain string values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from framework.config.degrees import check_degrees
from framework.config.dpo import DPOConfig
from framework.config.grpo import GRPOConfig
from framework.config.pipeline import PipelineSchedule
from framework.errors import UserInputError


class Engine(str, Enum):
    native = "native"  # our own sharded engine (framework.distributed.fsdp)
    torch = "torch"  # torch.distributed.fsdp.fully_shard, for side-by-side comparison


class HostTransport(str, Enum):
    shm = "shm"  # ranks on one host: all-gathers and reduce-scatters through shared memory (native engine, CPU)
    gloo = "gloo"  # always gloo's TCP, as torch's engines do


class ShardBoundary(str, Enum):
    """Where a rank's piece of a unit's flat buffer may begin or end (native engine):
    [Note: shard boundaries] in framework/distributed/shard_layout.py."""

    anywhere = "anywhere"  # tight packing: the least padding
    rows = "rows"  # whole rows of every matrix per rank
    params = "params"  # every parameter whole on one rank


class Strategy(str, Enum):
    full = "full"  # ZeRO-3: reshard after forward, re-gather in backward
    grad_op = "grad_op"  # ZeRO-2: keep parameters unsharded from forward to backward
    hybrid = "hybrid"  # shard inside dp_shard groups, replicate across dp_replicate
    no_shard = "no_shard"  # DDP-like: every rank holds everything


class ActivationCheckpointing(str, Enum):
    none = "none"
    full = "full"  # recompute every transformer block in backward
    selective = "selective"  # recompute every other block


class OptimizerName(str, Enum):
    adamw = "adamw"
    sgd = "sgd"
    muon = "muon"  # Muon for the hidden matrices, AdamW for the rest (framework/optim/muon.py)


class Schedule(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class DataName(str, Enum):
    synthetic = "synthetic"  # random tokens, no files: for tests and benchmarks
    stdlib = "stdlib"  # the embedded default corpus: this Python's own standard library sources
    indexed = "indexed"  # Megatron .bin/.idx datasets prepared by `stage=data_preparation`
    digits = "digits"  # scikit-learn's bundled 8x8 handwritten digits (images and labels; no download)
    hf = "hf"  # Hugging Face `datasets` from local files or a save_to_disk directory (framework/data/hf_data.py)


class Stage(str, Enum):
    training = "training"
    data_preparation = "data_preparation"
    plan = "plan"  # print memory, traffic and step time of the job as configured (framework/planner)
    fine_tuning = "fine_tuning"  # supervised fine-tuning on JSONL records (the `finetune` section)
    generate = "generate"  # text from a checkpoint or an export (the `generate` section, framework/generate.py)
    evaluate = "evaluate"  # lm-eval tasks on a checkpoint or an export (the `evaluate` section, framework/evaluate.py)
    dpo = "dpo"  # preference optimization on data=hf pairs (the `dpo` section, framework/dpo/)
    grpo = "grpo"  # reinforcement learning from rewards on data=hf prompts (the `grpo` section, framework/grpo/)


# The shortest trainer.collective_timeout_s accepted. The job's key-value store waits this long for
# a rank that starts late, and every collective for a rank that is busy (writing a checkpoint,
# preparing data): a shorter one fails healthy jobs in the store's C++ with no rank named (1e-9 did,
# on every rank). 5 s is what the hung-rank test runs at (tests/reliability/test_failures.py): the
# ranks start and train, and the one stopped is named after the diagnosis's 4 heartbeats of 1 s
# (framework/runtime.py, [Note: naming the rank that did not arrive]).
MIN_COLLECTIVE_TIMEOUT_S = 5.0
# The longest accepted: a week. torch turns the timeout into C++ durations (the store's, gloo's,
# NCCL's watchdog): 1e10 s ended the job in C++ frames and 1e15 s in an OverflowError traceback.
# A week starts and runs a gloo group and its collectives (checked with torch 2.13); a collective
# waiting longer than a week for a rank is a job no one is watching.
MAX_COLLECTIVE_TIMEOUT_S = 7 * 24 * 3600.0


def _positive(section: str, **values: float) -> None:
    for name, value in values.items():
        if value is None or not 0 < value < math.inf:  # nan and inf too (a timeout of inf never fires)
            raise UserInputError(f"{section}.{name}={value}: must be > 0 and finite")


def _choice(section: str, name: str, value: Any, enum: type[Enum]) -> Enum:
    try:
        return enum(value)
    except ValueError:
        choices = ", ".join(e.value for e in enum)
        raise UserInputError(f"{section}.{name}={value!r}: unknown; choose one of {choices}") from None


@dataclass
class ModelConfig:
    """What every model has; a family's own arguments (sizes, widths) are its `args`."""

    name: str = "debug"  # a registered architecture preset (conf/model/*.yaml)
    # The family's own arguments, checked against its typed dataclass (framework/models/args.py):
    # our Llama's sizes (LlamaArgs: dim, n_layers, ..., vocab_size -1 for the tokenizer's), the
    # digits CNN's {channels, hidden}, Hugging Face's {max_seq_len}. Each conf/model preset lists
    # its own, so `model.args.n_layers=4` overrides one. Any: Hydra adds keys to a typed dict only with +.
    args: Any = None
    # Build on the meta device and initialise each rank's shards after sharding (never the whole
    # model on one rank). null: only when the fp32 model exceeds 4 GiB. Small models are otherwise
    # built whole with the seed, so their numbers do not depend on the layout.
    meta_init: Optional[bool] = None
    # model=hf only (docs/models.md): a local directory holding a transformers config.json (and,
    # optionally, safetensors weights), or an inline transformers config for tests; never a hub name.
    path: str = ""
    config: Any = None  # e.g. {model_type: gpt2, n_layer: 2} (Any: Hydra adds keys to a typed dict only with +)
    # causal_lm | seq2seq | sequence_classification (framework/models/tasks.py); "": the model's
    # own (model=hf: from config.json's architectures)
    task: str = ""
    num_labels: int = -1  # classes of a classification task; -1: the model's own (else 2)
    # A module outside framework/models that registers this model's family (register_family) when
    # imported: a user's own family, named by its conf/model YAML. "": the built-in families.
    family_module: str = ""


@dataclass
class ParallelismConfig:
    engine: Engine = Engine.native
    strategy: Strategy = Strategy.full
    dp_replicate: int = 1  # replica groups (hybrid sharding); -1: infer from the world size
    dp_shard: int = -1  # ranks a parameter is sharded over; -1: infer from the world size
    tp: int = 1  # tensor-parallel degree (splits every block)
    ep: int = 1  # expert-parallel degree: each MoE block's experts split over ep of the dp_shard ranks
    cp: int = 1  # context-parallel degree: each sequence split over cp ranks (all-to-all attention)
    sequence_parallel: bool = False  # shard norms/residuals on the sequence dim when tp > 1
    param_dtype: str = "float32"  # dtype of the gathered compute copy (float32 | bfloat16 | float16)
    reduce_dtype: str = "float32"  # dtype gradients are reduced in
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    cpu_offload: bool = False  # keep shards, grads and optimizer state on the CPU
    compile: bool = False  # torch.compile each transformer block
    quantized_comm: bool = False  # int8 block-quantized all-gather / reduce-scatter (native engine)
    # float8 training (torchao float8 linears; emulated in fp32 off CUDA): docs/engine.md "Float8"
    float8: bool = False
    float8_recipe: str = "tensorwise"  # tensorwise | rowwise (the scales' granularity)
    float8_all_gather: Optional[bool] = None  # gather float8 weights as float8; null: tensorwise, tp=1
    # CPU jobs with the native engine: how a group of ranks on one host moves its all-gathers and
    # reduce-scatters (groups that span hosts use gloo either way)
    host_transport: HostTransport = HostTransport.shm
    # where shard boundaries fall (native engine): anywhere | rows | params (docs/engine.md)
    shard_boundary: ShardBoundary = ShardBoundary.anywhere
    # Pipeline parallelism (framework/config/pipeline.py, docs/engine.md "Pipeline parallelism"):
    pp: int = 1  # pipeline stages across ranks, the outermost mesh dimension
    # gpipe | 1f1b | interleaved_1f1b | zbv (a str for Hydra, which matches enums by name: 1f1b is none)
    pp_schedule: str = PipelineSchedule.one_f_one_b.value
    pp_microbatches: int = -1  # per data-parallel rank and step; -1: the gradient accumulation steps
    pp_virtual_stages: int = -1  # stages per rank; -1: 1 (gpipe, 1f1b) or 2 (interleaved_1f1b, zbv)
    pp_split: List[int] = field(default_factory=list)  # layers per stage; empty: balanced by work

    def __post_init__(self) -> None:
        self.engine = _choice("parallelism", "engine", self.engine, Engine)
        self.pp_schedule = _choice("parallelism", "pp_schedule", self.pp_schedule, PipelineSchedule)
        self.shard_boundary = _choice("parallelism", "shard_boundary", self.shard_boundary, ShardBoundary)
        self.host_transport = _choice("parallelism", "host_transport", self.host_transport, HostTransport)
        self.strategy = _choice("parallelism", "strategy", self.strategy, Strategy)
        self.activation_checkpointing = _choice(
            "parallelism", "activation_checkpointing", self.activation_checkpointing, ActivationCheckpointing
        )
        check_degrees(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp)
        if self.ep < 1:
            raise UserInputError(f"parallelism.ep={self.ep}: must be a positive degree (1: no expert parallelism)")
        if self.cp < 1:
            raise UserInputError(f"parallelism.cp={self.cp}: must be a positive degree (1: no context parallelism)")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise UserInputError(f"parallelism.{name}={getattr(self, name)!r}: choose float32, bfloat16 or float16")
        if self.float8_recipe not in ("tensorwise", "rowwise"):
            raise UserInputError(f"parallelism.float8_recipe={self.float8_recipe!r}: choose tensorwise or rowwise")
        if self.float8_all_gather and self.float8_recipe != "tensorwise":
            raise UserInputError(
                "parallelism.float8_all_gather=true needs parallelism.float8_recipe=tensorwise (a row-wise "
                "weight is scaled per row by the linear); set parallelism.float8_all_gather=false"
            )
        if self.float8_all_gather and self.cpu_offload:
            raise UserInputError(
                "parallelism.float8_all_gather=true with parallelism.cpu_offload=true: offloaded shards "
                "are gathered in the param dtype; set parallelism.float8_all_gather=false"
            )
        if self.float8_all_gather and not self.float8:
            raise UserInputError("parallelism.float8_all_gather=true needs parallelism.float8=true")
        if self.float8 and self.quantized_comm:
            raise UserInputError(
                "parallelism.float8=true with parallelism.quantized_comm=true: the gather is float8 or "
                "int8, not both; set parallelism.quantized_comm=false"
            )
        if self.float8_all_gather and self.tp > 1:
            raise UserInputError(
                f"parallelism.float8_all_gather=true with parallelism.tp={self.tp}: the float8 gather's scale is "
                "agreed over the data-parallel ranks only; set parallelism.float8_all_gather=false (or null)"
            )
        if self.shard_boundary != ShardBoundary.anywhere and self.engine == Engine.torch:
            raise UserInputError(
                f"parallelism.shard_boundary={self.shard_boundary.value} is a feature of the native engine (torch's "
                "fully_shard cuts every parameter on dim 0); set parallelism.engine=native or "
                "parallelism.shard_boundary=anywhere"
            )
        if self.quantized_comm and self.engine == Engine.torch:
            raise UserInputError(
                "parallelism.quantized_comm is a feature of the native engine; "
                "set parallelism.engine=native or parallelism.quantized_comm=false"
            )


@dataclass
class OptimizerConfig:
    name: OptimizerName = OptimizerName.adamw
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the schedule's floor, as a fraction of lr
    weight_decay: float = 0.1  # not applied to norms, biases and embeddings
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9  # SGD only
    # Muon (optimizer=muon): its own peak lr and momentum for the hidden matrices (the schedule
    # scales both groups alike); lr, betas and weight_decay above are the AdamW part's, and
    # weight_decay is Muon's too. muon_adjust_lr: "original" (sqrt(max(1, rows/cols))) or
    # "match_rms_adamw" (0.2 sqrt(max(rows, cols)): AdamW's lr carries over)
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_adjust_lr: str = "original"
    muon_ns_steps: int = 5
    # fp32 | bf16: the dtype of Adam's exp_avg / exp_avg_sq and Muon's momentum between steps (bf16
    # halves those bytes; written back with stochastic rounding: framework/optim/lowp.py)
    state_dtype: str = "fp32"
    schedule: Schedule = Schedule.cosine
    warmup_steps: int = 10
    clip_grad_norm: float = 1.0  # 0 disables clipping

    def __post_init__(self) -> None:
        self.name = _choice("optimizer", "name", self.name, OptimizerName)
        self.schedule = _choice("optimizer", "schedule", self.schedule, Schedule)
        _positive("optimizer", lr=self.lr, muon_lr=self.muon_lr, muon_ns_steps=self.muon_ns_steps)
        if self.muon_adjust_lr not in ("original", "match_rms_adamw"):
            raise UserInputError(
                f"optimizer.muon_adjust_lr={self.muon_adjust_lr!r}: choose original or match_rms_adamw"
            )
        if self.state_dtype not in ("fp32", "bf16"):
            raise UserInputError(f"optimizer.state_dtype={self.state_dtype!r}: unknown; choose one of fp32, bf16")
        if self.state_dtype == "bf16" and self.name == OptimizerName.sgd:
            raise UserInputError(
                "optimizer.state_dtype=bf16 with optimizer=sgd: bf16 state is for adamw and muon; "
                "set optimizer.state_dtype=fp32"
            )
        for name in ("weight_decay", "warmup_steps", "clip_grad_norm", "min_lr_ratio", "momentum", "muon_momentum"):
            if getattr(self, name) < 0:
                raise UserInputError(f"optimizer.{name}={getattr(self, name)}: must be >= 0")


@dataclass
class HFDataConfig:
    """data=hf: how records of a Hugging Face dataset become text (data.paths name the files)."""

    text_field: str = "text"  # a string column; else a chat column or prompt/response columns are used
    messages_field: str = "messages"  # a list of {role, content}: the tokenizer's chat template, else plain lines
    prompt_field: str = "prompt"
    response_field: str = "response"
    streaming: bool = False  # read as it trains (data larger than memory or disk cache), in file order
    shuffle: bool = True  # not streaming: documents in a seeded order, a new one each epoch
    valid_documents: int = 64  # the first N documents of each path are the validation set

    def __post_init__(self) -> None:
        _positive("data.hf", valid_documents=self.valid_documents)


@dataclass
class DataConfig:
    name: DataName = DataName.synthetic
    seq_len: int = 64  # tokens per sample fed to the model
    # indexed datasets: prefixes (without .bin/.idx); data=hf: parquet/JSONL/arrow/text files,
    # directories of them, or save_to_disk directories
    paths: List[str] = field(default_factory=list)
    weights: List[float] = field(default_factory=list)  # blend weights, one per path (empty: by size)
    # train,valid,test proportions; quote it on the command line: data.split="'90,10,0'"
    split: str = "98,1,1"
    # prepared corpora, tokenizers and megatron-core's shuffled index files (<cache_dir>/index);
    # relative: to the working directory
    cache_dir: str = "data_cache"
    # a tokenizer.json; empty: the one data preparation wrote next to the first path
    # (<path>.tokenizer.json), or for data=stdlib a byte-level BPE trained on the corpus
    tokenizer: str = ""
    vocab_size: int = 2048  # size of the byte-level BPE trained by data preparation
    raw_inputs: List[str] = field(default_factory=list)  # data_preparation: text/JSONL files or dirs
    output_prefix: str = ""  # data_preparation: where to write <prefix>.bin/.idx
    workers: int = 2  # data_preparation: tokenizer processes
    # data_preparation: the largest document (a text file, or one JSONL line) read, in MiB; larger
    # ones are refused naming the file (tokenizing one takes ~8x its size in memory)
    max_document_mb: int = 256
    hf: HFDataConfig = field(default_factory=HFDataConfig)

    def __post_init__(self) -> None:
        self.name = _choice("data", "name", self.name, DataName)
        _positive(
            "data",
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
            workers=self.workers,
            max_document_mb=self.max_document_mb,
        )
        try:
            parts = [float(x) for x in str(self.split).replace("/", ",").split(",")]
        except ValueError:
            parts = []
        if len(parts) != 3 or min(parts) < 0 or parts[0] <= 0 or parts[1] <= 0:
            raise UserInputError(
                f"data.split={self.split!r}: give train,valid,test proportions with train "
                "and valid > 0, e.g. data.split=\"'98,1,1'\" (quoted: Hydra reads a bare "
                "98,1,1 as a list)"
            )
        if any(w < 0 for w in self.weights) or (self.weights and sum(self.weights) <= 0):
            raise UserInputError(f"data.weights={list(self.weights)}: blend weights must be >= 0 with a positive sum")
        if self.weights and len(self.weights) != len(self.paths):
            raise UserInputError(
                f"data.weights has {len(self.weights)} entries for {len(self.paths)} "
                "data.paths: give one weight per path, or none for equal weights"
            )


@dataclass
class TrainerConfig:
    # The main job: 16 samples x 128 tokens = 2,048 tokens/step (2 ranks x micro-batch 8 x 1
    # accumulation step); 400 steps take about two minutes on 2 CPU cores.
    max_steps: int = 400
    global_batch_size: int = 16  # samples per optimizer step, over all data-parallel ranks
    # samples per rank per forward; the rest is gradient accumulation. null: the largest of 8 and
    # its divisors that divides global_batch_size / data-parallel size (set when the job starts)
    micro_batch_size: Optional[int] = None
    eval_interval: int = 100  # steps between validation losses (0: never)
    eval_iters: int = 4  # validation batches per evaluation
    # steps between metrics records, and between the host's reads of the loss: a non-finite loss
    # is found at the next one at the latest (framework/metrics.py)
    log_interval: int = 1
    seed: int = 1234
    max_time_minutes: float = 0.0  # stop (with a checkpoint) after this wall time; 0: no limit
    device: str = "auto"  # auto | cpu | cuda
    # A progress bar on the terminal; null: a bar when stderr is a terminal, else (batch logs:
    # Slurm's .err files, kubectl logs) one line per trainer.log_interval steps; false: neither.
    progress_bar: Optional[bool] = None
    sample_tokens: int = 160  # tokens of text generated at the end of training (0: none; needs a tokenizer)
    peak_tflops: float = 0.0  # the device's peak for MFU; 0: look it up, unknown on CPU
    # A collective that waits longer than this for a rank fails, and the job ends naming the rank(s)
    # that did not arrive (a stopped process, a lost node); torch's own default is 30 minutes. From
    # MIN_COLLECTIVE_TIMEOUT_S to MAX_COLLECTIVE_TIMEOUT_S (a week).
    collective_timeout_s: float = 300.0
    # torch.profiler traces per rank in <run dir>/profile (see [Note: step profiles]): skip
    # profile_wait steps, warm up profile_warmup, record profile_active
    profile: bool = False
    profile_wait: int = 1
    profile_warmup: int = 1
    profile_active: int = 2
    # lm-eval tasks (evaluate.include_path for local ones) run every eval_tasks_interval steps and
    # at the end; scores go to <run>/eval/ and the trackers
    eval_tasks: List[str] = field(default_factory=list)
    eval_tasks_interval: int = 0  # 0: only at the end (when eval_tasks is set)
    # Losses, gradient norms and weights bit for bit the same whatever the number of ranks, the
    # strategy, dp_shard/dp_replicate and the micro-batch split of the same global batch (our
    # engine; docs/engine.md "Deterministic mode"): gradients summed in one tree over the batch's
    # units, one intra-op thread per rank on CPU.
    deterministic: bool = False
    # samples per unit of that sum (one backward each); null: trainer.micro_batch_size. Runs compared
    # bit for bit must use the same unit; it divides micro_batch_size.
    deterministic_unit: Optional[int] = None

    def __post_init__(self) -> None:
        _positive(
            "trainer",
            max_steps=self.max_steps,
            global_batch_size=self.global_batch_size,
            log_interval=self.log_interval,
            eval_iters=self.eval_iters,
            collective_timeout_s=self.collective_timeout_s,
            profile_active=self.profile_active,
        )
        if not MIN_COLLECTIVE_TIMEOUT_S <= self.collective_timeout_s <= MAX_COLLECTIVE_TIMEOUT_S:  # nan too
            raise UserInputError(
                f"trainer.collective_timeout_s={self.collective_timeout_s}: must be from "
                f"{MIN_COLLECTIVE_TIMEOUT_S:g} s (the ranks' store waits this long for a rank that starts "
                f"late, and every collective for a busy one) to {MAX_COLLECTIVE_TIMEOUT_S:g} s (a week); "
                "the default is 300"
            )
        for name in (
            "eval_interval",
            "eval_tasks_interval",
            "max_time_minutes",
            "sample_tokens",
            "peak_tflops",
            "profile_wait",
            "profile_warmup",
        ):
            if not 0 <= getattr(self, name) < math.inf:
                raise UserInputError(f"trainer.{name}={getattr(self, name)}: must be >= 0 and finite")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UserInputError(f"trainer.device={self.device!r}: choose auto, cpu or cuda")
        if self.micro_batch_size is not None:
            _positive("trainer", micro_batch_size=self.micro_batch_size)
        if self.deterministic_unit is not None:
            _positive("trainer", deterministic_unit=self.deterministic_unit)

    def fit_micro_batch(self, dp: int) -> None:
        """Choose micro_batch_size when it is null: the largest of 8, 4, 2, 1 dividing the
        samples each data-parallel rank gets per step (unchanged if those do not divide)."""
        if self.micro_batch_size is None:
            per_rank = self.global_batch_size // dp if self.global_batch_size % dp == 0 else 1
            self.micro_batch_size = next(m for m in (8, 4, 2, 1) if per_rank % m == 0)


@dataclass
class CheckpointConfig:
    dir: str = "checkpoints"  # relative paths are inside the run directory
    interval: int = 0  # steps between saves (0: only at the end)
    # auto (latest complete checkpoint in dir; pass the same hydra.run.dir) | none | a step_* or
    # checkpoints path
    resume: str = "none"
    keep_last: int = 3  # complete checkpoints kept; older ones are deleted after each save
    async_save: bool = False  # write in a background thread while training goes on (a CPU snapshot first)
    save_final: bool = True  # save at the last step
    init_from: str = ""  # fresh start from an exported model.safetensors + config.json directory
    export_safetensors: bool = False  # write <dir>/export/model.safetensors + config.json (HF names) at the end
    # Steps between in-memory snapshots (0: none): each rank's shards, data position, RNG and LR
    # schedule in host memory that outlives the rank; a restarted job resumes from the newest one
    # every rank has whole, before any disk (framework/checkpoint/memory.py, docs/reliability.md).
    memory_interval: int = 0
    memory_dir: str = ""  # where the snapshots live on each node (empty: /dev/shm)

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise UserInputError(f"checkpoint.interval={self.interval}: must be >= 0")
        if self.memory_interval < 0:
            raise UserInputError(
                f"checkpoint.memory_interval={self.memory_interval}: must be >= 0 (0 turns snapshots off)"
            )
        _positive("checkpoint", keep_last=self.keep_last)


@dataclass
class FineTuneConfig:
    """stage=fine_tuning: supervised fine-tuning (framework/finetune/); see docs/fine_tuning.md."""

    train_file: str = ""  # JSONL: {"prompt", "response"} or {"messages": [{"role", "content"}, ...]} per line
    # An embedded set instead of train_file, written into data.cache_dir once (cut from this Python's
    # standard library): stdlib_functions ("complete this function" pairs) or stdlib_docstrings
    # (function source -> the first line of its docstring, for a sequence-to-sequence model).
    dataset: str = ""
    valid_file: str = ""  # held-out records; empty: hold out valid_fraction of train_file
    valid_fraction: float = 0.1
    packing: bool = True  # several records per row, attention kept inside each; false: one padded record per row
    # A tokenizer.json, or a directory with a Hugging Face tokenizer (and chat template). Empty: the
    # tokenizer of checkpoint.init_from's or model.path's directory, else data.tokenizer, else the stdlib corpus's.
    tokenizer: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.valid_fraction < 1:
            raise UserInputError(f"finetune.valid_fraction={self.valid_fraction}: must be between 0 and 1")
        if self.dataset not in ("", "stdlib_functions", "stdlib_docstrings"):
            raise UserInputError(
                f"finetune.dataset={self.dataset!r}: unknown; choose stdlib_functions or "
                "stdlib_docstrings, or leave it empty and give finetune.train_file"
            )


@dataclass
class LoraConfig:
    enabled: bool = False
    rank: int = 8  # inner size of each adapter
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input, in training
    # Layers adapted, by their last name (Hugging Face spelling; our Llama's wq/wk/wv/wo/w1/w2/w3
    # answer to q_proj/k_proj/v_proj/o_proj/gate_proj/down_proj/up_proj as well).
    targets: List[str] = field(default_factory=lambda: ["q_proj", "v_proj"])

    def __post_init__(self) -> None:
        _positive("peft.lora", rank=self.rank, alpha=self.alpha)
        if not 0 <= self.dropout < 1:
            raise UserInputError(f"peft.lora.dropout={self.dropout}: must be in [0, 1)")
        if self.enabled and not self.targets:
            raise UserInputError("peft.lora.targets is empty: name the layers to adapt, e.g. [q_proj,v_proj]")


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning (framework/peft/): the base model frozen, adapters trained."""

    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class WandbConfig:
    """Weights & Biases (`logger=[...,wandb]`): the `wandb` package, rank 0 only. The API key comes
    from WANDB_API_KEY in the environment, never from here (cluster.secret_env in a job)."""

    enabled: bool = False
    mode: str = "offline"  # offline (files under <run>/wandb, `wandb sync` later) | online | disabled
    project: str = "framework"
    entity: str = ""  # team or user; "": the account's default
    name: str = ""  # the run's display name; "": the run directory's name
    group: str = ""
    tags: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode not in ("offline", "online", "disabled"):
            raise UserInputError(f"logging.wandb.mode={self.mode!r}: choose offline, online or disabled")
        if not self.project.strip():
            raise UserInputError("logging.wandb.project is empty: name the W&B project")


@dataclass
class MlflowConfig:
    """MLflow (`logger=[...,mlflow]`): the `mlflow` package, rank 0 only. Credentials come from
    MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME/PASSWORD in the environment, never from the
    URI (refused there: the URI is written to config.yaml, the trackers and job logs)."""

    enabled: bool = False
    tracking_uri: str = ""  # http://host:5000, sqlite:///path.db, ...; "": sqlite <run>/mlflow.db
    experiment: str = "framework"
    run_name: str = ""  # "": the run directory's name
    tags: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = _credential_in_uri(self.tracking_uri)
        if where:
            raise UserInputError(
                f"logging.mlflow.tracking_uri holds a credential ({where}): give the URI without it and set "
                "MLflow's MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, in the "
                "environment (cluster.secret_env in a job)"
            )
        if not self.experiment.strip():
            raise UserInputError("logging.mlflow.experiment is empty: name the MLflow experiment")


def _credential_in_uri(uri: str) -> Optional[str]:
    """Where `uri` may hold a credential (said without quoting it), or None. A tracking server
    needs no user information, query, fragment or path parameter, and a credential can hide in any
    of them under any name (`;token=`, `?jwt=`, `?t=`, `?SAS=`), so each is refused whatever it is
    called. The one exception is sqlite's query (`sqlite:///runs/mlflow.db?timeout=20`): a local
    file has no credential, and its query holds sqlite's own options."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(uri)
    except ValueError as exc:  # the text is not quoted: it may hold a secret
        raise UserInputError(f"logging.mlflow.tracking_uri is not a URI ({exc}); give e.g. http://host:5000") from None
    if "@" in parts.netloc:
        return "a user name or password before the host"
    if ";" in parts.path or ";" in parts.netloc:
        return "a parameter after ; in the path"
    if (parts.query or uri.rstrip("#").endswith("?")) and parts.scheme.lower() != "sqlite":
        return "a query after ?"
    if parts.fragment:
        return "a fragment after #"
    return None


@dataclass
class LoggingConfig:
    """Where metrics go besides metrics.jsonl: `logger=[tensorboard,wandb,mlflow]` (conf/logger/)."""

    tensorboard: bool = False  # set by logger=tensorboard, the default
    jsonl: bool = True  # metrics.jsonl in the run directory
    loss_plot: bool = True  # <run>/loss.png at each checkpoint and at the end
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass
class ClusterConfig:
    """The job's shape: what training (and the planner) need of the machines. Where and how the job
    runs (Slurm, Kubernetes, containers) is the launcher's own config (launcher_scripts/config.py)."""

    nodes: int = 1  # machines; every one runs a torchrun agent with nproc_per_node ranks
    nproc_per_node: int = 2  # processes (ranks) per node
    gpus_per_node: int = 0  # 0: CPU job (no GPU request); otherwise at least nproc_per_node
    gpu_type: str = "auto"  # planner's device table: auto (h100 with GPUs, else cpu) | h100 | h200 | h800 | a100 | cpu
    gpu_memory_gib: float = 0.0  # memory per rank the planner plans for; 0: the gpu_type's

    def __post_init__(self) -> None:
        _positive("cluster", nodes=self.nodes, nproc_per_node=self.nproc_per_node)
        if self.gpu_type not in ("auto", "h100", "h200", "h800", "a100", "cpu"):
            raise UserInputError(f"cluster.gpu_type={self.gpu_type!r}: choose auto, h100, h200, h800, a100 or cpu")
        for name in ("gpus_per_node", "gpu_memory_gib"):
            if getattr(self, name) < 0:
                raise UserInputError(f"cluster.{name}={getattr(self, name)}: must be >= 0")
        if self.gpus_per_node and self.nproc_per_node > self.gpus_per_node:
            raise UserInputError(
                f"cluster.nproc_per_node={self.nproc_per_node} > cluster.gpus_per_node="
                f"{self.gpus_per_node}: every rank needs its own GPU; lower nproc_per_node "
                "or set gpus_per_node=0 for a CPU job"
            )


@dataclass
class GenerateConfig:
    """`stage=generate`: sample text from checkpoint.resume (a step directory, any world size) or
    checkpoint.init_from (an export), one prompt after another, streamed to the terminal."""

    prompts: List[str] = field(default_factory=list)
    prompt_file: str = ""  # one prompt per line, after `prompts`
    max_new_tokens: int = 64
    temperature: float = 0.8  # 0: greedy
    top_k: int = 50  # 0: all
    top_p: float = 1.0  # nucleus sampling; 1: off
    seed: int = 0
    # prompts decoded together (left-padded, one KV cache); 1 streams each completion a token at a
    # time, more print each batch's completions when it ends. A prompt's text does not depend on it.
    batch_size: int = 1
    stop_strings: List[str] = field(default_factory=list)  # a completion ends before the first of these
    # JSON lines, one per prompt (prompt, completion, finish_reason, new_tokens), written by rank 0
    # when every prompt is done; a new file: an existing one is refused, never replaced
    output_file: str = ""

    def __post_init__(self) -> None:
        _positive("generate", max_new_tokens=self.max_new_tokens, batch_size=self.batch_size)
        if any(not s for s in self.stop_strings):
            raise UserInputError("generate.stop_strings: an empty stop string would end every completion at once")
        if not 0 <= self.temperature < math.inf or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise UserInputError(
                f"generate: temperature={self.temperature} (>= 0), top_k={self.top_k} (>= 0) or "
                f"top_p={self.top_p} (in (0, 1]) is out of range"
            )


@dataclass
class EvaluateConfig:
    """lm-eval-harness tasks: `stage=evaluate`, and trainer.eval_tasks during training."""

    tasks: List[str] = field(default_factory=list)  # lm-eval task names (stage=evaluate)
    include_path: str = ""  # a directory of task YAMLs: tasks over local data
    num_fewshot: Optional[int] = None  # None: each task's own
    limit: Optional[float] = None  # documents per task (a fraction when < 1); None: all
    batch_size: int = 8  # requests per forward
    max_gen_tokens: int = 64  # generation tasks: the most new tokens, unless the task says
    # Run the code task files in include_path name: `!function` Python, metrics loaded through
    # Hugging Face evaluate (their scripts), Jinja templates rendered outside the sandbox. Refused
    # without it ([Note: task files that run code] in framework/task_files.py): only for files you trust.
    trust_task_code: bool = False

    def __post_init__(self) -> None:
        _positive("evaluate", batch_size=self.batch_size, max_gen_tokens=self.max_gen_tokens)
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise UserInputError(f"evaluate.num_fewshot={self.num_fewshot}: must be >= 0")
        if self.limit is not None and not 0 < self.limit < math.inf:
            raise UserInputError(f"evaluate.limit={self.limit}: must be > 0 (a count, or a fraction below 1)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    finetune: FineTuneConfig = field(default_factory=FineTuneConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    stage: Stage = Stage.training
    run_dir: str = ""  # filled in by main.py from hydra.run.dir; never set by hand

    def __post_init__(self) -> None:
        self.stage = _choice("", "stage", self.stage, Stage)
