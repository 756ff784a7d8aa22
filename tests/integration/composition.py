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
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

# A job every value composes onto: the debug model (4 layers, so two pipeline ranks hold two
# virtual stages each), synthetic data, 8 sequences a step, nothing written but metrics.
BASE = [
    "model=debug",
    "data=synthetic",
    "data.seq_len=32",
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
        "dpo": [
            "stage=dpo",
            "data=hf",
            "data.paths=[{data}/pairs.jsonl]",
            "data.hf.valid_documents=4",
            "finetune.tokenizer={data}/tok.json",
        ],
        "grpo": [
            "stage=grpo",
            "data=hf",
            "data.paths=[{data}/prompts.jsonl]",
            "data.hf.valid_documents=4",
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
    if full["stage"] == "sft" and full["model"] == "hf":
        args.append("finetune.packing=false")  # packed rows need per-document positions (our Llama's)
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
    network and task-file checks, which are not about composition).

    Hydra composes the defaults tree again for every config (~0.2 s on a loaded 2-core machine; a
    few hundred configs here). The configs differ mostly in values: Hydra composes once per choice
    of config groups and additions (`model=hf`, `+model.config=...`), and the values are set on a
    copy as Hydra sets them after its composition (`OmegaConf.update(..., merge=True)`, in order).
    `same_as_hydra` composes a config both ways (tests/integration/test_composition.py checks it)."""

    def __init__(self) -> None:
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from framework.config.compose import CONF_DIR
        from framework.config.store import register

        register()
        GlobalHydra.instance().clear()
        self._ctx = initialize_config_dir(config_dir=CONF_DIR, version_base="1.3")
        self._ctx.__enter__()
        self._groups = {name for name in os.listdir(CONF_DIR) if os.path.isdir(os.path.join(CONF_DIR, name))}
        self._parser = OverridesParser.create()
        self._bases: Dict[Tuple[str, ...], Any] = {}

    def close(self) -> None:
        self._ctx.__exit__(None, None, None)

    def _structural(self, override: str) -> bool:
        key = override.split("=", 1)[0]
        return key.startswith(("+", "~")) or key in self._groups

    def compose(self, overrides: List[str]):
        """The config Hydra composes from `overrides` (raises what Hydra raises)."""
        import copy

        from hydra import compose
        from omegaconf import OmegaConf

        structure = tuple(o for o in overrides if self._structural(o))
        if structure not in self._bases:
            self._bases[structure] = compose(config_name="config", overrides=list(structure))
        cfg = copy.deepcopy(self._bases[structure])
        for override in self._parser.parse_overrides([o for o in overrides if not self._structural(o)]):
            OmegaConf.update(cfg, override.key_or_group, override.value(), merge=True)
        return cfg

    def same_as_hydra(self, overrides: List[str]) -> bool:
        from hydra import compose
        from omegaconf import OmegaConf

        ours = OmegaConf.to_container(self.compose(overrides))
        return ours == OmegaConf.to_container(compose(config_name="config", overrides=overrides))

    def problems(self, overrides: List[str], world: int) -> List[str]:
        from framework.config.compose import to_config
        from framework.config.validate import validate
        from framework.errors import UserInputError
        from framework.models.checks import check_model
        from framework.models.families import job_model_problems

        try:
            cfg = to_config(self.compose(overrides))
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


# ---- refusals in the code, and docs/engine.md's table ------------------------------------

# The setting each dimension is, as refusal messages name it.
FIELDS = {
    "dp_shard": "parallelism.dp_shard",
    "dp_replicate": "parallelism.dp_replicate",
    "tp": "parallelism.tp",
    "sp": "parallelism.sequence_parallel",
    "cp": "parallelism.cp",
    "pp": "parallelism.pp",
    "engine": "parallelism.engine",
    "float8": "parallelism.float8",
    "lora": "peft.lora.enabled",
    "optimizer": "optimizer",
    "ac": "parallelism.activation_checkpointing",
    "model": "model",
    "stage": "stage",
}

# Where combinations are refused: the config's checks, the model families' arguments, the Hugging
# Face builder, the pipeline's cut (some of these refuse in the ranks, after the build).
REFUSING = (
    "framework/config/*.py",
    "framework/models/*/args.py",
    "framework/models/hf/*.py",
    "framework/distributed/pipeline.py",
)
HEAD = re.compile(r"^([\w.{}]+)=\S* with ([\w.{}]+)")


def code_refusals(repo: str) -> List[Tuple[str, str, str, str]]:
    """Every message in REFUSING's files that names two settings (`a=... with b...: why`): [(file,
    a, b, message)]. Placeholders read `{}`; a message passed to `_advise` (a warning) is left out."""
    import ast
    import glob

    out = []
    for pattern in REFUSING:
        for path in sorted(glob.glob(os.path.join(repo, pattern))):
            tree = ast.parse(open(path).read())
            advice = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_advise":
                    advice |= {id(n) for arg in node.args for n in ast.walk(arg)}
            for node in ast.walk(tree):
                if id(node) in advice:
                    continue
                if isinstance(node, ast.JoinedStr):
                    text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    text = node.value
                else:
                    continue
                m = HEAD.match(text)
                if m and ":" in text:
                    out.append((os.path.relpath(path, repo), m.group(1), m.group(2), text))
    return out


@dataclass
class Row:
    """A row of docs/engine.md's composition table: two settings (`field` or `field=value`, a
    matrix value's name), when the pair is refused (`always`, or the condition) and why."""

    a: str
    b: str
    when: str
    why: str

    def names(self, v: Value) -> Optional[bool]:
        """Whether one of this row's cells names the matrix value `v`."""
        return any(_cell_names(cell, v) for cell in (self.a, self.b))

    def refuses(self, key: Tuple[Value, ...]) -> bool:
        """Whether this row (an `always` one) names the pair (or value) `key`."""
        if self.when != "always":
            return False
        if len(key) == 1:
            return self.b in ("", "-") and _cell_names(self.a, key[0])
        x, y = key
        return (_cell_names(self.a, x) and _cell_names(self.b, y)) or (
            _cell_names(self.a, y) and _cell_names(self.b, x)
        )

    def lists(self, a: str, b: str) -> bool:
        """Whether this row lists a code refusal between fields `a` and `b` (`{}` matches any)."""
        fields = {self.a.split("=")[0], self.b.split("=")[0]}
        return all(any(_field_matches(f, g) for g in fields) for f in (a, b))


def _field_matches(pattern: str, field_name: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\{\}", r"[\w.]+"), field_name) is not None


def _cell_names(cell: str, v: Value) -> bool:
    name, _, value = cell.partition("=")
    return name == FIELDS[v[0]] and (value == v[1] or (value == "" and not is_default(v)))


def doc_rows(repo: str) -> List[Row]:
    """docs/engine.md's composition table (after `<!-- composition table -->`)."""
    text = open(os.path.join(repo, "docs", "engine.md")).read()
    lines = text[text.index("<!-- composition table -->") :].splitlines()[1:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if cells[0] == "setting" or set(cells[0]) <= {"-", " "}:
            continue
        rows.append(Row(*[c.strip("`") for c in cells[:4]]))
    return rows


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
    known: str = ""  # a failure this case found that is not fixed yet: the run is an expected failure
    extra: List[str] = field(default_factory=list)


FP32 = "fp32 with the same arithmetic, summed in another order across ranks"
# Measured (COMPOSITION_ALL=1): grad norms 2.6e-5 (dp_shard sp muon dpo) to 1.2e-4 (pp/gpipe muon hf)
# apart from one process by step 3-4, after equal first steps.
MUON = (
    "Muon orthogonalizes in bfloat16 (torch.optim.Muon's arithmetic): a gradient summed in another order "
    "can round to the neighbouring bfloat16 value (2^-8 relative), which the next steps carry"
)
# Measured: the first step's grad norm 1.2e-3 apart (pp/gpipe replicate float8), 5e-3 by step 2
# with Muon (pp/1f1b float8 muon hf).
F8 = (
    "float8 (e4m3, 3 mantissa bits: a rounding that flips moves an element by up to 6%) emulated on the "
    "CPU, its scales and roundings taken per microbatch and piece as the layout cuts them"
)

CASES: List[Case] = []


def case(name: str, *, reference="one process", tolerance=1e-5, why=FP32, quick=False, known="", **values):
    CASES.append(Case(name, {k: str(v) for k, v in values.items()}, reference, tolerance, why, quick, known))


def covered(cases: List[Case]) -> set:
    return {p for c in cases for p in pairs_of(c.values)}


def by_name(name: str) -> Optional[Case]:
    return next((c for c in CASES if c.name == name), None)


# The covering set (test_composition.py checks the cover): 26 cases found greedily, 7 added at the
# end for pairs allowed since. A one-rank case's reference is the same job on two sharded ranks. Quick: a few seconds
# each, run by default; the rest with COMPOSITION_ALL=1.
TWO = "two sharded ranks"
case("ac", reference=TWO, quick=True, ac="full")
case(
    "hsdp torch float8 hf sft",
    tolerance=1e-2,
    why=F8,
    dp_shard=2,
    dp_replicate=2,
    engine="torch",
    float8="on",
    model="hf",
    stage="sft",
)
case("dp_shard sp muon dpo", tolerance=1e-3, why=MUON, dp_shard=2, sp="on", optimizer="muon", stage="dpo")
case(
    "replicate lora muon hf grpo",
    tolerance=1e-3,
    why=MUON,
    dp_replicate=2,
    lora="on",
    optimizer="muon",
    model="hf",
    stage="grpo",
)
case(
    "sp cp torch sft",
    sp="on",
    cp=2,
    engine="torch",
    ac="full",
    stage="sft",
)
case(
    "pp/1f1b float8 muon hf",
    tolerance=1e-2,
    why=F8,
    dp_shard=2,
    pp="1f1b",
    float8="on",
    optimizer="muon",
    ac="full",
    model="hf",
)
case("pp/gpipe replicate float8", tolerance=1e-2, why=F8, dp_replicate=2, pp="gpipe", float8="on", ac="full")
case("pp/interleaved tp hf", tp=2, pp="interleaved_1f1b", model="hf")
case("cp torch lora", dp_shard=2, cp=2, engine="torch", lora="on", ac="full")
case("pp/zbv ac", pp="zbv", ac="full")
case(
    "replicate torch float8 hf dpo",
    tolerance=1e-2,
    why=F8,
    dp_replicate=2,
    engine="torch",
    float8="on",
    ac="full",
    model="hf",
    stage="dpo",
)
case("tp torch grpo", dp_shard=2, tp=2, engine="torch", ac="full", stage="grpo")
case(
    "pp/interleaved float8 muon",
    tolerance=1e-2,
    why=F8,
    dp_shard=2,
    pp="interleaved_1f1b",
    float8="on",
    optimizer="muon",
    ac="full",
)
case("cp float8 muon sft", tolerance=1e-2, why=F8, cp=2, float8="on", optimizer="muon", stage="sft")
case("pp/1f1b replicate", dp_replicate=2, pp="1f1b")
case("pp/gpipe muon hf", tolerance=1e-3, why=MUON, dp_shard=2, pp="gpipe", optimizer="muon", model="hf")
case(
    "pp/zbv float8 muon hf",
    tolerance=1e-2,
    why=F8,
    dp_shard=2,
    pp="zbv",
    float8="on",
    optimizer="muon",
    model="hf",
)
case("replicate sp", dp_replicate=2, sp="on")
case("pp/interleaved replicate", dp_replicate=2, pp="interleaved_1f1b")
case("pp/zbv replicate", dp_replicate=2, pp="zbv")
case("float8 grpo", reference=TWO, tolerance=1e-2, why=F8, float8="on", stage="grpo")
case("lora dpo", reference=TWO, lora="on", stage="dpo")
case("lora sft", reference=TWO, quick=True, lora="on", stage="sft")
case("tp pp/1f1b", quick=True, tp=2, pp="1f1b")
case("tp pp/gpipe", tp=2, pp="gpipe")
case("tp pp/zbv", tp=2, pp="zbv")


def one_process(values: Dict[str, str]) -> Dict[str, str]:
    """The same job on one rank: every degree 1, the rest as given."""
    return {k: v for k, v in values.items() if k not in ("dp_shard", "dp_replicate", "tp", "sp", "cp", "pp")}


def reference_values(c: Case) -> Dict[str, str]:
    """The values of `c`'s reference job."""
    if c.reference == "one process":
        return one_process(c.values)
    if c.reference == TWO:
        return {**c.values, "dp_shard": "2"}
    return dict(by_name(c.reference).values)


def allowed_pairs(validation: Dict[Tuple[Value, ...], List[str]], rows: List[Row]) -> List[Pair]:
    """The pairs neither validation nor an `always` row of the table refuses (a row stands for the
    refusals made in the ranks, which validation does not see)."""

    def refused(key) -> bool:
        return key in validation or any(r.refuses(key) for r in rows)

    out = []
    for a, b in all_pairs():
        if not any(refused(k) for k in ((a,), (b,), (a, b), (b, a))):
            out.append((a, b))
    return out


# Pairs allowed since the cover above was found: context parallel with hybrid sharding, float8 and
# LoRA with tensor/sequence parallel and with each other, LoRA in each pipeline schedule.
case("replicate cp", dp_replicate=2, cp=2)
case("tp float8 lora", tolerance=1e-2, why=F8, tp=2, float8="on", lora="on")
case("sp float8 lora", tolerance=1e-2, why=F8, sp="on", float8="on", lora="on")
case("lora sft pp/1f1b", lora="on", stage="sft", pp="1f1b")
case("lora sft pp/gpipe", lora="on", stage="sft", pp="gpipe")
case("lora sft pp/interleaved_1f1b", lora="on", stage="sft", pp="interleaved_1f1b")
case("lora sft pp/zbv", lora="on", stage="sft", pp="zbv")
# Sequence parallel with model=hf (the decoder layers' stream cut on the sequence), with the
# blocks recomputed in backward.
case("dp_shard sp hf", dp_shard=2, sp="on", ac="full", model="hf")

# Pairs allowed since: preference optimization in each pipeline schedule (the reference's own
# stages; LoRA's base, the policy's stages with the adapters off; vocabulary-sharded logits on the
# last stage under tensor parallel; zbv's reference passes running the stages in turn).
case("dpo pp/1f1b lora", lora="on", stage="dpo", pp="1f1b")
case("dpo pp/gpipe replicate", dp_replicate=2, stage="dpo", pp="gpipe")
case("dpo tp pp/interleaved_1f1b", tp=2, stage="dpo", pp="interleaved_1f1b")
case("dpo pp/zbv ac", ac="full", stage="dpo", pp="zbv")
# GRPO through the stages: the rollouts decoded through every stage in turn, the policy's and the
# reference's log-probabilities and the loss through the schedule ([Note: GRPO through a pipeline]).
case("grpo pp/1f1b", stage="grpo", pp="1f1b")
case("grpo tp pp/gpipe lora", tp=2, lora="on", stage="grpo", pp="gpipe")
case("grpo pp/interleaved_1f1b replicate", dp_replicate=2, stage="grpo", pp="interleaved_1f1b")
case("grpo pp/zbv ac", ac="full", stage="grpo", pp="zbv")
# Context parallel with transformers' own Llama (framework/models/hf/context.py).
case("cp hf", dp_shard=2, cp=2, model="hf")

# Pairs allowed since: the preference and reward stages with context parallelism (each rank's
# chunk of every sequence, the sequences' sums added over the cp ranks), and both stages on tensor
# x sharded data parallelism with our engine (4 ranks).
case("cp dpo", cp=2, stage="dpo")
case("cp dp_shard grpo", dp_shard=2, cp=2, stage="grpo")
case("tp dp_shard dpo", dp_shard=2, tp=2, stage="dpo")
case("tp dp_shard grpo", dp_shard=2, tp=2, stage="grpo")

# Pipelines under torch's fully_shard (parallelism.engine=torch), each schedule once.
case("torch pp/1f1b", engine="torch", dp_shard=2, pp="1f1b")
case("torch tp pp/gpipe", engine="torch", tp=2, pp="gpipe")
case("torch pp/interleaved hf", engine="torch", pp="interleaved_1f1b", model="hf")
case("torch pp/zbv ac", engine="torch", pp="zbv", ac="full")

# Sequence parallel inside pipeline stages, each schedule once.
case("sp pp/1f1b", sp="on", pp="1f1b")
case("sp pp/gpipe ac", sp="on", pp="gpipe", ac="full")
case("sp torch pp/interleaved", sp="on", engine="torch", pp="interleaved_1f1b")
case("sp pp/zbv", sp="on", pp="zbv")
