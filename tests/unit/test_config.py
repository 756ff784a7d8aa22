"""Config composition and validation, in-process through Hydra's compose()."""

import dataclasses
import os

import pytest
from hydra.errors import ConfigCompositionException

from framework.config import compose_config, to_config, validate
from framework.config.compose import CONF_DIR
from framework.config.schema import Config, Engine, Strategy
from framework.errors import UserInputError
from framework.models.families import job_model_problems


def cfg_of(*overrides):
    return to_config(compose_config(list(overrides)))


def test_default_composition_is_the_main_job():
    cfg = cfg_of()
    assert cfg.model.name == "small" and cfg.data.name.value == "stdlib"
    assert cfg.parallelism.engine == Engine.native and cfg.parallelism.strategy == Strategy.full
    assert cfg.cluster.nproc_per_node == 2
    assert validate(cfg, world_size=2) == []


def test_groups_and_overrides_compose():
    cfg = cfg_of(
        "model=llama_7b", "parallelism=hybrid", "optimizer=sgd", "trainer.max_steps=7", "parallelism.engine=torch"
    )
    args = cfg.model.args
    assert (args["dim"], args["n_layers"], args["ffn_dim"]) == (4096, 32, 11008)
    assert cfg.optimizer.name.value == "sgd" and cfg.trainer.max_steps == 7
    assert cfg.parallelism.engine == "torch"  # str enums compare equal to their values


def test_experiment_recipe_overrides_groups():
    cfg = cfg_of("experiment=llama_7b_hybrid", "data.paths=[/nonexistent/x]")
    assert cfg.model.name == "llama_7b" and cfg.parallelism.strategy == Strategy.hybrid
    assert cfg.cluster.nodes == 4 and cfg.parallelism.activation_checkpointing.value == "full"


def test_typo_is_refused_at_composition():
    with pytest.raises(ConfigCompositionException, match="lrr"):
        compose_config(["optimizer.lrr=1"])


def test_wrong_type_is_refused_at_composition():
    with pytest.raises(ConfigCompositionException):
        compose_config(["trainer.max_steps=many"])


def test_unknown_engine_is_refused():
    with pytest.raises(ConfigCompositionException):
        compose_config(["parallelism.engine=deepspeed"])


@pytest.mark.parametrize(
    "overrides, world, needle",
    [
        (["parallelism.dp_shard=3"], 2, "must equal the world size (2)"),
        (
            ["model=debug", "parallelism.tp=3", "parallelism.dp_shard=1"],
            3,
            "model.args.n_heads=4 is not divisible by parallelism.tp=3",
        ),
        (
            ["trainer.global_batch_size=6", "trainer.micro_batch_size=4"],
            2,
            "trainer.global_batch_size=6 is not divisible",
        ),
        (["model=debug", "data.seq_len=4096"], 2, "data.seq_len=4096 is longer than model.args.max_seq_len=1024"),
        (["checkpoint.resume=/no/such/ckpt"], 2, "checkpoint.resume=/no/such/ckpt: no such checkpoint"),
        (["parallelism.strategy=hybrid", "parallelism.dp_replicate=1"], 2, "hybrid needs dp_replicate > 1"),
    ],
)
def test_cross_field_problems_name_the_field(overrides, world, needle):
    from framework.models.families import job_model_problems  # the model's arguments, checked by its family

    cfg = cfg_of(*overrides)
    problems = validate(cfg, world_size=world) + job_model_problems(cfg)
    assert any(needle in p for p in problems), problems


@pytest.mark.parametrize(
    "override, needle",
    [
        ("optimizer.lr=0", "optimizer.lr=0.0: must be > 0"),
        ("trainer.micro_batch_size=-1", "trainer.micro_batch_size=-1: must be > 0"),
        ("parallelism.param_dtype=float8", "parallelism.param_dtype='float8'"),
        ("trainer.collective_timeout_s=inf", "trainer.collective_timeout_s=inf: must be > 0 and finite"),
        # Hydra lets '+' add a key a structured config lacks; the job would silently ignore it.
        (
            "+optimizer.lrr=1",
            "optimizer.lrr: no such setting (a '+' adds keys the job would ignore); did you mean optimizer.lr?",
        ),
        ("+trainer.max_step=3", "did you mean trainer.max_steps?"),
    ],
)
def test_section_checks_raise_user_input_error(override, needle):
    with pytest.raises(UserInputError) as info:
        cfg_of(override)
    assert needle in str(info.value)


def test_shard_boundary_is_the_native_engines():
    """torch's fully_shard cuts every parameter on dim 0: a boundary policy with it is refused by name."""
    assert cfg_of("parallelism.shard_boundary=params").parallelism.shard_boundary.value == "params"
    with pytest.raises(UserInputError) as info:
        cfg_of("parallelism.engine=torch", "parallelism.shard_boundary=rows")
    assert "parallelism.shard_boundary=rows is a feature of the native engine" in str(info.value)


def test_degrees_are_inferred_per_strategy():
    from framework.config import parallel_dims_of

    assert vars(parallel_dims_of(cfg_of("parallelism.tp=2"), 8)) == dict(
        dp_replicate=1, dp_shard=4, tp=2, world_size=8, ep=1, cp=1, pp=1
    )
    experts = parallel_dims_of(cfg_of("parallelism.ep=2"), 8)
    assert (experts.dp_shard, experts.ep, experts.efsdp) == (8, 2, 4)
    hybrid = parallel_dims_of(cfg_of("parallelism=hybrid", "cluster.nproc_per_node=4"), 8)
    assert (hybrid.dp_replicate, hybrid.dp_shard) == (2, 4)
    none = parallel_dims_of(cfg_of("parallelism.strategy=no_shard"), 4)
    assert (none.dp_replicate, none.dp_shard) == (4, 1)


def test_data_preparation_is_checked_for_its_own_inputs_only(tmp_path):
    (tmp_path / "raw").mkdir()
    prefix = str(tmp_path / "out" / "corpus")
    # The files training will read do not exist yet: this stage is what creates them.
    cfg = cfg_of(
        "stage=data_preparation",
        "data=indexed",
        f"data.paths=[{prefix}]",
        f"data.raw_inputs=[{tmp_path / 'raw'}]",
        f"data.output_prefix={prefix}",
    )
    assert validate(cfg, world_size=2) == []
    training = cfg_of("data=indexed", f"data.paths=[{prefix}]", "model=debug", "data.seq_len=64")
    assert validate(training, world_size=2) == [
        f"data.paths: {prefix}.idx does not exist; prepare it with stage=data_preparation"
    ]
    missing = validate(cfg_of("stage=data_preparation"), world_size=2)
    assert [p.split(" needs ")[1].split(" ")[0] for p in missing] == ["data.raw_inputs", "data.output_prefix"]


# [Note: one source per default]
# Every default lives in the dataclasses of framework/config/schema.py. A group option (a YAML file
# under conf/<group>/) holds only what that choice changes; the options the main job selects by
# default change nothing but the data set. So `Config()` (a test's, a benchmark's) is the command
# line's job, up to the model preset and the data set the main job picks. Model presets (and
# experiments) are exempt: a preset is a published shape, written out whole.
_PRESET_GROUPS = ("model", "experiment")
# groups whose options land in another section (`# @package logging`): logger=[tensorboard,wandb]
_PACKAGED = {"logger": "logging"}


def _option_keys(group: str, option: str) -> set:
    from omegaconf import OmegaConf

    node = OmegaConf.load(os.path.join(CONF_DIR, group, f"{option}.yaml"))
    return set(node.keys()) if node else set()


def _default_options() -> dict:
    from omegaconf import OmegaConf

    options = {}
    for entry in OmegaConf.load(os.path.join(CONF_DIR, "config.yaml")).defaults:
        if not isinstance(entry, str) and len(entry) == 1:
            ((group, option),) = entry.items()
            if "/" not in group and " " not in group and option is not None:
                options[group] = option
    return options


def test_the_default_composition_equals_the_dataclass_defaults():
    composed, defaults = cfg_of(), Config()
    options = _default_options()
    assert options["data"] == "stdlib" and options["trainer"] == "default"  # the parse found them
    for section in dataclasses.fields(Config):
        ours, theirs = getattr(composed, section.name), getattr(defaults, section.name)
        if not dataclasses.is_dataclass(ours):
            if section.name != "run_dir":
                assert ours == theirs, section.name
            continue
        if section.name in _PRESET_GROUPS:
            continue
        chosen = _option_keys(section.name, options[section.name]) if section.name in options else set()
        for group, target in _PACKAGED.items():
            if target == section.name:
                chosen |= {key for option in options[group] for key in _option_keys(group, option)}
        for f in dataclasses.fields(ours):
            if f.name not in chosen:
                assert getattr(ours, f.name) == getattr(theirs, f.name), f"{section.name}.{f.name}"
    # and the only section a default option changes is the data set
    assert (composed.data.name, composed.data.seq_len) == ("stdlib", 128)
    assert (defaults.data.name, defaults.data.seq_len) == ("synthetic", 64)


def test_group_options_set_only_what_they_change():
    """No option restates a dataclass default (its `name`, which says what it is, excepted)."""
    from omegaconf import OmegaConf

    defaults = Config()
    checked = 0
    for group in sorted(os.listdir(CONF_DIR)):
        folder = os.path.join(CONF_DIR, group)
        if group in _PRESET_GROUPS or not os.path.isdir(folder):
            continue
        section = getattr(defaults, _PACKAGED.get(group, group))
        for option in sorted(os.listdir(folder)):
            node = OmegaConf.load(os.path.join(folder, option)) or {}
            for key, value in OmegaConf.to_container(node).items() if node else []:
                if key != "name":
                    default = getattr(section, key)
                    if dataclasses.is_dataclass(default):  # a nested section: each key it sets
                        for inner, inner_value in value.items():
                            assert inner_value != getattr(default, inner), f"conf/{group}/{option}: {key}.{inner}"
                        continue
                    assert value != default, f"conf/{group}/{option}: {key}: {value} is the default"
                checked += 1
    assert checked >= 10  # the options were read


@pytest.mark.parametrize(
    "override, needle",
    [
        ("model.args.n_heads=5", "model.args.dim=192 is not divisible by model.args.n_heads=5"),
        ("model.args.n_layers=0", "model.args.n_layers=0: must be > 0"),
        ("model.args.dim=true", "model.args.dim=True: give an integer"),
        (
            "+model.args.width=3",
            "model.args.width: model.name=small has no such argument; its arguments are vocab_size",
        ),
    ],
)
def test_llama_arguments_are_checked_by_their_family(override, needle):
    """Our Llama's sizes are its own typed arguments (LlamaArgs), checked without torch."""
    from framework.models.families import job_model_problems

    problems = job_model_problems(cfg_of(override))
    assert len(problems) == 1 and needle in problems[0], problems


@pytest.mark.parametrize(
    "override, line",
    [
        ("parallelism.ep=3", "parallelism.ep=3 does not divide parallelism.dp_shard=4"),
        ("parallelism.ep=0", "parallelism.ep=0: must be a positive degree"),
        ("model=moe_debug parallelism.tp=2 model.args.moe_ffn_dim=49", "inner size 49 (model.args.moe_ffn_dim"),
        ("parallelism.ep=2", "parallelism.ep=2: model.name=small has no experts"),
        (
            "model=moe_debug parallelism.ep=4 model.args.n_experts=6",
            "parallelism.ep=4 does not divide model.args.n_experts=6",
        ),
        ("parallelism.cp=2 data.seq_len=129", "data.seq_len=129 is not divisible by parallelism.cp=2"),
        ("parallelism.cp=4 model.args.n_heads=6", "parallelism.cp=4 does not divide the 6 attention heads"),
        ("model=moe_debug parallelism.cp=2", "parallelism.cp=2 with model.args.aux_loss_scope=micro_batch"),
        (
            "model=moe_debug parallelism.cp=2 model.args.aux_loss_scope=global_batch model.args.capacity_factor=1.5",
            "parallelism.cp=2 with model.args.capacity_factor=1.5",
        ),
        ("model=hf +model.config={model_type:gpt2} parallelism.cp=2", "parallelism.cp=2 with model=hf model_type=gpt2"),
        (
            "model=hf +model.config={model_type:qwen2,num_attention_heads:6} parallelism.cp=4",
            "parallelism.cp=4 does not divide the 6 attention heads",
        ),
        (
            "model=hf model.path=/x parallelism.cp=2 data.seq_len=129",
            "data.seq_len=129 is not divisible by parallelism.cp=2",
        ),
    ],
)
def test_expert_and_context_parallel_degrees_are_checked_in_one_line(override, line):
    """4 ranks (2 per node for hybrid): each wrong degree is one line naming the field."""
    from framework.errors import UserInputError

    try:
        cfg = cfg_of(*override.split(), "cluster.nproc_per_node=2", "cluster.nodes=2")
    except UserInputError as exc:
        problems = [str(exc)]
    else:
        problems = validate(cfg, world_size=4) + job_model_problems(cfg)
    assert [p for p in problems if line in p], problems


@pytest.mark.parametrize(
    "override, line",
    [
        ("parallelism.float8_recipe=rowwize", "parallelism.float8_recipe='rowwize': choose tensorwise or rowwise"),
        (
            "parallelism.float8=true parallelism.float8_recipe=rowwise parallelism.float8_all_gather=true",
            "parallelism.float8_all_gather=true needs parallelism.float8_recipe=tensorwise",
        ),
        ("parallelism.float8_all_gather=true", "parallelism.float8_all_gather=true needs parallelism.float8=true"),
        ("parallelism.float8=true parallelism.quantized_comm=true", "the gather is float8 or int8, not both"),
        (
            "parallelism.float8=true parallelism.float8_all_gather=true parallelism.tp=2",
            "parallelism.float8_all_gather=true with parallelism.tp=2",
        ),
        (
            "parallelism.float8=true parallelism.float8_all_gather=true parallelism.cpu_offload=true",
            "offloaded shards are gathered in the param dtype",
        ),
    ],
)
def test_float8_settings_are_checked_in_one_line(override, line):
    try:
        cfg = cfg_of(*override.split())
    except UserInputError as exc:
        problems = [str(exc)]
    else:
        problems = validate(cfg, world_size=2)
    assert [p for p in problems if line in p], problems


@pytest.mark.parametrize("world, micro", [(1, 8), (2, 8), (4, 4), (8, 2), (16, 1)])
def test_a_null_micro_batch_fits_the_data_parallel_size(world, micro):
    """trainer.micro_batch_size=null (the default) takes the largest of 8, 4, 2, 1 dividing the
    16 samples each step has per rank: the default job runs on 1 to 16 ranks as it is."""
    cfg = cfg_of()
    assert cfg.trainer.micro_batch_size is None
    assert validate(cfg, world_size=world) == []
    assert cfg.trainer.micro_batch_size == micro
    explicit = cfg_of("trainer.micro_batch_size=8")
    assert validate(explicit, world_size=world) == (
        []
        if world <= 2
        else [
            f"trainer.global_batch_size=16 is not divisible by trainer.micro_batch_size (8) x data-parallel size "
            f"({world}) = {8 * world}; make it a multiple of {8 * world}"
        ]
    )


def test_generate_under_sequence_parallel_is_refused_before_any_rank_starts():
    # decoding feeds one token at a time, which sequence parallelism cannot cut over the tp ranks:
    # refused by the config's checks (main.py exits 2 with the line) before a model is built
    line = (
        "stage=generate with parallelism.sequence_parallel=true: decoding feeds one token at a time, which "
        "cannot be split over the tp ranks; set parallelism.sequence_parallel=false (tp stays)"
    )
    sp = ("parallelism.tp=2", "parallelism.sequence_parallel=true", "model=debug", "cluster.nproc_per_node=2")
    assert validate(cfg_of("stage=generate", *sp), world_size=2) == [line]
    assert validate(cfg_of("stage=generate", "parallelism.tp=2", "model=debug"), world_size=2) == []
