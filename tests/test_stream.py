"""The load-only streaming probe (perfkit/kernels/stream.py): its fold against the torch reference (interpreter on
CPU, the real kernel on a GPU), spans that leave a ragged tail, bad configs, and the ceiling record's keys."""

from __future__ import annotations

import pytest
import torch

from perfkit.kernels.launch import sm_count
from perfkit.kernels.stream import (
    CHAIN_BYTES,
    StreamConfig,
    chain_copies,
    stream_chain_us,
    stream_fold,
    stream_read_ms,
    stream_ref,
    stream_traffic,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("n_words", [1, 511, 4096 + 37])
@pytest.mark.parametrize("cfg", [StreamConfig(1, 1, 2), StreamConfig(1, 2, 3), StreamConfig(2, 4, 1)])
def test_fold_matches_reference(n_words, cfg):
    gen = torch.Generator().manual_seed(n_words)
    words = torch.randint(-(2**31), 2**31 - 1, (n_words,), dtype=torch.int32, generator=gen).to(DEVICE)
    out = stream_fold(words, cfg)
    ref = stream_ref(words, cfg, sms=sm_count(words.device))
    assert torch.equal(out.cpu(), ref.cpu())
    # every word reaches the fold: flipping one changes it
    words[n_words // 2] ^= 1
    assert not torch.equal(stream_fold(words, cfg).cpu(), ref.cpu())


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="1-D int32"):
        stream_fold(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="unroll 1, 2 or 4"):
        stream_fold(torch.zeros(4, dtype=torch.int32), StreamConfig(4, 3, 8))


def test_traffic_counts_whole_words():
    assert stream_traffic(10) == {"bytes_read": 12, "total_bytes": 12}


@pytest.mark.skipif(CUDA, reason="CPU path")
def test_ceiling_needs_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        stream_read_ms(1 << 20)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        stream_chain_us(1 << 20)


def test_chain_copies_cover_the_chain_bytes():
    """Enough distinct buffers that the chain reads CHAIN_BYTES (L2 never serves a re-read), within [2, most]."""
    assert chain_copies(CHAIN_BYTES // 10) == 10
    assert chain_copies(CHAIN_BYTES // 10 - 1) == 11
    assert chain_copies(CHAIN_BYTES * 3) == 2 and chain_copies(1) == 20 and chain_copies(1, most=12) == 12


@pytest.mark.gpu
def test_ceiling_on_gpu():
    if not CUDA:
        pytest.skip("needs CUDA")
    r = stream_read_ms(64 << 20, warmup=2, rep=5)
    assert set(r) == {"stream_ms", "stream_tb_s", "config"} and 0.1 < r["stream_tb_s"] < 20
    c = stream_chain_us(64 << 20)
    assert set(c) == {"stream_chain_us", "stream_chain_tb_s", "config"} and 0.1 < c["stream_chain_tb_s"] < 20
    # a launch in a chain has no graph launch of its own to pay: never slower than one launch alone
    assert c["stream_chain_us"] < 1e3 * r["stream_ms"]


def test_main_without_cuda_or_with_bad_sizes_exits_2(capsys, monkeypatch):
    from perfkit.kernels import stream

    assert stream._main(["--mb", "0"]) == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert stream._main(["--mb", "16"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and "above 0" in out[0] and "CUDA" in out[1]
