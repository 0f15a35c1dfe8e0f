"""Group-wise quantization reference: packing bit-exact, error within the step size."""

from __future__ import annotations

import pytest
import torch

from offload.kernels.formats import Compression
from offload.kernels.quant import (
    dequantize,
    embedding,
    fake_quantize,
    pack_int4,
    quantize,
    unpack_int4,
)


def test_int4_pack_unpack_is_bit_exact():
    codes = torch.randint(0, 16, (7, 5, 64), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (7, 5, 32)
    assert torch.equal(unpack_int4(packed), codes)
    assert int(packed[0, 0, 0]) == int(codes[0, 0, 0]) | (int(codes[0, 0, 1]) << 4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_error_is_within_half_a_step(bits, symmetric, dtype):
    config = Compression(bits=bits, group_size=64, symmetric=symmetric)
    t = (torch.randn(33, 3 * 64) * 3).to(dtype)
    q = quantize(t, config)
    back = dequantize(q)
    assert back.shape == t.shape and back.dtype == dtype
    step = q.scale.float().repeat_interleave(64, dim=-1).reshape(t.shape)
    # half a step, the float16 rounding of scale and minimum (levels x step + |x|),
    # and the rounding of the result to the tensor's dtype
    levels = (1 << bits) - 1
    fp16 = torch.finfo(torch.float16).eps
    slack = (
        0.5 * step
        + (levels * step + 2 * t.float().abs()) * fp16
        + t.float().abs() * torch.finfo(dtype).eps
        + 1e-6
    )
    assert ((back.float() - t.float()).abs() <= slack).all()
    expected = t.numel() * bits // 8
    assert q.codes.numel() == expected


def test_bytes_shrink_as_promised():
    t = torch.randn(4096, 4096, dtype=torch.float16)
    q4 = quantize(t, Compression(bits=4, group_size=64))
    ratio = t.numel() * 2 / q4.nbytes
    assert 3.5 < ratio < 4.0  # codes plus fp16 scale and minimum per 64 values


def test_odd_group_is_a_clear_error():
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        quantize(torch.randn(3, 100), Compression(bits=8, group_size=64))


def test_int4_g32_asymmetric_reproduces_the_demo_models_q4_1_grid():
    """llama.cpp's Q4_1 is asymmetric 4-bit in groups of 32 along the input dimension:
    our quantizer on the same grid must give its dequantized weights back."""
    from offload.models.resolve import resolve_model

    with resolve_model("demo").open_weights() as source:
        weights = source.layer(3, torch.float32, torch.device("cpu"))
    w = weights["mlp_out.weight"]
    back = dequantize(quantize(w, Compression(bits=4, group_size=32)))
    rel = ((back - w).norm() / w.norm()).item()
    assert rel < 2e-3, rel  # float16 scales; Q4_1 keeps them in float16 too


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_cpu_decode_attention_over_the_compressed_cache(bits, symmetric):
    """The CPU path (codes straight into float32 matmuls, never dequantized) against
    SDPA in float64 over the dequantized cache: within 2x torch's own error, prefill
    then every group boundary, contexts inside the first group included."""
    from tests.kernel_cases import attention_failures

    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    assert attention_failures(bits, symmetric, "cpu", dtypes) == []


@pytest.mark.parametrize("symmetric", [False, True])
def test_pack_unpack_moves_exactly_what_a_write_changed(symmetric):
    """A home that receives only `pack`ed changes (prefill, single tokens across group
    boundaries, a multi-token write from inside a group) holds the same cache."""
    from offload.kernels.kv_cache import QuantKV

    config = Compression(4, 16, symmetric)
    src, home = (QuantKV(3, 2, 24, 70, config, torch.float32, torch.device("cpu")) for _ in "sh")
    # a disk home's layout, and a cache that receives only its slots 0 .. end - 1
    disk = QuantKV(3, 2, 24, 70, config, torch.float32, torch.device("cpu"), slot_major=True)
    k, v = torch.randn(2, 3, 2, 70, 24).unbind(0)
    for start, end in [(0, 13), *((t, t + 1) for t in range(13, 40)), (40, 58), (58, 70)]:
        src.write(k[:, :, start:end], v[:, :, start:end], start)
        home.unpack(src.pack(start, end), start, end)
        disk.unpack(src.pack(start, end), start, end)
        loaded = QuantKV(3, 2, 24, 70, config, torch.float32, torch.device("cpu"))
        loaded.copy_slots_from(disk, end)
        for cache in (home, disk, loaded):
            for ours, want in zip(cache.dequantized(end), src.dequantized(end), strict=True):
                assert torch.equal(ours, want), (start, end)


def test_slot_major_pieces_of_a_write_are_contiguous():
    """What a decode step changes in a slot-major cache (the tails' entries; the codes
    and parameters of a group when it completes) is one contiguous range a tensor."""
    from offload.kernels.kv_cache import QuantKV

    cache = QuantKV(
        3, 2, 24, 70, Compression(4, 16), torch.float16, torch.device("cpu"), None, True
    )
    for start in (20, 31):
        for name, part in cache.changed(start, start + 1):
            assert getattr(cache, name)[:, :, part].movedim(2, 0).is_contiguous(), name


@pytest.mark.parametrize("bits, symmetric", [(4, False), (4, True), (8, False), (8, True)])
def test_quantizing_in_row_slices_is_bit_exact(monkeypatch, bits, symmetric):
    """A giant is quantized a slice of rows at a time (bounded transients); the codes and
    parameters are those of quantizing it whole."""
    from offload.kernels import quant

    t = torch.randn(300, 256)
    config = Compression(bits, 64, symmetric)
    whole = quant.quantize(t, config)
    monkeypatch.setattr(quant, "QUANT_SLICE_ELEMENTS", 1000)  # 3 rows a slice
    sliced = quant.quantize(t, config)
    assert torch.equal(whole.codes, sliced.codes)
    assert torch.equal(whole.scale, sliced.scale)
    assert symmetric or torch.equal(whole.minimum, sliced.minimum)


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_of_a_quantized_table_are_its_dequantized_rows(bits):
    """A tied model's embedding reads rows of the compressed head (`quant.embedding`):
    exactly the rows of the table the compressed head computes with."""
    config = Compression(bits=bits, group_size=32)
    table = torch.randn(50, 96, dtype=torch.float32)
    ids = torch.tensor([[3, 0, 49, 3], [7, 7, 1, 22]])
    got = embedding(ids, quantize(table, config), torch.device("cpu"))
    assert got.shape == (2, 4, 96)
    assert torch.equal(got, fake_quantize(table, config)[ids])
    assert torch.equal(embedding(ids, table, torch.device("cpu")), table[ids])


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [None, 4])
def test_rows_of_a_host_table_cross_once_each_and_land_in_place(bits):
    """A table in host memory (the executor's gathered embedding) sends each distinct
    row once and spreads it on the GPU: the same rows as gathered in place."""
    table = torch.randn(50, 96, dtype=torch.float16)
    ids = torch.tensor([[3, 0, 49, 3], [7, 7, 1, 22], [3, 3, 3, 3]])
    cuda = torch.device("cuda")
    if bits is None:
        got, want = embedding(ids, table, cuda), table[ids]
    else:
        stored = quantize(table, Compression(bits=bits, group_size=32))
        got, want = embedding(ids, stored, cuda), dequantize(stored)[ids]
    assert got.device.type == "cuda" and torch.equal(got.cpu(), want)


def test_mma_attention_splits_each_rows_groups_for_the_fewest_full_waves(monkeypatch):
    """`kv_attention_mma.split_groups` on a 132-SM GPU (8 programs an SM), a program
    costing its groups and 1.5 more: Llama-2-70B's 256 rows of 64 groups in 4 splits
    (1024 programs, one wave; 5 splits would need a second), OPT-30B's 672 rows of 8
    groups in 3 (2016 programs, two waves of 4.5 groups' time, where one wave of 8
    groups takes 9.5), its 784 and 1792 rows unsplit (784 x 4 splits: three waves of
    3.5), Llama-2-13B's 320 rows of 64 groups in 3 splits of 22 (one wave; 13 of 5
    groups need four waves of 6.5), and a row with no full group is one program. Without
    the fixed cost, 784 rows take 4 splits."""
    from offload.kernels import kv_attention_mma

    monkeypatch.setattr(kv_attention_mma, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert kv_attention_mma.split_groups(256, 64, cpu) == 16
    assert kv_attention_mma.split_groups(672, 8, cpu) == 3
    assert kv_attention_mma.split_groups(784, 8, cpu) == 8
    assert kv_attention_mma.split_groups(1792, 8, cpu) == 8
    assert kv_attention_mma.split_groups(320, 64, cpu) == 22
    assert kv_attention_mma.split_groups(2000, 8, cpu) == 8
    assert kv_attention_mma.split_groups(4, 0, cpu) == 1
    assert kv_attention_mma.split_groups(784, 8, cpu, fixed=0.0) == 2
