"""Our GGUF header reader (`models.gguf_file.GGUFHeader`) against the `gguf` package's
own reader, on a file the package's writer made: every metadata value, and every
tensor's name, type, shape and bytes."""

from __future__ import annotations

import numpy as np
import pytest

from offload.core.errors import UserError
from offload.models.gguf_file import GGUFArray, GGUFHeader, open_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture
def gguf_path(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("tokenizer.chat_template", "{{ messages }} ü")
    writer.add_int64("some.int64", -(1 << 40))
    writer.add_float64("some.float64", 0.1)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.token_type", list(range(300)))
    writer.add_array("some.small", [3, 1, 4])
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    writer.add_tensor("dense.f32", rng.standard_normal((6, 32)).astype(np.float32))
    writer.add_tensor("dense.f16", rng.standard_normal((3, 64)).astype(np.float16))
    raw = rng.standard_normal((4, 64)).astype(np.float32)
    q8 = gguf.quants.quantize(raw, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("quant.q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_header_reads_what_gguf_reads(gguf_path):
    ours, theirs = GGUFHeader(gguf_path), gguf.GGUFReader(str(gguf_path))
    keys = {k for k in theirs.fields if not k.startswith("GGUF.")}
    assert set(ours.fields) == keys
    for key in keys:
        field, value = theirs.fields[key], ours.fields[key]
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert isinstance(value, GGUFArray) and len(value) == len(field.data), key
            if value.values is not None:
                assert list(value.values) == field.contents(), key
        else:
            assert value == field.contents(), key
    assert ours.fields["some.small"].values == (3, 1, 4)
    assert ours.fields["tokenizer.ggml.tokens"].values is None  # stepped over, counted
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference.tensor_type, mine.name
        assert mine.data.dtype == reference.data.dtype, mine.name
        assert mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name
    q8 = next(t for t in ours.tensors if t.name == "quant.q8")
    assert gguf.quants.dequantize(q8.data, q8.tensor_type).shape == (4, 64)


def test_a_cut_or_foreign_file_is_one_clear_error(gguf_path, tmp_path):
    data = gguf_path.read_bytes()
    tensors_end = max(t.data_offset + t.n_bytes for t in gguf.GGUFReader(str(gguf_path)).tensors)
    cut = tmp_path / "cut.gguf"
    for size in (10, 2000, tensors_end - 1):  # in the header, the vocabulary, a tensor
        cut.write_bytes(data[:size])
        with pytest.raises(UserError, match=r"cannot read GGUF file .*; is the file complete\?"):
            open_gguf(cut)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(UserError, match="no GGUF magic"):
        open_gguf(foreign)
