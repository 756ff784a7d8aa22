"""Our Llama cut into pipeline stages by layers: the embedding on the first stage, the final norm
and the output head on the last, a contiguous run of blocks on each.

A stage holds the model's own submodules under the model's own names (`tok_embeddings`,
`layers.<index in the whole model>`, `norm`, `output`), so a stage's parameter names are the
whole model's and checkpoints move between pipeline degrees. The generic side (which rank runs
which stage, the schedule, the engine) is framework/distributed/pipeline.py.
"""

from __future__ import annotations

import torch
from torch import nn

from framework.models.llama.model import Transformer, document_mask, rotary_table


class _Rotary(nn.Module):
    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.register_buffer("table", table, persistent=False)


class _WithAuxLoss(torch.autograd.Function):
    """[Note: the load-balancing loss in a pipeline]
    A stage's output goes on to the next stage (or the schedule's loss) and its experts' aux loss
    goes nowhere: no stage sees the others' and the schedule calls backward on the cross-entropy
    only. So the stage's output carries it: forward returns the output unchanged, backward passes
    the output's gradient through and gives the aux loss the gradient `scale` (1 / microbatches,
    as the cross-entropy of each microbatch is divided), which is what d(loss + scale x aux) would
    give it. Its value joins the step's reported loss in the pipeline (framework/distributed/
    pipeline.py sums every stage's over the pp ranks)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype, ctx.scale = aux.shape, aux.dtype, scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


class LlamaStage(nn.Module):
    """Layers [start, end) of `model`, with the embedding if `first` and the norm and head if `last`.
    Its input is the tokens (first) or the previous stage's hidden states (batch, seq, dim); its
    output the logits (last) or its hidden states."""

    def __init__(self, model: Transformer, start: int, end: int, first: bool, last: bool):
        super().__init__()
        # [Note: tied embeddings in a pipeline] (framework/distributed/pipeline.py): with the head
        # tied to the embedding, the first and the last stage each hold both modules (one
        # parameter), as the whole model does, and use the one their place calls for.
        tied = model.cfg.tie_embeddings and (first or last)
        if first or tied:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, end)})
        if last:
            self.norm = model.norm
        if last or tied:
            self.output = model.output
        # The rotary table, one module shared by the stages (moved with them, never saved).
        self.rotary = model.__dict__.setdefault("_pipeline_rotary", _Rotary(model.rope))
        self.first, self.last = first, last
        self.dim, self.vocab_size = model.cfg.dim, model.cfg.vocab_size
        self.__dict__["_cfg"] = model.cfg
        # [Note: the load-balancing loss in a pipeline]: the weight of each microbatch's aux loss
        # (1 / microbatches, set by the pipeline) and this step's scaled values, for the report.
        self.aux_scale, self.aux_losses = 1.0, []

    @torch.no_grad()
    def materialize(self) -> None:
        """After `to_empty` of a model built on the meta device: the rotary table, which the
        whole model's `init_weights` fills in its own (meta) buffer, not in the stages'."""
        c = self.__dict__["_cfg"]
        table = self.rotary.table
        table.copy_(rotary_table(c.dim // c.n_heads, c.max_seq_len, c.rope_theta, table.device, c.rope_scaling))

    takes_documents = True  # packed fine-tuning rows: positions and document ids to every stage

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Packed rows (several documents each) pass every stage the tokens' positions inside their
        documents and the documents' ids, as the whole model's forward takes them."""
        h = self.tok_embeddings(x) if self.first else x
        rope = self.rotary.table if positions is None else self.rotary.table[positions]
        mask = document_mask(document_ids)
        aux = []  # the experts' load-balancing losses of this stage's blocks
        for layer in self.layers.values():
            h = layer(h, rope, mask=mask)
            if getattr(layer.feed_forward, "aux_loss", None) is not None:
                aux.append(layer.feed_forward.aux_loss)
        out = self.output(self.norm(h)) if self.last else h
        if aux:
            total = torch.stack(aux).sum()
            self.aux_losses.append(total.detach() * self.aux_scale)
            if torch.is_grad_enabled():
                out = _WithAuxLoss.apply(out, total, self.aux_scale)
        return out

    def example_io(self, batch: int, seq: int, dtype: torch.dtype, tp: int = 1, hidden_seq: int | None = None) -> tuple:
        """(input, output) tensors on the meta device with this stage's shapes and dtypes: the
        pipeline's static description of what travels between stages. `hidden_seq`: the hidden
        states' length between stages where it is not `seq` (this rank's piece of the sequence
        under sequence parallelism, which leaves the blocks' outputs sharded on it)."""
        hidden = seq if hidden_seq is None else hidden_seq
        x = (
            torch.empty(batch, seq, dtype=torch.long, device="meta")
            if self.first
            else torch.empty(batch, hidden, self.dim, dtype=dtype, device="meta")
        )
        if self.last:  # tensor parallel: the local logits, of the whole sequence (the head gathers it)
            return x, torch.empty(batch, seq, self.vocab_size // tp, dtype=dtype, device="meta")
        return x, torch.empty(batch, hidden, self.dim, dtype=dtype, device="meta")


def pipeline_stage(model: Transformer, start: int, end: int, first: bool, last: bool) -> LlamaStage:
    return LlamaStage(model, start, end, first, last)
