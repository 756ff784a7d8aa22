"""Single-process checks of the engine's flat layout: padding, chunks, int8 blocks."""

import copy

import torch


def test_flat_layout_padding_and_chunks():
    from framework.distributed.fsdp.flat import FlatEntry, build_layout, dim0_chunk

    entries = [
        FlatEntry(users=[], shape=torch.Size([5, 3]), offset=0, numel=15, requires_grad=True),
        FlatEntry(users=[], shape=torch.Size([1]), offset=0, numel=1, requires_grad=True),
    ]
    covered = []
    for r in range(4):
        L = build_layout([copy.copy(e) for e in entries], 4, r)
        assert L.shard_numel == 4 and L.padded_total == 16
        covered += [(e.local_lo, e.local_hi) for e in L.entries if e.local_numel]
    assert sum(hi - lo for lo, hi in covered) == 16
    assert [dim0_chunk(torch.Size([1, 5]), 2, r) for r in range(2)] == [(0, 1), (1, 1)]
    assert [dim0_chunk(torch.Size([5]), 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]


def test_quantize_roundtrip_error_bound():
    from framework.distributed.fsdp.zeropp import dequantize_into, packed_nbytes, quantize_into

    x = torch.randn(1024)
    buf = torch.empty(packed_nbytes(1024, 256), dtype=torch.uint8)
    quantize_into(x, buf, 256)
    y = torch.empty(1024)
    dequantize_into(buf, y, 256)
    # round-to-nearest int8 with an absmax scale: error <= half a step = absmax / 254 per block
    bound = x.view(-1, 256).abs().amax(1, keepdim=True) / 254 + 1e-7
    assert ((x - y).view(-1, 256).abs() <= bound).all()
