"""The decode graphs' input and output launches (perfkit/kernels/decode_io.py, toggle decode_io): against their
PyTorch references under the interpreter (CPU) and bit for bit against the torch ops on the GPU; the model's hooks;
the engine's tokens with the toggle on and off (GPU)."""

import random

import pytest
import torch

from perfkit.kernels import decode_io as dio

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOKENS = (0, 250, 251, 252)  # pad, image, video, audio


def _rows_case(B, V, H, widths, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(V, H, generator=g).to(dtype).to(DEV)
    ids = torch.randint(0, V, (B,), generator=g)
    ids[: min(B, 3)] = torch.tensor(TOKENS[1:])[: min(B, 3)]  # placeholders -> pad
    pos = torch.randint(0, 64, (B,), generator=g)
    tables = [tuple(torch.randn(64, w, generator=g).to(dtype).to(DEV) for _ in range(2)) for w in widths]
    return ids.to(DEV), pos.to(DEV), emb, tables


@pytest.mark.parametrize("B,H,widths,dtype", [(1, 40, [8, 12], torch.bfloat16), (5, 2100, [128, 256], torch.bfloat16),
                                              (3, 64, [16], torch.float32)])  # fmt: skip
def test_decode_rows_equal_reference(B, H, widths, dtype):
    """Embedding rows (placeholders read the pad row, the scale one rounding) and the RoPE rows of every table,
    bit for bit the torch ops; H above one block loops."""
    ids, pos, emb, tables = _rows_case(B, 300, H, widths, dtype)
    h = torch.full((B, H), float("nan"), dtype=dtype, device=DEV)
    out = [tuple(torch.full((B, w), float("nan"), dtype=dtype, device=DEV) for _ in range(2)) for w in widths]
    dio.decode_rows(ids, pos, emb, 73.5, TOKENS, h, tables, out)
    h_ref, rope_ref = dio.decode_rows_reference(ids, pos, emb, 73.5, TOKENS, tables)
    if DEV.type == "cuda" or dtype == torch.float32:
        assert torch.equal(h, h_ref)
    else:  # the interpreter rounds fp32 -> bf16 by truncation (torch and the GPU to nearest even): within an ulp
        torch.testing.assert_close(h, h_ref, rtol=2**-7, atol=0)
    assert torch.equal(h_ref[0], emb[0] * 73.5)  # image placeholder -> the pad row
    for (c, s), (cr, sr) in zip(out, rope_ref, strict=True):
        assert torch.equal(c, cr) and torch.equal(s, sr)


def test_decode_rows_take_the_previous_sampled_ids():
    """Rows with row_src >= 0 read their token from prev_ids (the runner's gather of the previous step's sampled
    ids, in the same launch), a gathered placeholder id reads the pad row, the others keep input_ids."""
    ids, pos, emb, tables = _rows_case(4, 300, 48, [8, 16], torch.float32, seed=3)
    ids = torch.tensor([7, 0, 0, 9], device=DEV)
    prev = torch.tensor([11, 250, 13, 14, 15], device=DEV)  # 250: an image placeholder
    src = torch.tensor([-1, 2, 1, -1], device=DEV)
    h = torch.empty(4, 48, device=DEV)
    out = [(torch.empty(4, w, device=DEV), torch.empty(4, w, device=DEV)) for w in (8, 16)]
    dio.decode_rows(ids, pos, emb, 2.0, TOKENS, h, tables, out, row_src=src, prev_ids=prev)
    h_ref, rope_ref = dio.decode_rows_reference(ids, pos, emb, 2.0, TOKENS, tables, row_src=src, prev_ids=prev)
    assert torch.equal(h, h_ref)
    assert torch.equal(h, emb[torch.tensor([7, 13, 0, 9], device=DEV)] * 2.0)
    with pytest.raises(ValueError, match="go together"):
        dio.decode_rows(ids, pos, emb, 2.0, TOKENS, h, tables, out, row_src=src)


def test_decode_rows_bad_inputs():
    ids, pos, emb, tables = _rows_case(2, 50, 16, [8, 8], torch.float32)
    h = torch.empty(2, 16, device=DEV)
    out = [(torch.empty(2, 8, device=DEV), torch.empty(2, 8, device=DEV))] * 2
    with pytest.raises(ValueError, match="one or two RoPE tables"):
        dio.decode_rows(ids, pos, emb, 1.0, TOKENS, h, tables * 2, out * 2)
    with pytest.raises(ValueError, match="do not fit"):
        dio.decode_rows(ids[:1], pos, emb, 1.0, TOKENS, h, tables, out)
    with pytest.raises(ValueError, match="need 2 rows"):
        dio.decode_rows(ids, pos, emb, 1.0, TOKENS, h, tables, [(o[0][:1], o[1][:1]) for o in out])


def _z(R, V, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(R, V, generator=g) * 40).to(dtype).to(DEV)


@pytest.mark.parametrize("R,V,cap", [(1, 5000, 30.0), (3, 4096, 30.0), (2, 2049, 0.0), (4, 300, 15.0)])
def test_softcap_argmax_reference(R, V, cap):
    """The soft-capped logits within fp32 rounding of torch's (exactly z when cap is 0), and each id the first
    column of its row's stored maximum, equal to the reference's argmax; the counters back at zero."""
    z = _z(R, V)
    greedy = dio.GreedyIds.new(R + 2, V, DEV)
    out = torch.empty(R, V, device=DEV)
    dio.softcap_argmax(z, cap, out, greedy.head(R))
    ref, ids = dio.softcap_argmax_reference(z, cap)
    if cap:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-5)
    else:
        assert torch.equal(out, ref)
    assert torch.equal(greedy.ids[:R], out.argmax(-1))
    assert torch.equal(greedy.ids[:R], ids)
    assert not greedy.count.any()


def test_softcap_argmax_ties_and_nan():
    """Equal maxima in one program and across programs: the first column wins (torch's argmax); a NaN counts as
    the largest; a second launch on the same scratch agrees."""
    V = 3 * dio.ARGMAX_BLOCK
    z = _z(3, V, torch.float32)
    top = float(z.max()) + 10
    z[0, 5] = z[0, 9] = top  # one program
    z[1, dio.ARGMAX_BLOCK + 7] = z[1, 2 * dio.ARGMAX_BLOCK + 1] = z[1, 3] = top  # across programs, first in 0
    z[2, 100] = top
    z[2, 2 * dio.ARGMAX_BLOCK + 50] = float("nan")
    greedy = dio.GreedyIds.new(3, V, DEV)
    for _ in range(2):
        out = torch.empty(3, V, device=DEV)
        dio.softcap_argmax(z, 30.0, out, greedy)
        assert greedy.ids.tolist() == [5, 3, 2 * dio.ARGMAX_BLOCK + 50]
        assert not greedy.count.any()


def test_softcap_argmax_bad_inputs():
    z = _z(2, 4096)
    greedy = dio.GreedyIds.new(2, 4096, DEV)
    with pytest.raises(ValueError, match="must be fp32"):
        dio.softcap_argmax(z, 30.0, torch.empty(2, 4096, dtype=torch.bfloat16, device=DEV), greedy)
    with pytest.raises(ValueError, match="greedy scratch"):
        dio.softcap_argmax(z, 30.0, torch.empty(2, 4096, device=DEV), dio.GreedyIds.new(1, 4096, DEV))
    with pytest.raises(ValueError, match="greedy scratch"):
        dio.softcap_argmax(z, 30.0, torch.empty(2, 4096, device=DEV), dio.GreedyIds.new(2, 9000, DEV))


def test_traffic():
    assert dio.softcap_argmax_bytes(1, 262144, 2) == 262144 * 6 + 8
    assert dio.decode_rows_bytes(2, 5376, [128, 256], 2) == 2 * ((2 * 5376 + 4 * 384) * 2 + 16)


# ---- the model's hooks -------------------------------------------------------------------------------------------


def _tiny(name="tiny"):
    from perfkit.runtime.model_config import get_preset
    from perfkit.runtime.weights import build_model

    cfg = get_preset(name)
    model = build_model(cfg, DEV.type, torch.bfloat16 if DEV.type == "cuda" else torch.float32, seed=0)
    model.set_fused(True)
    model.setup_rope(64)
    return cfg, model


def test_model_decode_rows_is_embed_and_rope():
    """`decode_rows` writes what `embed` and the RoPE lookup give a text decode step, bit for bit; PLE models and
    tensor-parallel shards keep the torch ops (`decode_rows_apply`)."""
    cfg, model = _tiny()
    assert model.decode_rows_apply()
    ids = torch.tensor([5, cfg.image_token_id, cfg.audio_token_id, 17], device=DEV)
    pos = torch.tensor([0, 3, 9, 63], device=DEV)
    h = torch.empty(4, cfg.hidden_size, dtype=model.dtype, device=DEV)
    rope = {s: (torch.empty(4, c.shape[1], dtype=c.dtype, device=DEV), torch.empty(4, c.shape[1], dtype=c.dtype,
            device=DEV)) for s, (c, _) in model.rope.tables.items()}  # fmt: skip
    model.decode_rows(ids, pos, h, rope)
    assert torch.equal(h, model.embed(ids)[0])
    for s, (c, sn) in model.rope.lookup(pos).items():
        assert torch.equal(rope[s][0], c) and torch.equal(rope[s][1], sn)
    assert not _tiny("tiny-e2b")[1].decode_rows_apply()


def test_model_logits_greedy():
    """`logits(h, out, greedy)`: the soft-capped logits of the plain call (to fp32 rounding of the tanh under the
    interpreter) and each row's argmax."""
    cfg, model = _tiny()
    h = torch.randn(3, cfg.hidden_size, device=DEV).to(model.dtype)
    ref = model.logits(h)
    greedy = dio.GreedyIds.new(4, cfg.vocab_size, DEV)
    out = torch.empty(4, cfg.vocab_size, device=DEV)
    got = model.logits(h, out=out[:3], greedy=greedy.head(3))
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-5)
    assert torch.equal(greedy.ids[:3], got.argmax(-1))


def test_sample_on_device_takes_greedy_ids():
    """The sampler keeps given greedy ids for greedy rows and draws the others into them."""
    from perfkit.runtime.sampling import sample_on_device
    from perfkit.runtime.scheduler import SamplingParams

    logits = torch.randn(3, 50)
    greedy = torch.tensor([7, 8, 9])
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1), SamplingParams()]
    ids = sample_on_device(logits, params, [None, None, None], greedy=greedy)
    assert ids is greedy and ids.tolist() == [7, int(logits[1].argmax()), 9]


def test_sm90_compile():
    """Both kernels compile for sm_90 ahead of time (libdevice's tanh, the counter's atomics, PDL) without spills."""
    from aot import sm90_rows

    rows = sm90_rows(_SM90_COMPILE)
    assert all(isinstance(r, list) for r in rows), rows
    assert all(r[1] == 0 for r in rows), rows  # no stack (spills)


_SM90_COMPILE = """
import json
from perfkit.kernels import decode_io as d

def compile(fn, sig, consts, warps):
    try:
        k = sm90_compile(fn, sig, consts, warps)
        assert "griddepcontrol.wait" in k.asm["ptx"]
        return list(resource_usage(k))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:2000]

rows = []
sig = {"z_ptr": "*bf16", "out_ptr": "*fp32", "val_ptr": "*fp32", "idx_ptr": "*i32", "count_ptr": "*i32",
       "ids_ptr": "*i64", "V": "i32", "stride_z": "i32", "stride_o": "i32", "inv_cap": "fp32", "cap": "fp32"}
for cap in (1, 0):
    rows.append(compile(d._softcap_argmax_kernel, sig, {"HAS_CAP": cap, "BLOCK": d.ARGMAX_BLOCK, "BLOCK_P": 128,
                                                        "INTERP": 0, "PDL": 1}, 4))
sig = {"ids_ptr": "*i64", "pos_ptr": "*i64", "src_ptr": "*i64", "prev_ptr": "*i64", "emb_ptr": "*bf16",
       "h_ptr": "*bf16"}
sig |= dict.fromkeys(("ca_ptr", "sa_ptr", "ca_out", "sa_out", "cb_ptr", "sb_ptr", "cb_out", "sb_out"), "*bf16")
sig |= dict.fromkeys(("H", "DA", "DB", "stride_emb", "stride_h"), "i32") | {"scale": "fp32"}
sig |= dict.fromkeys(("pad_id", "image_id", "video_id", "audio_id"), "i32")
rows.append(compile(d._decode_rows_kernel, sig, {"HAS_B": 1, "BLOCK_H": 1024, "BLOCK_D": 256, "HAS_SRC": 1,
                                                 "PDL": 1}, 4))
print(json.dumps(rows))
"""


# ---- GPU: bit for bit against the torch ops, captured, and the engine ----------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("R", [1, 7, 64])
def test_gpu_softcap_argmax_bit_for_bit(R):
    """At the real vocabulary (262144, bf16 LM head output): the logits equal torch's copy / div_ / tanh_ / mul_
    bit for bit, the ids torch's argmax; a captured launch replayed on new z agrees too, counters at zero."""
    V = 262144
    greedy = dio.GreedyIds.new(64, V, DEV)
    out = torch.empty(64, V, device=DEV)
    for seed in range(3):
        z = _z(R, V, seed=seed)
        dio.softcap_argmax(z, 30.0, out[:R], greedy.head(R))
        ref = torch.empty(R, V, device=DEV).copy_(z).div_(30.0).tanh_().mul_(30.0)
        assert torch.equal(out[:R], ref)
        assert torch.equal(greedy.ids[:R], ref.argmax(-1))
    z_static = _z(R, V, seed=10)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dio.softcap_argmax(z_static, 30.0, out[:R], greedy.head(R), pdl=True)
    for seed in (11, 12):
        z_static.copy_(_z(R, V, seed=seed))
        graph.replay()
        ref = z_static.float().div(30.0).tanh().mul(30.0)
        assert torch.equal(out[:R], ref) and torch.equal(greedy.ids[:R], ref.argmax(-1))
    assert not greedy.count.any()


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_rows_real_shapes():
    """31B's table (262144 x 5376 bf16) and RoPE widths (128 sliding, 256 full): bit for bit the torch ops."""
    from perfkit.runtime.model import RopeTables
    from perfkit.runtime.model_config import get_preset

    cfg = get_preset("31b", num_layers=2)
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size, device=DEV).to(torch.bfloat16)
    rope = RopeTables(cfg, 4096, DEV, torch.bfloat16)
    tables = [rope.tables[True], rope.tables[False]]
    for B in (1, 13, 64):
        ids = torch.randint(0, cfg.vocab_size, (B,), device=DEV)
        ids[0] = cfg.image_token_id
        pos = torch.randint(0, 4096, (B,), device=DEV)
        h = torch.empty(B, cfg.hidden_size, dtype=torch.bfloat16, device=DEV)
        out = [(torch.empty(B, c.shape[1], dtype=c.dtype, device=DEV), torch.empty_like(c[:B])) for c, _ in tables]
        tok = (cfg.pad_token_id, cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id)
        dio.decode_rows(ids, pos, emb, 73.5, tok, h, tables, out)
        h_ref, rope_ref = dio.decode_rows_reference(ids, pos, emb, 73.5, tok, tables)
        assert torch.equal(h, h_ref)
        assert all(torch.equal(a, b) and torch.equal(c, e) for (a, c), (b, e) in zip(out, rope_ref, strict=True))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("preset", ["31b", "26b-a4b"])
def test_gpu_engine_tokens_identical_with_decode_io(preset):
    """decode_io fused gives the separate arm's tokens (greedy), with the host page tables (the graphs read the
    step's one upload in place) and the padded ones (the per-step uploads and copies), also switched on a live
    engine; the graphs took the fused launches and left the counters at zero."""
    from test_paged_decode import _toggle_arm_tokens

    def used_fused(e):
        g = e.runner.graphs
        assert g is not None and (g.greedy is not None) == e.ec.decode_io
        assert (g.inputs is not None) == (e.ec.decode_io and e.ec.page_table == "host")  # graph_inputs.py
        if g.greedy is not None:
            assert not g.greedy.count.any()

    arms = [{"decode_io": False}, {"decode_io": True}, {"decode_io": True, "page_table": "padded"}]
    outs = _toggle_arm_tokens(preset, arms, "decode_io", "fused", 3, 300, 512, after=used_fused)
    assert outs[0] == outs[1] == outs[2] == outs[3]


@pytest.mark.gpu
@needs_cuda
def test_gpu_engine_sampled_rows_with_decode_io():
    """Greedy and seeded temperature / top-k / top-p requests in one batch: the same tokens with decode_io fused
    and separate (the sampled rows are drawn from the same logits into the graph's greedy ids)."""
    pytest.importorskip("flashinfer")
    from perfkit.kernels.pdl import pdl_available
    from perfkit.runtime.engine import Engine, EngineConfig
    from perfkit.runtime.model_config import get_preset
    from perfkit.runtime.scheduler import SamplingParams
    from perfkit.runtime.weights import build_model

    cfg = get_preset("31b", num_layers=2)
    model = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    rng = random.Random(5)
    reqs = [[rng.randint(3, 250_000) for _ in range(rng.randint(1, 100))] for _ in range(6)]
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, seed=1), SamplingParams(),
              SamplingParams(temperature=1.0, top_p=0.9, seed=2), SamplingParams(temperature=0.7), SamplingParams()]
    outs = []
    for fused in (False, True):
        e = Engine(model, cfg, EngineConfig(attention="flashinfer", cuda_graphs=True, max_batch_size=8,
                                            max_num_tokens=256, num_kv_pages=500, max_model_len=512,
                                            fused_kernels=True, pdl=pdl_available(DEV), decode_io=fused))  # fmt: skip
        rids = [e.add_request(p, max_new_tokens=12, sampling=s) for p, s in zip(reqs, params, strict=True)]
        got = e.generate_all()
        outs.append([got[r] for r in rids])
    assert outs[0] == outs[1]


@pytest.mark.gpu
@needs_cuda
def test_gpu_engine_large_batches_with_decode_io():
    """Decode batches of 9-40 rows (FlashInfer's decode, whose graph wrappers plan from the one upload's page ids):
    decode_io fused gives the separate arm's greedy tokens on a 31B 2-layer engine."""
    pytest.importorskip("flashinfer")
    from perfkit.kernels.pdl import pdl_available
    from perfkit.runtime.engine import Engine, EngineConfig
    from perfkit.runtime.model_config import get_preset
    from perfkit.runtime.weights import build_model

    cfg = get_preset("31b", num_layers=2)
    model = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    rng = random.Random(9)
    reqs = [[rng.randint(3, 250_000) for _ in range(rng.randint(1, 300))] for _ in range(40)]
    outs = []
    for fused in (False, True):
        e = Engine(model, cfg, EngineConfig(attention="flashinfer", cuda_graphs=True, max_batch_size=48,
                                            max_num_tokens=2048, num_kv_pages=3000, max_model_len=1024,
                                            fused_kernels=True, pdl=pdl_available(DEV), decode_io=fused))  # fmt: skip
        assert (e.runner.graphs.inputs is not None) == fused
        rids = [e.add_request(p, max_new_tokens=6 + i % 7) for i, p in enumerate(reqs)]
        got = e.generate_all()
        e.bm.check_no_leaks()
        outs.append([got[r] for r in rids])
    assert outs[0] == outs[1]
