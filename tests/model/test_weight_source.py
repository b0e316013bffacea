"""Weight sources (conveyor/model/loader.py): tensors read one at a time, exactly as the files hold them.

safetensors shards are read through their headers (the index decides which files count), with or without a
dtype change, into fresh memory or into a caller's buffer; GGUF rows are dequantized bit for bit as gguf-py
does, whole or a chunk of rows at a time.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conveyor.model import loader
from conveyor.model.loader import GGUFTensor, SafetensorsSource, dequantize_gguf_rows, hf_weights


@pytest.fixture
def sharded(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    a = {"w.a": torch.randn(40, 24, generator=g).to(torch.bfloat16), "w.b": torch.randn(7, generator=g)}
    b = {"w.c": torch.randn(16, 8, generator=g), "w.d": torch.arange(12, dtype=torch.int64).reshape(3, 4)}
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {**dict.fromkeys(a, "model-00001-of-00002.safetensors"),
                                            **dict.fromkeys(b, "model-00002-of-00002.safetensors")}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    # a file the index does not name (Mistral's repos ship consolidated.safetensors beside the shards)
    save_file({"stray": torch.zeros(2)}, str(tmp_path / "consolidated.safetensors"))
    return tmp_path, {**a, **b}


def test_sharded_safetensors_read_exactly(sharded):
    path, want = sharded
    src = hf_weights(path)
    assert isinstance(src, SafetensorsSource)
    assert sorted(src) == sorted(want), "the index names the files; a stray one is not read"
    for name, t in want.items():
        assert src.shape(name) == tuple(t.shape)
        got = src[name]
        assert got.dtype == t.dtype and torch.equal(got, t)
    assert src.bytes_read == sum(t.numel() * t.element_size() for t in want.values())


def test_read_converts_and_fills_a_callers_buffer(sharded, monkeypatch):
    path, want = sharded
    monkeypatch.setattr(loader, "READ_CHUNK_BYTES", 64)  # several chunks of rows per tensor
    src = hf_weights(path)
    assert torch.equal(src.read("w.c", torch.bfloat16), want["w.c"].to(torch.bfloat16))
    assert torch.equal(src.read("w.a", torch.float32), want["w.a"].float())
    fused = torch.full((56, 24), 7.0, dtype=torch.bfloat16)
    src.read("w.a", torch.bfloat16, out=fused[:40])
    assert torch.equal(fused[:40], want["w.a"]) and bool((fused[40:] == 7).all())
    with pytest.raises(ValueError, match="shape"):
        src.read("w.a", out=torch.empty(10, 24, dtype=torch.bfloat16))


def gguf_tensor(tmp_path, qtype: str, rows: int, cols: int) -> tuple[GGUFTensor, np.ndarray]:
    """A GGUF tensor's bytes in a file of their own (after 16 bytes of padding), and gguf-py's values of them."""
    import gguf

    w = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    if qtype in ("F32", "F16"):
        raw = w.astype(np.float32 if qtype == "F32" else np.float16)
        want = raw.astype(np.float32)
    else:
        t = getattr(gguf.GGMLQuantizationType, qtype)
        raw = gguf.quants.quantize(w, t)
        want = gguf.quants.dequantize(raw, t).reshape(rows, cols)
    f = tmp_path / f"{qtype}.bin"
    f.write_bytes(b"\0" * 16 + raw.tobytes())
    return GGUFTensor(str(f), "blk.0.ffn_up.weight", qtype, (rows, cols), 16, raw.nbytes), want


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_gguf_rows_dequantize_as_gguf_py_does(tmp_path, qtype):
    rows, cols = 24, 256
    t, want = gguf_tensor(tmp_path, qtype, rows, cols)
    np.testing.assert_array_equal(dequantize_gguf_rows(t, 0, rows).float().numpy(), want)
    np.testing.assert_array_equal(dequantize_gguf_rows(t, 5, 11).float().numpy(), want[5:11])
