"""Config composition and validation, in-process through Hydra's compose()."""
import pytest
from hydra.errors import ConfigCompositionException

from framework.config import compose_config, to_config, validate
from framework.config.schema import Engine, Strategy


def cfg_of(*overrides):
    return to_config(compose_config(list(overrides)))


def test_default_composition_is_the_main_job():
    cfg = cfg_of()
    assert cfg.model.name == "small" and cfg.data.name.value == "stdlib"
    assert cfg.parallelism.engine == Engine.native and cfg.parallelism.strategy == Strategy.full
    assert cfg.cluster.nproc_per_node == 2
    assert validate(cfg, world_size=2) == []


def test_groups_and_overrides_compose():
    cfg = cfg_of("model=llama_7b", "parallelism=hybrid", "optimizer=sgd", "trainer.max_steps=7",
                 "parallelism.engine=torch")
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.ffn_dim) == (4096, 32, 11008)
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


@pytest.mark.parametrize("overrides, world, needle", [
    (["parallelism.dp_shard=3"], 2, "must equal the world size (2)"),
    (["model=debug", "parallelism.tp=3", "parallelism.dp_shard=1"], 3, "model.n_heads=4 is not divisible by parallelism.tp=3"),
    (["trainer.global_batch_size=6", "trainer.micro_batch_size=4"], 2, "trainer.global_batch_size=6 is not divisible"),
    (["model=debug", "data.seq_len=4096"], 2, "data.seq_len=4096 is longer than model.max_seq_len=128"),
    (["checkpoint.resume=/no/such/ckpt"], 2, "checkpoint.resume=/no/such/ckpt: no such checkpoint"),
    (["parallelism.strategy=hybrid", "parallelism.dp_replicate=1"], 2, "hybrid needs dp_replicate > 1"),
])
def test_cross_field_problems_name_the_field(overrides, world, needle):
    problems = validate(cfg_of(*overrides), world_size=world)
    assert any(needle in p for p in problems), problems


@pytest.mark.parametrize("override, needle", [
    ("optimizer.lr=0", "optimizer.lr=0.0: must be > 0"),
    ("trainer.micro_batch_size=-1", "trainer.micro_batch_size=-1: must be > 0"),
    ("model.n_heads=5", "model.dim=192 is not divisible by model.n_heads=5"),
    ("parallelism.param_dtype=float8", "parallelism.param_dtype='float8'"),
])
def test_section_checks_raise_value_error(override, needle):
    with pytest.raises(ValueError) as info:
        cfg_of(override)
    assert needle in str(info.value)


def test_degrees_are_inferred_per_strategy():
    from framework.config import parallel_dims_of

    assert vars(parallel_dims_of(cfg_of("parallelism.tp=2"), 8)) == dict(dp_replicate=1, dp_shard=4, tp=2, world_size=8)
    hybrid = parallel_dims_of(cfg_of("parallelism=hybrid", "cluster.nproc_per_node=4"), 8)
    assert (hybrid.dp_replicate, hybrid.dp_shard) == (2, 4)
    none = parallel_dims_of(cfg_of("parallelism.strategy=no_shard"), 4)
    assert (none.dp_replicate, none.dp_shard) == (4, 1)


def test_data_preparation_is_checked_for_its_own_inputs_only(tmp_path):
    (tmp_path / "raw").mkdir()
    prefix = str(tmp_path / "out" / "corpus")
    # The files training will read do not exist yet: this stage is what creates them.
    cfg = cfg_of("stage=data_preparation", "data=indexed", f"data.paths=[{prefix}]",
                 f"data.raw_inputs=[{tmp_path / 'raw'}]", f"data.output_prefix={prefix}")
    assert validate(cfg, world_size=2) == []
    training = cfg_of("data=indexed", f"data.paths=[{prefix}]", "model=debug", "data.seq_len=64")
    assert validate(training, world_size=2) == [
        f"data.paths: {prefix}.idx does not exist; prepare it with stage=data_preparation"]
    missing = validate(cfg_of("stage=data_preparation"), world_size=2)
    assert [p.split(" needs ")[1].split(" ")[0] for p in missing] == ["data.raw_inputs", "data.output_prefix"]
