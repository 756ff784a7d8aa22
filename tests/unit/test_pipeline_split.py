"""zbv's backward in two halves (`backward_input`, then `backward_weight`, framework/distributed/
pipeline.py) gives each input and each weight the gradient one whole backward gives, for stage
graphs whose outputs are not all on the path to the stage's input.

Tolerance 1e-6: the two halves run the same operations as the whole backward, the only difference
being where autograd's sums of several paths are taken; fp32 values of order 1."""

from __future__ import annotations

import pytest
import torch

from framework.distributed.pipeline import backward_input, backward_weight


def _halves_against_whole(stage, together: bool, n_weights: int = 3) -> None:
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(n_weights)]
    x0 = torch.randn(2, 4)
    x = x0.clone().requires_grad_()
    outputs = stage(x, weights)
    output_grads = [torch.randn_like(o) for o in outputs]
    torch.autograd.backward(outputs, output_grads)
    whole = [w.grad for w in weights]
    whole_x = x.grad
    for w in weights:
        w.grad = None

    x = x0.clone().requires_grad_()
    outputs = stage(x, weights)
    (dx,), half = backward_input(tuple(outputs), output_grads, [x])
    assert all(w.grad is None for w in weights), "the input half stored a weight gradient"
    backward_weight(half, together=together)
    torch.testing.assert_close(dx, whole_x, atol=1e-6, rtol=0)
    for i, (w, expected) in enumerate(zip(weights, whole)):
        if expected is None:
            assert w.grad is None, i
        else:
            assert w.grad is not None, f"weight {i} got no gradient"
            torch.testing.assert_close(w.grad, expected, atol=1e-6, rtol=0, msg=f"weight {i}")


def _used_output(x, w):
    """An output of the weights alone that the stage also adds into its input path."""
    position = w[1] * 2.0
    h = torch.tanh(x @ w[0]) + position.sum(0)
    return [h @ w[2], position]


def _weight_as_output(x, w):
    return [x @ w[0], w[1]]


def _used_weight_as_output(x, w):
    """A weight returned as it is and also used on the input path."""
    return [torch.tanh(x @ w[0]) @ w[1], w[1]]


def _chained_outputs(x, w):
    """Two outputs of the weights alone, the second computed from the first, both used inside."""
    a = w[1] * 3.0
    b = torch.sin(a) @ w[2]
    return [torch.tanh(x @ w[0] + a.sum(0) + b.sum(0)) @ w[2], a, b]


def _saved_output(x, w):
    """An output on the input path that the stage multiplies by a weight (saving it for that
    weight's gradient)."""
    h = torch.tanh(x @ w[0])
    return [h, h @ w[1]]


@pytest.mark.parametrize(
    "stage",
    [_used_output, _weight_as_output, _used_weight_as_output, _chained_outputs, _saved_output],
    ids=["output_also_used", "weight_returned", "weight_returned_and_used", "chained_outputs", "saved_output"],
)
@pytest.mark.parametrize("together", [False, True], ids=["per_group", "one_call"])
def test_weight_half_equals_a_whole_backward(stage, together):
    _halves_against_whole(stage, together)


@pytest.mark.parametrize("together", [False, True])
def test_weight_half_in_one_call_recomputes_a_checkpointed_block_once(together):
    """Three weights, each joining the input path at its own matmul: three groups. Each autograd
    call recomputes the checkpointed block, so the weight half recomputes it once per group, or
    once in all (`together`, what a stage under activation checkpointing runs); the gradients are
    the whole backward's either way."""
    from torch.utils.checkpoint import checkpoint

    runs = []

    def block(x, w):
        runs.append(1)
        return torch.tanh(torch.tanh(x @ w[0]) @ w[1]) @ w[2]

    def stage(x, w):
        return [checkpoint(block, x, w, use_reentrant=False)]

    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3)]
    x0 = torch.randn(2, 4)
    grad = torch.randn(2, 4)
    stage(x0.clone().requires_grad_(), weights)[0].backward(grad)
    whole = [w.grad for w in weights]
    for w in weights:
        w.grad = None
    runs.clear()
    x = x0.clone().requires_grad_()
    outputs = stage(x, weights)
    _, half = backward_input(tuple(outputs), [grad], [x])
    assert len(half.groups) == 3 and len(runs) == 2  # the forward, the input half's recomputation
    backward_weight(half, together=together)
    assert len(runs) == 2 + (1 if together else 3)
    for w, expected in zip(weights, whole):
        torch.testing.assert_close(w.grad, expected, atol=1e-6, rtol=0)
