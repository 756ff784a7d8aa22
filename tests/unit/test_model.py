"""The Llama model family: shapes, meta-device construction, and the published sizes."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO

from framework.config import compose_config, to_config
from framework.models import build_model


def model_cfg(name, **overrides):
    """The preset's ModelConfig, with `overrides` of its family's arguments (model.args)."""
    cfg = to_config(compose_config([f"model={name}"])).model
    if overrides:
        cfg.args = {**(cfg.args or {}), **overrides}
    return cfg


def sizes(cfg):
    from framework.models.llama.args import llama_args

    return llama_args(cfg)


@pytest.mark.parametrize(
    "name, billions",
    [("llama_7b", 6.74), ("llama_13b", 13.02), ("llama_70b", 68.98), ("llama_1b", 1.24)]
    + [("llama3_1_8b", 8.03), ("llama3_1_70b", 70.55), ("mistral_7b", 7.25)],
)
def test_published_sizes(name, billions):
    model = build_model(model_cfg(name), "meta")
    assert model.num_params() / 1e9 == pytest.approx(billions, abs=0.01)


_META_70B = """
import resource, sys
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from framework.config import compose_config, to_config
from framework.models import build_model

cfg = to_config(compose_config(["model=llama_70b"])).model
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB; everything is imported by now
model = build_model(cfg, "meta")
assert all(p.is_meta for p in model.parameters())
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
for block in model.layers:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
assert all(p.is_meta for p in model.parameters())
dist.destroy_process_group()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20)
"""


def test_70b_on_meta_allocates_nothing_and_shards():
    """In a fresh process, so the peak resident size (a high-water mark for the process's whole
    life) starts at the imports, not at whatever earlier tests in this process reached. The fp32
    70B model would be 276 GB; building and sharding it on meta must stay under 1 GiB."""
    out = subprocess.run([sys.executable, "-c", _META_70B], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    grown_gib = float(out.stdout.split()[-1])
    assert grown_gib < 1.0, f"building a 70B model on meta grew the peak RSS by {grown_gib:.1f} GiB"


def test_forward_shapes_gqa_and_causality():
    cfg = model_cfg("debug")
    model = build_model(cfg)
    model.init_weights(seed=0)
    tokens = torch.randint(0, sizes(cfg).vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, sizes(cfg).vocab_size)
    assert model.layers[0].attention.wk.weight.shape == (
        sizes(cfg).n_kv_heads * sizes(cfg).dim // sizes(cfg).n_heads,
        sizes(cfg).dim,
    )
    # Changing a later token must not change earlier positions' logits.
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % sizes(cfg).vocab_size
    assert torch.allclose(model(changed)[:, :10], logits[:, :10], atol=1e-6)
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_init_is_reproducible_and_meta_init_after_to_empty():
    cfg = model_cfg("debug", tie_embeddings=True)
    a, b = build_model(cfg), build_model(cfg, "meta")
    a.init_weights(seed=3)
    b.to_empty(device="cpu")
    b.init_weights(seed=3)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    assert a.output.weight is a.tok_embeddings.weight
    assert torch.equal(a.rope, b.rope) and a.rope.abs().sum() > 0


def test_every_model_preset_is_registered_and_an_unknown_name_is_refused():
    import pathlib

    from framework.errors import UserInputError
    from framework.models import family_of

    root = pathlib.Path(__file__).resolve().parents[2] / "conf" / "model"
    for path in sorted(root.glob("*.yaml")):
        cfg = model_cfg(path.stem)
        family = family_of(cfg)
        assert cfg.name in family.names, path
    cfg = model_cfg("debug")
    cfg.name = "gpt2"  # a name must mean what it says: no Llama called gpt2
    with pytest.raises(UserInputError, match=r"model.name='gpt2'.*model=hf"):
        family_of(cfg)


def test_llama_family_record_describes_the_model():
    from framework.models import family_of

    cfg = model_cfg("debug")
    family = family_of(cfg)
    model = family.build(cfg, "cpu")
    family.init_weights(model, 0)
    assert family.blocks(model) == list(model.layers)
    assert family.embedding_name in model.state_dict()
    assert family.num_params(model) == model.num_params()
    adapter = family.adapter(cfg)
    assert adapter.to_hf("layers.1.attention.wq.weight") == "model.layers.1.self_attn.q_proj.weight"
    # The causal-LM task's loss is the cross-entropy of the model's logits on the shifted labels.
    tokens = torch.randint(sizes(cfg).vocab_size, (2, 9))
    loss = family.task(cfg).loss(model, (tokens[:, :-1], tokens[:, 1:]))
    ref = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    assert torch.equal(loss, ref)
