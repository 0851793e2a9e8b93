"""Tensor parallelism on the CPU: 2 gloo ranks (file rendezvous, loopback sockets) give exactly the TP=1 greedy
tokens and (to fp32 summation order) the TP=1 logits for a tiny config of every family: dense K=V (tiny), MoE
(tiny-moe), PLE + KV sharing (tiny-e2b with PLE replicated and sharded, tiny-e4b); the serving engine with the
torch paged backend on a sharded model gives the reference tokens; build_sharded_model equals slicing the full
seeded model; head splits replicate KV heads when there are fewer than ranks; the torchrun relaunch works."""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import sys

import pytest
import torch

from perfkit.errors import PerfkitError
from perfkit.runtime.kv_cache import pool_specs
from perfkit.runtime.model_config import get_preset
from perfkit.runtime.tp import ShardedGemma4Config, build_sharded_model, head_ranges, shard_slices
from perfkit.runtime.weights import build_model

FAMILIES = ("tiny", "tiny-moe", "tiny-e2b", "tiny-e4b")
PROMPT = [2, *range(40, 62)]  # 23 tokens: the MoE prefill has T*K = 92 > 64 rows (sharded sorted path)
STEPS = 16


# ---- pure partitioning -----------------------------------------------------------------------------------------
def test_head_ranges_split_and_replicate():
    # 31B sliding layers at TP=2: 16 query / 8 KV heads per rank
    assert head_ranges(32, 16, 1, 2) == ((16, 32), (8, 16))
    # 31B full layers at TP=8: 4 KV heads for 8 ranks -> one KV head per rank, each on 2 ranks
    got = [head_ranges(32, 4, r, 8) for r in range(8)]
    assert [q for q, _ in got] == [(4 * r, 4 * r + 4) for r in range(8)]
    assert [kv for _, kv in got] == [(r // 2, r // 2 + 1) for r in range(8)]
    # tiny full layers (1 KV head) at TP=2: replicated
    assert head_ranges(4, 1, 1, 2) == ((2, 4), (0, 1))
    with pytest.raises(PerfkitError, match="not divisible"):
        head_ranges(4, 2, 0, 8)
    with pytest.raises(PerfkitError, match="whole KV heads"):
        head_ranges(6, 3, 0, 2)  # 3 query heads per rank straddle KV heads 0 and 1


def test_sharded_config_sizes_engine_pools():
    cfg = get_preset("31b")
    full = pool_specs(cfg.attn_layers())
    for world in (2, 8):
        sc = ShardedGemma4Config.of(cfg, world - 1, world)
        specs = pool_specs(sc.attn_layers())
        assert specs["sliding"].num_heads == 32 // world and specs["sliding"].num_kv_heads == 16 // world
        assert specs["full"].num_heads == 32 // world and specs["full"].num_kv_heads == max(1, 4 // world)
        assert specs["full"].cache_layers == full["full"].cache_layers
        assert sc.full_config() == cfg and sc.hidden_size == cfg.hidden_size
    moe = ShardedGemma4Config.of(get_preset("26b-a4b"), 0, 2)
    assert pool_specs(moe.attn_layers())["full"].num_kv_heads == 1


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-e2b"])
def test_build_sharded_model_equals_slicing(name):
    cfg = get_preset(name)
    full = build_model(cfg, "cpu", torch.float32, seed=3).state_dict()
    for world, ple in ((2, "shard"), (4, "replicate")):
        for rank in range(world):
            slices = shard_slices(cfg, rank, world, ple)
            shard = build_sharded_model(cfg, rank, world, "cpu", torch.float32, seed=3, ple=ple).state_dict()
            assert shard.keys() == full.keys()
            for k, t in shard.items():
                want = slices[k](full[k]) if k in slices else full[k]
                assert torch.equal(t, want), (name, world, rank, k)
    with pytest.raises(PerfkitError, match="not divisible by the world size 3"):
        shard_slices(cfg, 0, 3)


# ---- 2 gloo ranks ----------------------------------------------------------------------------------------------
def _staggered(engine, prompts, max_new):
    rid_of, out, step = {}, {}, 0
    while len(rid_of) < len(prompts) or engine.has_unfinished():
        for i, p in enumerate(prompts):
            if i not in rid_of and i <= step:  # prompt i arrives before step i
                rid_of[i] = engine.add_request(p, max_new_tokens=max_new[i])
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
        assert step < 2000
    return [out[rid_of[i]] for i in range(len(prompts))]


def _rank_setup(rank: int, world: int, port: int) -> None:
    """torchrun's environment for a spawned rank: rendezvous and gloo sockets on the loopback interface only; a C++
    abort prints every thread's Python stack."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")  # fmt: skip
    torch.set_num_threads(1)
    faulthandler.enable(all_threads=True)


def _rank_exit() -> None:
    """Leave a rank that finished without interpreter finalization: CI once saw a rank abort ("terminate called
    without an active exception", not reproduced here), which gloo's threads tearing down with the interpreter can
    do; if an abort comes from elsewhere, faulthandler prints the stacks."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank: int, world: int, port: int, out_file: str) -> None:
    _rank_setup(rank, world, port)
    from perfkit.runners.tp_launch import init_tp
    from perfkit.runtime.attention.contiguous import ContiguousAttention
    from perfkit.runtime.engine import Engine, EngineConfig
    from perfkit.runtime.generate import greedy_generate
    from perfkit.runtime.tp import shard_model_

    ctx = init_tp("cpu")
    try:
        assert (ctx.rank, ctx.world_size, ctx.backend) == (rank, world, "gloo")
        ids = torch.tensor(PROMPT)
        res: dict = {}

        def logits_of(m):
            attn = ContiguousAttention()
            attn.prepare(len(PROMPT))
            return m(ids, torch.arange(len(PROMPT)), attn)

        for name, ple in [(n, "replicate") for n in FAMILIES] + [("tiny-e2b", "shard")]:
            cfg = get_preset(name)
            model = build_model(cfg, "cpu", torch.float32, seed=0)
            ref_tokens, ref_logits = greedy_generate(model, PROMPT, STEPS), logits_of(model)
            shard_model_(model, rank, world, ple=ple)
            res[f"{name}/{ple}"] = dict(
                ref=ref_tokens, tp=greedy_generate(model, PROMPT, STEPS),
                logits_err=float((logits_of(model) - ref_logits).abs().max()),
                kv_heads=[la.num_kv_heads for la in model.attn_layers],
                q_rows=model.layers[0].self_attn.q_proj.weight.shape[0],
            )  # fmt: skip

        # FP8 quantisation of the shards (shard -> quantize_model_ -> reattach_tp_) vs the quantised TP=1 model.
        # Scales of the row-parallel o_proj/down_proj come from half their columns, so close (FP8 noise), not equal.
        from perfkit.runtime.quant import quantize_model_
        from perfkit.runtime.tp import reattach_tp_

        for name in ("tiny", "tiny-moe"):
            cfg = get_preset(name)
            model = build_model(cfg, "cpu", torch.float32, seed=0)
            quantize_model_(model, "fp8")
            ref_logits = logits_of(model)
            model = build_model(cfg, "cpu", torch.float32, seed=0)
            shard_model_(model, rank, world)
            quantize_model_(model, "fp8")
            # swapped-in modules without the all-reduce (MoE: global expert ids would not even index)
            missing = float((logits_of(model) - ref_logits).abs().max()) if name == "tiny" else None
            res[f"fp8/{name}"] = dict(
                rewrapped=reattach_tp_(model), err=float((logits_of(model) - ref_logits).abs().max()), missing=missing
            )

        # the serving engine (torch paged backend, chunked prefill, mixed batches) on a sharded MoE model
        cfg = get_preset("tiny-moe")
        model = build_model(cfg, "cpu", torch.float32, seed=1)
        prompts = [PROMPT[: 5 + 6 * i] for i in range(3)]
        max_new = [6, 9, 4]
        ref = [greedy_generate(model, p, n) for p, n in zip(prompts, max_new, strict=True)]
        shard_model_(model, rank, world)
        ec = EngineConfig(attention="torch", page_size=4, max_batch_size=4, max_num_tokens=12, num_kv_pages=64,
                          cuda_graphs=False, mask="dense", max_model_len=128)  # fmt: skip
        engine = Engine(model, model.cfg, ec)
        res["engine"] = dict(
            ref=ref, tp=_staggered(engine, prompts, max_new), kv_heads=engine.kv.specs["sliding"].num_kv_heads
        )
        # fused layers on the shards: q|k|v and gate|up merged per rank (the shards are plain nn.Linear)
        fused = Engine(model, model.cfg, dataclasses.replace(ec, fused_kernels=True))
        res["engine"]["tp_fused"] = _staggered(fused, prompts, max_new)
        res["engine"]["qkv_rows"] = [dl.self_attn.merged_weight().shape[0] for dl in model.layers]
        fused.model.set_fused(False)
        # control-plane helpers the TP runner uses
        res["control"] = dict(
            bcast=ctx.broadcast_object({"submit": 3} if rank == 0 else None), min=ctx.min_int(10 + rank)
        )
        ctx.assert_identical(res["engine"]["tp"], "engine tokens")
        try:
            ctx.assert_identical(rank, "rank")
            res["control"]["diverged"] = False
        except RuntimeError:
            res["control"]["diverged"] = True
        if rank == 0:
            torch.save(res, out_file)
    finally:
        ctx.shutdown()
    _rank_exit()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    import torch.multiprocessing as mp

    from perfkit.runners.tp_launch import free_loopback_port

    d = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(2, free_loopback_port(), str(d / "out.pt")), nprocs=2, join=True)
    return torch.load(d / "out.pt")


@pytest.mark.parametrize("key", [f"{n}/replicate" for n in FAMILIES] + ["tiny-e2b/shard"])
def test_tp2_greedy_matches_tp1(two_rank_results, key):
    r = two_rank_results[key]
    assert r["tp"] == r["ref"] and len(r["ref"]) == STEPS
    assert r["logits_err"] < 1e-4
    cfg = get_preset(key.split("/")[0])
    assert r["q_rows"] == cfg.num_attention_heads // 2 * cfg.head_dim
    assert r["kv_heads"] == [max(1, la.num_kv_heads // 2) for la in cfg.attn_layers()]


def test_tp2_quantized_shards_keep_their_all_reduce(two_rank_results):
    dense, moe = two_rank_results["fp8/tiny"], two_rank_results["fp8/tiny-moe"]
    assert dense["rewrapped"] == 2 * 6 and moe["rewrapped"] == 3 * 6  # o_proj, down_proj (+ experts) per layer
    assert dense["err"] < dense["missing"] / 2


def test_tp2_engine_matches_tp1(two_rank_results):
    r = two_rank_results["engine"]
    assert r["tp"] == r["ref"] and r["tp_fused"] == r["ref"]
    assert r["kv_heads"] == 1  # tiny-moe sliding layers: 2 KV heads over 2 ranks
    # per rank: 2 of 4 query heads + 1 KV head (+ 1 v head on sliding layers; full layers are K=V)
    cfg = get_preset("tiny-moe")
    assert r["qkv_rows"] == [(2 + (2 if la.is_sliding else 1)) * la.head_dim for la in cfg.attn_layers()]


def _worker4(rank: int, world: int, port: int, out_file: str) -> None:
    """World 4 on tiny / tiny-moe: one query head per rank, the full layers' single KV head on all 4 ranks."""
    _rank_setup(rank, world, port)
    from perfkit.runners.tp_launch import init_tp
    from perfkit.runtime.generate import greedy_generate

    ctx = init_tp("cpu")
    try:
        res = {}
        for name in ("tiny", "tiny-moe"):
            cfg = get_preset(name)
            ref = greedy_generate(build_model(cfg, "cpu", torch.float32, seed=0), PROMPT, STEPS)
            model = build_sharded_model(cfg, rank, world, "cpu", torch.float32, seed=0)
            res[name] = (ref, greedy_generate(model, PROMPT, STEPS), [la.num_heads for la in model.attn_layers])
        if rank == 0:
            torch.save(res, out_file)
    finally:
        ctx.shutdown()
    _rank_exit()


def test_tp4_built_shards_match_tp1(tmp_path):
    import torch.multiprocessing as mp

    from perfkit.runners.tp_launch import free_loopback_port

    mp.spawn(_worker4, args=(4, free_loopback_port(), str(tmp_path / "out.pt")), nprocs=4, join=True)
    for name, (ref, got, heads) in torch.load(tmp_path / "out.pt").items():
        assert got == ref, name
        assert set(heads) == {1}


def test_tp_control_helpers(two_rank_results):
    assert two_rank_results["control"] == {"bcast": {"submit": 3}, "min": 10, "diverged": True}


# ---- launcher -----------------------------------------------------------------------------------------------------
def test_torchrun_command_and_env(monkeypatch):
    from perfkit.runners import tp_launch

    cmd = tp_launch.torchrun_command(2, ["run", "cfg.yaml", "--tp", "2"], port=29555)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and cmd[cmd.index("--master-addr") + 1] == "127.0.0.1"
    assert cmd[-6:] == ["-m", "perfkit.runners.tp_launch", "run", "cfg.yaml", "--tp", "2"]
    assert tp_launch.torchrun_env({"NCCL_NVLS_ENABLE": "1"})["NCCL_NVLS_ENABLE"] == "0"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert tp_launch.maybe_relaunch(1) is None and tp_launch.is_rank0() and tp_launch.world_size() == 1
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert tp_launch.maybe_relaunch(2) is None and not tp_launch.is_rank0()  # already a rank: carry on
    with pytest.raises(PerfkitError, match="WORLD_SIZE=2"):
        tp_launch.maybe_relaunch(4)


def test_relaunch_runs_two_ranks(capfd):
    from perfkit.runners import tp_launch

    rc = tp_launch.relaunch(2, ["generate", "--model", "tiny", "--max-new-tokens", "2", "--json"])
    assert rc == 0
    assert capfd.readouterr().out.count('"token_ids"') == 2  # the CLI ran once per rank
