"""The composition matrix: which settings combine, read from config validation, and the cases that
run them against a reference.

[Note: the composition matrix]
`DIMENSIONS` names each setting the matrix spans and its values, each a list of `main.py`
overrides (the first value is the default: no override). Two values of different dimensions are
a *pair*; a pair is *allowed* when the job holding only those two (the rest at their defaults)
passes everything `main.py` checks before any rank starts (`config_problems`: the sections' own
checks, `framework.config.validate`, the model family's refusals), else *refused* with the lines
validation printed. Nothing here lists refusals: they are read from the code, so a change that
lifts one only moves its line in docs/engine.md's composition table (tests/integration/
test_composition.py checks the table against validation both ways).

`CASES` is a pairwise covering set: every allowed pair meets in at least one case, which the test
computes. Each case names its values, the reference it must equal (one process on the same
global batch, or another case) and the tolerance with its reason. The quick cases run by default;
the rest run with COMPOSITION_ALL=1 (they start 2-4 gloo ranks each).
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

# A job every value composes onto: the debug model (4 layers, so two pipeline ranks hold two
# virtual stages each), synthetic data, 8 sequences a step, nothing written but metrics.
BASE = [
    "model=debug",
    "data=synthetic",
    "data.seq_len=16",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=1",
    "trainer.progress_bar=false",
    "trainer.sample_tokens=0",
    "trainer.log_interval=1",
    "trainer.eval_interval=0",
    "logging.tensorboard=false",
    "logging.loss_plot=false",
    "checkpoint.save_final=false",
    "optimizer=sgd",  # no Adam normalisation to hide a wrongly scaled gradient
    "optimizer.clip_grad_norm=0",
]

# A Llama of transformers' own, inline (no directory): model=hf's smallest dense model.
HF_MODEL = [
    "model=hf",
    "+model.config={model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 4,"
    " num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256, max_position_embeddings: 64}",
]

# Degree settings: a value's overrides set its degree; the world is their product.
DEGREES = ("dp_shard", "dp_replicate", "tp", "cp", "pp")

DIMENSIONS: Dict[str, Dict[str, List[str]]] = {
    "dp_shard": {"1": [], "2": ["parallelism.dp_shard=2"]},
    "dp_replicate": {"1": [], "2": ["parallelism.dp_replicate=2"]},
    "tp": {"1": [], "2": ["parallelism.tp=2"]},
    "sp": {"off": [], "on": ["parallelism.tp=2", "parallelism.sequence_parallel=true"]},
    "cp": {"1": [], "2": ["parallelism.cp=2"]},
    "pp": {
        "none": [],
        **{
            s: ["parallelism.pp=2", f"parallelism.pp_schedule={s}"]
            for s in ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
        },
    },
    "engine": {"native": [], "torch": ["parallelism.engine=torch"]},
    "float8": {"off": [], "on": ["parallelism.float8=true"]},
    "lora": {"off": [], "on": ["peft.lora.enabled=true"]},
    "optimizer": {"sgd": [], "muon": ["optimizer=muon", "optimizer.clip_grad_norm=0"]},
    "ac": {"none": [], "full": ["parallelism.activation_checkpointing=full"]},
    "model": {"ours": ["model.args.n_layers=4"], "hf": HF_MODEL},
    "stage": {
        "training": [],
        "sft": ["stage=fine_tuning", "finetune.train_file={data}/sft.jsonl", "finetune.tokenizer={data}/tok.json"],
        "dpo": ["stage=dpo", "data=hf", "data.paths=[{data}/pairs.jsonl]", "finetune.tokenizer={data}/tok.json"],
        "grpo": [
            "stage=grpo",
            "data=hf",
            "data.paths=[{data}/prompts.jsonl]",
            "finetune.tokenizer={data}/tok.json",
            "grpo.num_generations=4",
            "grpo.max_new_tokens=4",
        ],
    },
}

# A value that sets another dimension's value: `sp=on` is tensor parallel's, so (sp=on, tp=1)
# names no job and is not a pair.
IMPLIES = {("sp", "on"): ("tp", "2")}

Value = Tuple[str, str]  # (dimension, value)
Pair = Tuple[Value, Value]


def degrees_of(values: Dict[str, str]) -> Dict[str, int]:
    """The parallel degrees a set of values gives (1 where not set)."""
    out = {d: 1 for d in DEGREES}
    for dim, value in values.items():
        if dim in ("dp_shard", "dp_replicate", "tp", "cp"):
            out[dim] = int(value)
        elif dim == "pp" and value != "none":
            out["pp"] = 2
        elif dim == "sp" and value == "on":
            out["tp"] = 2
    return out


def full_values(values: Dict[str, str]) -> Dict[str, str]:
    """Every dimension's value: those given, those they imply, the defaults for the rest."""
    out = {dim: next(iter(vals)) for dim, vals in DIMENSIONS.items()}
    out.update(values)
    for (dim, value), (other, implied) in IMPLIES.items():
        if out[dim] == value:
            out[other] = implied
    return out


def overrides_of(values: Dict[str, str], data_dir: str = "/nonexistent") -> Tuple[List[str], int]:
    """`main.py`'s overrides for `values` and the world size (ranks) they need."""
    full = full_values(values)
    world = 1
    for d in degrees_of(full).values():
        world *= d
    args = list(BASE) + [f"cluster.nproc_per_node={world}"]
    for dim, value in full.items():
        args += [a.replace("{data}", data_dir) for a in DIMENSIONS[dim][value]]
    if full["dp_shard"] == "1":
        args.append("parallelism.dp_shard=1")
    return args, world


def pairs_of(values: Dict[str, str]) -> Iterator[Pair]:
    full = full_values(values)
    for a, b in itertools.combinations(sorted(full.items()), 2):
        yield (a, b)


def all_pairs() -> List[Pair]:
    """Every pair of values of two dimensions that names a job (none contradicts what the other
    implies)."""
    out = []
    items = sorted((dim, value) for dim, vals in DIMENSIONS.items() for value in vals)
    for a, b in itertools.combinations(items, 2):
        if a[0] == b[0]:
            continue
        full = full_values(dict([a, b]))
        if full[a[0]] != a[1] or full[b[0]] != b[1]:
            continue  # one implies the other's other value
        out.append((a, b))
    return out


def is_default(v: Value) -> bool:
    return v[1] == next(iter(DIMENSIONS[v[0]]))


# ---- validation, without starting ranks ----------------------------------------------------


class Validator:
    """`main.py`'s checks before any rank starts, on many configs: one Hydra initialisation, a
    compose per config (framework/entrypoint.py's `start`, less the run directory and preflight's
    network and task-file checks, which are not about composition)."""

    def __init__(self) -> None:
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        from framework.config.compose import CONF_DIR
        from framework.config.store import register

        register()
        GlobalHydra.instance().clear()
        self._ctx = initialize_config_dir(config_dir=CONF_DIR, version_base="1.3")
        self._ctx.__enter__()

    def close(self) -> None:
        self._ctx.__exit__(None, None, None)

    def problems(self, overrides: List[str], world: int) -> List[str]:
        from hydra import compose

        from framework.config.compose import to_config
        from framework.config.validate import validate
        from framework.errors import UserInputError
        from framework.models.checks import check_model
        from framework.models.families import job_model_problems

        try:
            cfg = to_config(compose(config_name="config", overrides=overrides))
        except UserInputError as exc:
            return [str(exc)]
        found = validate(cfg, world) + job_model_problems(cfg)
        return found + [p for p in check_model(cfg.model) if p not in found]


def write_data(root: str) -> None:
    """The files the stages' values name (a tokenizer, SFT, DPO and GRPO records): real ones, so
    validation finds them and the opt-in cases can run."""
    from framework.data.tokenizer import EOD, train_bpe

    os.makedirs(root, exist_ok=True)
    texts = [f"Q: what is {i} plus {j}? A: {i + j}{EOD}" for i in range(10) for j in range(10)]
    train_bpe(texts, 256, os.path.join(root, "tok.json"))
    with open(os.path.join(root, "sft.jsonl"), "w") as sft, open(os.path.join(root, "pairs.jsonl"), "w") as dpo:
        with open(os.path.join(root, "prompts.jsonl"), "w") as grpo:
            for i in range(10):
                for j in range(4):
                    prompt = f"Q: what is {i} plus {j}? A:"
                    sft.write(json.dumps({"prompt": prompt, "response": f" {i + j}"}) + "\n")
                    dpo.write(json.dumps({"prompt": prompt, "chosen": f" {i + j}", "rejected": f" {i + j + 1}"}) + "\n")
                    grpo.write(json.dumps({"prompt": prompt, "answer": str(i + j)}) + "\n")


def refusals(validator: Validator, data_dir: str) -> Dict[Tuple[Value, ...], List[str]]:
    """Validation's refusals of each non-default value alone and each pair of non-default values
    (a pair with a default value is the other value alone): {(value,) or (a, b): problems}."""
    out: Dict[Tuple[Value, ...], List[str]] = {}
    singles = sorted((dim, v) for dim, vals in DIMENSIONS.items() for v in vals if not is_default((dim, v)))
    for value in singles:
        found = validator.problems(*overrides_of(dict([value]), data_dir))
        if found:
            out[(value,)] = found
    for a, b in all_pairs():
        if is_default(a) or is_default(b) or (a,) in out or (b,) in out:
            continue
        found = validator.problems(*overrides_of(dict([a, b]), data_dir))
        if found:
            out[(a, b)] = found
    return out


# ---- the cases -------------------------------------------------------------------------------


@dataclass
class Case:
    """One job of the matrix: its values, what it must equal, how closely and why."""

    name: str
    values: Dict[str, str]
    reference: str  # "one process": the same job on 1 rank, same global batch; or another case's name
    tolerance: float  # on the losses and grad norms of 5 steps, relative
    why: str  # the tolerance's reason
    quick: bool = False  # run by default; the rest with COMPOSITION_ALL=1
    extra: List[str] = field(default_factory=list)


FP32 = "fp32 with the same arithmetic, summed in another order across ranks"
F8 = "float8 is emulated (scales, rounding) per rank's piece; the one process rounds whole tensors"

CASES: List[Case] = []


def case(name: str, reference: str = "one process", tolerance: float = 1e-5, why: str = FP32, quick=False, **values):
    CASES.append(Case(name, {k: str(v) for k, v in values.items()}, reference, tolerance, why, quick))


def covered(cases: List[Case]) -> set:
    return {p for c in cases for p in pairs_of(c.values)}


def by_name(name: str) -> Optional[Case]:
    return next((c for c in CASES if c.name == name), None)


# The covering set (25 cases over 406 allowed pairs; test_composition.py checks the cover). Quick
# ones: two ranks, pre-training or SFT, a few seconds each.
case("ac", quick=True, ac="full")
case("tp pp/1f1b", quick=True, tp=2, pp="1f1b")
case("tp pp/gpipe", tp=2, pp="gpipe")
case("tp pp/interleaved", tp=2, pp="interleaved_1f1b")
case(
    "dp_shard torch float8 cp sft",
    tolerance=1e-3,
    why=F8,
    dp_shard=2,
    cp=2,
    engine="torch",
    float8="on",
    ac="full",
    stage="sft",
)
case(
    "hsdp torch lora hf dpo", dp_shard=2, dp_replicate=2, engine="torch", lora="on", ac="full", model="hf", stage="dpo"
)
case(
    "hsdp float8 muon hf grpo",
    tolerance=1e-3,
    why=F8,
    dp_shard=2,
    dp_replicate=2,
    float8="on",
    optimizer="muon",
    ac="full",
    model="hf",
    stage="grpo",
)
case(
    "pp/1f1b float8 muon hf",
    tolerance=1e-3,
    why=F8,
    dp_shard=2,
    pp="1f1b",
    float8="on",
    optimizer="muon",
    ac="full",
    model="hf",
)
case(
    "pp/gpipe hsdp float8 muon sft",
    tolerance=1e-3,
    why=F8,
    dp_replicate=2,
    pp="gpipe",
    float8="on",
    optimizer="muon",
    ac="full",
    stage="sft",
)
case(
    "pp/interleaved replicate lora muon", dp_replicate=2, pp="interleaved_1f1b", lora="on", optimizer="muon", ac="full"
)
case("pp/zbv tp hf sft", tp=2, pp="zbv", ac="full", model="hf", stage="sft")
case("tp sp torch dpo", dp_shard=2, tp=2, sp="on", engine="torch", ac="full", stage="dpo")
case("tp sp torch hf", quick=True, tp=2, sp="on", engine="torch", model="hf")
case("cp lora muon sft", quick=True, cp=2, lora="on", optimizer="muon", stage="sft")
case("hsdp float8 dpo", tolerance=1e-3, why=F8, dp_shard=2, dp_replicate=2, float8="on", stage="dpo")
case("pp/1f1b replicate lora sft", dp_replicate=2, pp="1f1b", lora="on", stage="sft")
case("pp/gpipe lora hf", dp_shard=2, pp="gpipe", lora="on", model="hf")
case(
    "pp/interleaved float8 hf sft",
    tolerance=1e-3,
    why=F8,
    dp_shard=2,
    pp="interleaved_1f1b",
    float8="on",
    model="hf",
    stage="sft",
)
case("pp/zbv float8 muon", tolerance=1e-3, why=F8, dp_shard=2, pp="zbv", float8="on", optimizer="muon")
case("tp torch grpo", quick=True, tp=2, engine="torch", stage="grpo")
case("tp sp cp muon", tp=2, sp="on", cp=2, optimizer="muon")
case("pp/zbv replicate lora", dp_replicate=2, pp="zbv", lora="on")
case("replicate tp sp sft", dp_replicate=2, tp=2, sp="on", stage="sft")
case("tp muon dpo", quick=True, tp=2, optimizer="muon", stage="dpo")
case("lora grpo", dp_shard=2, lora="on", stage="grpo")


def one_process(values: Dict[str, str]) -> Dict[str, str]:
    """The same job on one rank: every degree 1, the rest as given."""
    out = {k: v for k, v in values.items() if k not in ("dp_shard", "dp_replicate", "tp", "sp", "cp", "pp")}
    return out
