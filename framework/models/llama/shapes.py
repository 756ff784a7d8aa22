"""Our Llama's units and tensors as the engine shards them, per tensor-parallel rank: pure
arithmetic over `LlamaArgs` (args.py), mirroring `model.py` and the plan of `parallelize.py`.
`parallelize` makes one sharding unit per transformer block and one for the root (embeddings,
final norm, output head); `tests/planner/test_planner.py` checks these counts against the built
model, tensor by tensor."""

from __future__ import annotations

from dataclasses import replace

from framework.models.llama.args import llama_args
from framework.models.shapes import ModelShape, Tensor, Unit
from framework.param_roles import is_muon_matrix, is_output_head

# Which of our Llama's tensors optimizer=muon steps with Muon: the builder's rule
# (framework/param_roles.py) with what this file knows of each: a block's linear weights and its
# stacked experts are matrices weight decay applies to; norms are 1-D, the token embedding is an
# embedding (both undecayed); the output head and the router are checked by name and width.
MATRIX = is_muon_matrix(2, undecayed=False, head=False)
NORM = is_muon_matrix(1, undecayed=True, head=False)
EMBEDDING = is_muon_matrix(2, undecayed=True, head=False)


def _split(n: int, tp: int) -> int:
    """Rows tp rank 0 holds of n (torch.chunk semantics, as DTensor's Shard: rank 0 has the most)."""
    return -(-n // tp)


def block_tensors(m: ModelShape, tp: int = 1, moe: tuple = ()) -> tuple[Tensor, ...]:
    """`moe`: (n_experts, expert ffn, shared ffn) of a mixture-of-experts block (tp is then 1)."""
    d, q, kv, f = m.dim, m.n_heads * m.head_dim, m.kv_dim, m.ffn_dim
    attention = (
        Tensor("attention_norm.weight", d, False, muon=NORM),
        Tensor("attention.wq.weight", _split(q, tp) * d, tp > 1, row=d, muon=MATRIX, matrix=(q, d)),
        Tensor("attention.wk.weight", _split(kv, tp) * d, tp > 1, row=d, muon=MATRIX, matrix=(kv, d)),
        Tensor("attention.wv.weight", _split(kv, tp) * d, tp > 1, row=d, muon=MATRIX, matrix=(kv, d)),
        Tensor("attention.wo.weight", d * _split(q, tp), tp > 1, row=_split(q, tp), muon=MATRIX, matrix=(d, q)),
        Tensor("ffn_norm.weight", d, False, muon=NORM),
    )
    if moe:
        experts, ef, shared = moe
        # the router: a linear of n_experts outputs inside a block, never a head
        router = is_muon_matrix(2, False, is_output_head("layers.0.feed_forward.router", experts, {m.vocab_size}))
        out = [Tensor("feed_forward.router.weight", experts * d, False, row=d, muon=router)]
        out += [
            Tensor(f"feed_forward.experts.{w}", experts * ef * d, False, experts, ef * d, muon=MATRIX, matrix=(ef, d))
            for w in ("w1", "w3", "w2")
        ]
        if shared:
            out += [
                Tensor(
                    f"feed_forward.shared.{w}.weight", shared * d, False, row=shared if w == "w2" else d, muon=MATRIX
                )
                for w in ("w1", "w3", "w2")
            ]
        return attention + tuple(out)
    return attention + (
        Tensor("feed_forward.w1.weight", _split(f, tp) * d, tp > 1, row=d, muon=MATRIX, matrix=(f, d)),
        Tensor("feed_forward.w3.weight", _split(f, tp) * d, tp > 1, row=d, muon=MATRIX, matrix=(f, d)),
        Tensor("feed_forward.w2.weight", d * _split(f, tp), tp > 1, row=_split(f, tp), muon=MATRIX, matrix=(d, f)),
    )


def root_tensors(m: ModelShape, tp: int = 1) -> tuple[Tensor, ...]:
    rows = _split(m.vocab_size, tp)
    out = [
        Tensor("tok_embeddings.weight", rows * m.dim, tp > 1, row=m.dim, muon=EMBEDDING),
        Tensor("norm.weight", m.dim, False, muon=NORM),
    ]
    if not m.tie_embeddings:  # a linear of vocab_size outputs outside the blocks: the head
        head = is_muon_matrix(2, False, is_output_head("output", m.vocab_size, {m.vocab_size}))
        out.append(Tensor("output.weight", rows * m.dim, tp > 1, row=m.dim, muon=head))
    return tuple(out)


def layout(m: ModelShape, tp: int = 1) -> list[Unit]:
    block = block_tensors(m, tp)
    return [Unit("root", root_tensors(m, tp))] + [Unit(f"layers.{i}", block) for i in range(m.n_layers)]


def llama_shape(vocab, dim, n_layers, n_heads, n_kv_heads, ffn_dim, tie_embeddings=False) -> ModelShape:
    return ModelShape(vocab, dim, n_layers, n_heads, n_kv_heads, ffn_dim, layout, tie_embeddings, context_parallel=True)


def plan_shape(cfg, vocab_size: int) -> ModelShape:
    """`vocab_size`: the data's, used where model.args.vocab_size=-1 leaves it to the tokenizer.
    A mixture-of-experts model: its expert tensors are counted whole; the FLOP and activation
    widths are a token's (top_k experts and the shared one)."""
    a = llama_args(cfg)
    vocab = a.vocab_size if a.vocab_size > 0 else vocab_size
    rope = a.max_seq_len * (a.dim // a.n_heads) * 4  # model.py's rotary table: fp32, on every rank
    if not a.n_experts:
        shape = llama_shape(vocab, a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_dim, a.tie_embeddings)
        return replace(shape, buffer_bytes=rope)
    ef = a.moe_ffn_dim or a.ffn_dim
    moe = (a.n_experts, ef, ef * a.n_shared_experts)

    def moe_layout(m: ModelShape, tp: int = 1) -> list[Unit]:
        assert tp == 1, "mixture-of-experts models are planned at tp=1"
        block = block_tensors(m, 1, moe)
        return [Unit("root", root_tensors(m, 1))] + [Unit(f"layers.{i}", block) for i in range(m.n_layers)]

    active_ffn = ef * (a.top_k + a.n_shared_experts)
    return ModelShape(
        vocab,
        a.dim,
        a.n_layers,
        a.n_heads,
        a.n_kv_heads,
        active_ffn,
        moe_layout,
        a.tie_embeddings,
        tensor_parallel=False,
        inactive_params=a.n_layers * (a.n_experts - a.top_k) * 3 * ef * a.dim,
        n_experts=a.n_experts,
        top_k=a.top_k,
        buffer_bytes=rope,
        pipeline=True,
        pipeline_experts=True,  # experts inside stages: ep x pp (framework/distributed/pipeline.py)
    )
