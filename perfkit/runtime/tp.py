"""Tensor parallelism (Megatron style) for Gemma4ForCausalLM over torch.distributed (NCCL on GPUs, gloo on CPU).

The model code (model.py) is not TP-aware: `shard_model_` rewrites a built model from the outside, by parameter
name, into one rank's shard. State-dict names stay those of the full model, so HF checkpoints and the seeded
random init map onto shards by slicing (`shard_slices`). What each rank holds and what it communicates:

  embed_tokens [V, H]            vocab-parallel: rows [r*V/w, (r+1)*V/w) (padded with zero rows when w does not
                                 divide V); lookup = masked local lookup + all-reduce (exact: one rank owns a row)
  LM head (tied embed_tokens)    local logits [N, V/w] (weight dtype) -> all-gather -> fp32 -> final soft-cap;
                                 every rank ends with the same full logits, so every rank samples the same tokens
  q_proj / k_proj / v_proj       column-parallel by head: rank r gets query heads [r*nh/w, (r+1)*nh/w) and the KV
                                 heads those query heads read. With fewer KV heads than ranks (31B full layers at
                                 TP=8: 4 KV heads; tiny configs) each KV head is replicated on w/kvh ranks. K=V
                                 full layers have no v_proj; k_proj is sliced the same way.
  o_proj                         row-parallel (input columns of this rank's heads) + all-reduce of the output
  mlp gate/up, down              column-parallel over the intermediate dim; down row-parallel + all-reduce
  MoE experts [E, ...]           expert-parallel: rank r holds experts [r*E/w, (r+1)*E/w) and computes their
                                 weighted contributions for every token, then all-reduce. The router (proj, scale,
                                 per_expert_scale) is replicated: every rank computes the same top-k.
  PLE (E2B/E4B)                  ple="replicate" (default): embed_tokens_per_layer, per_layer_model_projection and
                                 the per-layer gate/projection are replicated (no communication; the table is
                                 ~4.7 GB bf16 for E2B, fine on an H200). ple="shard": embed_tokens_per_layer is
                                 vocab-parallel like embed_tokens (masked lookup + all-reduce of [T, L*P]).
  norms, layer_scalar, RoPE      replicated. The vision tower is not part of this model; it stays replicated.

Attention sees per-rank head counts: every `self_attn.layer` (the AttnLayer the model hands to `attn.attend`)
and `model.attn_layers` are replaced by per-rank AttnLayers, and `model.cfg` becomes a `ShardedGemma4Config`
whose `attn_layers()` returns them, so the engine (`Engine(model, model.cfg, ...)`: KV pools, FlashInfer plans)
and the contiguous backend size everything per rank. Other config fields keep the full-model values.

Collectives per decoder layer: 2 all-reduces of [T, H] (attention, dense MLP), +1 on MoE layers; +1 all-reduce
of [T, H] for the embedding and 1 all-gather of [N, V/w] for the logits per forward. Every rank must run the
same forwards in the same order (identical scheduling); see perfkit/runners/tp_launch.py and docs/tp.md.

Numerics: row-parallel partial sums are added by the all-reduce, so results equal TP=1 up to float summation
order (fp32: ~1e-7 relative, greedy tokens identical in the CPU tests; bf16: not bit-identical to TP=1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from perfkit.errors import PerfkitError
from perfkit.runtime.attention.base import AttnLayer
from perfkit.runtime.model import Gemma4ForCausalLM
from perfkit.runtime.model_config import Gemma4Config

__all__ = [
    "ShardedGemma4Config",
    "TPInfo",
    "build_sharded_model",
    "head_ranges",
    "reattach_tp_",
    "shard_attn_layer",
    "shard_model_",
    "shard_slices",
    "tp_summary",
]

PLE_MODES = ("replicate", "shard")


# ---- partitioning arithmetic ----------------------------------------------------------------------------------
def _even_range(n: int, rank: int, world: int, what: str) -> tuple[int, int]:
    if n % world:
        raise PerfkitError(f"tensor parallelism: {what} = {n} is not divisible by the world size {world}")
    k = n // world
    return rank * k, (rank + 1) * k


def _padded_range(n: int, rank: int, world: int) -> tuple[int, int, int]:
    """Rows [lo, hi) of an n-row table held by `rank` when each rank holds ceil(n/w) rows (last ones padded)."""
    per = -(-n // world)
    lo = min(rank * per, n)
    return lo, min(lo + per, n), per


def head_ranges(num_heads: int, num_kv_heads: int, rank: int, world: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((q_lo, q_hi), (kv_lo, kv_hi)): the query heads of `rank` and the KV heads they read (GQA group = nh/kvh).

    kvh >= world: kvh/world KV heads per rank, no replication. kvh < world: one KV head per rank, replicated on
    world/kvh ranks. Raises when the local query heads would not form whole GQA groups of the local KV heads."""
    if num_heads % num_kv_heads:
        raise PerfkitError(f"tensor parallelism: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    q_lo, q_hi = _even_range(num_heads, rank, world, "num_attention_heads")
    group = num_heads // num_kv_heads
    kv_lo, kv_hi = q_lo // group, (q_hi - 1) // group + 1
    nq, nkv = q_hi - q_lo, kv_hi - kv_lo
    ok = nq % nkv == 0 and all((q_lo + i) // group - kv_lo == i // (nq // nkv) for i in range(nq))
    if not ok:
        raise PerfkitError(
            f"tensor parallelism: {num_heads} query / {num_kv_heads} KV heads cannot be split over {world} ranks "
            "(each rank's query heads must read whole KV heads)"
        )
    return (q_lo, q_hi), (kv_lo, kv_hi)


def shard_attn_layer(layer: AttnLayer, rank: int, world: int) -> AttnLayer:
    """The AttnLayer a backend sees on `rank`: num_heads / num_kv_heads of this rank's shard."""
    (q_lo, q_hi), (kv_lo, kv_hi) = head_ranges(layer.num_heads, layer.num_kv_heads, rank, world)
    return dataclasses.replace(layer, num_heads=q_hi - q_lo, num_kv_heads=kv_hi - kv_lo)


@dataclass(frozen=True)
class ShardedGemma4Config(Gemma4Config):
    """A Gemma4Config whose `attn_layers()` describes one TP rank's attention (per-rank head counts). Every
    other field keeps the full-model value (hidden size, vocab, counts used by param_count / roofline)."""

    tp_rank: int = 0
    tp_world_size: int = 1

    def attn_layers(self) -> list[AttnLayer]:
        return [shard_attn_layer(la, self.tp_rank, self.tp_world_size) for la in super().attn_layers()]

    def full_config(self) -> Gemma4Config:
        """The unsharded config (TP=1 view)."""
        names = {f.name for f in dataclasses.fields(Gemma4Config)}
        return Gemma4Config(**{n: getattr(self, n) for n in names})

    @classmethod
    def of(cls, cfg: Gemma4Config, rank: int, world: int) -> ShardedGemma4Config:
        if isinstance(cfg, ShardedGemma4Config):
            raise PerfkitError("config is already sharded")
        names = {f.name for f in dataclasses.fields(Gemma4Config)}
        return cls(**{n: getattr(cfg, n) for n in names}, tp_rank=rank, tp_world_size=world)


@dataclass(frozen=True)
class TPInfo:
    rank: int
    world_size: int
    group: Any = None  # torch.distributed ProcessGroup; None = the default (WORLD) group
    vocab_start: int = 0  # first embed_tokens row held by this rank
    experts_per_rank: int = 0  # MoE: this rank holds experts [rank * experts_per_rank, (rank + 1) * ...)
    ple_vocab_start: int | None = None  # first embed_tokens_per_layer row (ple="shard"), else None


# ---- which rows/cols of each full tensor a rank holds --------------------------------------------------------
Slice = Callable[[Tensor], Tensor]


def _rows(lo: int, hi: int, dim: int = 0, pad_to: int | None = None) -> Slice:
    def f(t: Tensor) -> Tensor:
        s = t.narrow(dim, lo, hi - lo)
        if pad_to is not None and pad_to > hi - lo:
            shape = list(s.shape)
            shape[dim] = pad_to - (hi - lo)
            s = torch.cat([s, s.new_zeros(shape)], dim=dim)
        return s

    return f


def shard_slices(cfg: Gemma4Config, rank: int, world: int, ple: str = "replicate") -> dict[str, Slice]:
    """{full state-dict name: full tensor -> this rank's tensor} for every sharded tensor; absent names are
    replicated. The same table shards a built model, a seeded random init and an HF checkpoint."""
    if ple not in PLE_MODES:
        raise PerfkitError(f"ple={ple!r}; allowed: {', '.join(PLE_MODES)}")
    out: dict[str, Slice] = {}
    lo, hi, per = _padded_range(cfg.vocab_size, rank, world)
    out["embed_tokens.weight"] = _rows(lo, hi, 0, per)
    if cfg.has_ple and ple == "shard":
        lo, hi, per = _padded_range(cfg.vocab_size_per_layer_input, rank, world)
        out["embed_tokens_per_layer.weight"] = _rows(lo, hi, 0, per)
    for la in cfg.attn_layers():
        i, hd = la.index, la.head_dim
        p = f"layers.{i}."
        (q_lo, q_hi), (kv_lo, kv_hi) = head_ranges(la.num_heads, la.num_kv_heads, rank, world)
        out[p + "self_attn.q_proj.weight"] = _rows(q_lo * hd, q_hi * hd)
        out[p + "self_attn.o_proj.weight"] = _rows(q_lo * hd, q_hi * hd, dim=1)
        if la.writes_kv:
            out[p + "self_attn.k_proj.weight"] = _rows(kv_lo * hd, kv_hi * hd)
            if not cfg.layer_k_eq_v(i):
                out[p + "self_attn.v_proj.weight"] = _rows(kv_lo * hd, kv_hi * hd)
        i_lo, i_hi = _even_range(cfg.layer_intermediate_size(i), rank, world, f"layer {i} intermediate_size")
        out[p + "mlp.gate_proj.weight"] = _rows(i_lo, i_hi)
        out[p + "mlp.up_proj.weight"] = _rows(i_lo, i_hi)
        out[p + "mlp.down_proj.weight"] = _rows(i_lo, i_hi, dim=1)
        if cfg.enable_moe_block:
            e_lo, e_hi = _even_range(cfg.num_experts, rank, world, "num_experts")
            out[p + "experts.gate_up_proj"] = _rows(e_lo, e_hi)
            out[p + "experts.down_proj"] = _rows(e_lo, e_hi)
    return out


# ---- communication ----------------------------------------------------------------------------------------------
def _all_reduce(x: Tensor, tp: TPInfo) -> Tensor:
    if tp.world_size > 1:
        dist.all_reduce(x, group=tp.group)
    return x


def _all_gather_last(x: Tensor, tp: TPInfo) -> Tensor:
    """[N, n] on every rank -> [N, world*n] (rank order) on every rank."""
    if tp.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.world_size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


def vocab_parallel_embedding(ids: Tensor, weight: Tensor, start: int, tp: TPInfo) -> Tensor:
    """F.embedding(ids, full_table) from row shards: rows outside [start, start + len(weight)) are zero locally and
    filled by the owning rank's all-reduce contribution (exact: x + 0)."""
    local = ids - start
    inside = (local >= 0) & (local < weight.shape[0])
    out = F.embedding(torch.where(inside, local, 0), weight)
    out = out.masked_fill(~inside[..., None], 0)
    return _all_reduce(out, tp)


# ---- module patches (class swaps keep the instance, its parameter names and any other behaviour) -------------
_CLASS_CACHE: dict[tuple[type, type], type] = {}


def _swap_class(module: nn.Module, mixin: type) -> None:
    cls = type(module)
    if issubclass(cls, mixin):
        return
    key = (mixin, cls)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = type(mixin.__name__.lstrip("_") + cls.__name__, (mixin, cls), {})
    module.__class__ = _CLASS_CACHE[key]


class _RowParallel:
    """Row-parallel linear: the wrapped module's output is this rank's partial sum; all-reduce completes it."""

    tp: TPInfo

    def forward(self, x: Tensor) -> Tensor:
        return _all_reduce(super().forward(x), self.tp)  # type: ignore[misc]


class _ExpertParallel:
    """The wrapped experts module holds experts [tp_expert_start, + num local). Router indices are global:
    pairs routed elsewhere get weight 0 (small batches: no host sync, CUDA-graph safe) or are dropped before
    the experts run (large batches on the PyTorch path: one host sync, like its sorted path; the fused Triton
    path is sync-free for any batch and always takes the zero-weight form). Then all-reduce."""

    tp: TPInfo
    tp_expert_start: int
    tp_num_local_experts: int

    def forward(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        local = idx - self.tp_expert_start
        mine = (local >= 0) & (local < self.tp_num_local_experts)
        base = super().forward  # type: ignore[misc]
        if getattr(self, "fused", False) or idx.numel() <= getattr(self, "gather_max_rows", 64):
            y = base(x, torch.where(mine, local, 0), torch.where(mine, w, torch.zeros_like(w)))
        else:
            tok, slot = mine.nonzero(as_tuple=True)
            y = torch.zeros_like(x)
            if tok.numel():
                part = base(x[tok], local[tok, slot][:, None], w[tok, slot][:, None])  # [n, H], one pair per row
                y.index_add_(0, tok, part)
        return _all_reduce(y, self.tp)


class _TPModel:
    """Vocab-parallel embedding lookups and LM head on Gemma4ForCausalLM: overrides only the model's table-lookup
    and head hooks with their sharded forms; embed / per_layer_inputs / logits (mm merge, scales, soft-cap) are
    the model's own code."""

    tp: TPInfo
    cfg: Gemma4Config
    own_lookups = False  # decode_io's row launch reads the whole table: these models keep embed (decode_rows_apply)

    def _token_embeddings(self, text_ids: Tensor) -> Tensor:
        w = self.embed_tokens.weight  # type: ignore[attr-defined]
        return vocab_parallel_embedding(text_ids, w, self.tp.vocab_start, self.tp)

    def _per_layer_token_embeddings(self, text_ids: Tensor) -> Tensor:
        if self.tp.ple_vocab_start is None:  # replicated PLE table: the model's own lookup
            return super()._per_layer_token_embeddings(text_ids)  # type: ignore[misc]
        w = self.embed_tokens_per_layer.weight  # type: ignore[attr-defined]
        return vocab_parallel_embedding(text_ids, w, self.tp.ple_vocab_start, self.tp)

    def _lm_head(self, x: Tensor) -> Tensor:
        local = F.linear(x, self.embed_tokens.weight)  # type: ignore[attr-defined]  # [N, V/w]
        return _all_gather_last(local, self.tp)[:, : self.cfg.vocab_size]


def _set_param(module: nn.Module, name: str, value: Tensor) -> None:
    setattr(module, name, nn.Parameter(value, requires_grad=False))


def _hf_tensor(state: Any, name: str, shape: tuple[int, ...]) -> Tensor:
    """The full checkpoint tensor for our state-dict `name`, shape-checked (errors as weights.load_hf_weights_)."""
    key = state.text_name(name)
    if key is None:
        raise PerfkitError(f"checkpoint {state.path}: missing tensor {name} (under model.language_model. or model.), "
                           f"expected shape {list(shape)}")  # fmt: skip
    if tuple(state.shape(key)) != tuple(shape):
        raise PerfkitError(
            f"checkpoint {state.path}: tensor {key} has shape {list(state.shape(key))}, expected {list(shape)}"
        )
    return state[key]


# ---- public entry points ----------------------------------------------------------------------------------------
def shard_model_(
    model: Gemma4ForCausalLM, rank: int, world_size: int, group: Any = None, ple: str = "replicate"
) -> Gemma4ForCausalLM:
    """Turn a built full model (any device, incl. meta) into `rank`'s shard in place; returns it.

    Sharded parameters are replaced by contiguous copies of their slices (the full tensors are freed once no
    one else references them). Collectives use `group` (default: WORLD); torch.distributed must be initialised
    when world_size > 1 before the first forward, not before sharding."""
    if isinstance(model.cfg, ShardedGemma4Config):
        raise PerfkitError("model is already sharded")
    if not 0 <= rank < world_size:
        raise PerfkitError(f"tensor parallelism: rank {rank} outside world size {world_size}")
    cfg = model.cfg
    slices = shard_slices(cfg, rank, world_size, ple)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, f in slices.items():
            mod_name, _, pname = name.rpartition(".")
            _set_param(model.get_submodule(mod_name), pname, f(params[name].detach()).clone())
    tp = TPInfo(
        rank=rank, world_size=world_size, group=group, vocab_start=_padded_range(cfg.vocab_size, rank, world_size)[0],
        ple_vocab_start=_padded_range(cfg.vocab_size_per_layer_input, rank, world_size)[0]
        if cfg.has_ple and ple == "shard" else None,
        experts_per_rank=cfg.num_experts // world_size if cfg.enable_moe_block else 0,
    )  # fmt: skip
    model.embed_tokens.num_embeddings = model.embed_tokens.weight.shape[0]
    sharded_cfg = ShardedGemma4Config.of(cfg, rank, world_size)
    layers = sharded_cfg.attn_layers()
    for la, dl in zip(layers, model.layers, strict=True):
        attn = dl.self_attn
        attn.layer = la
        for lin in (attn.q_proj, getattr(attn, "k_proj", None), getattr(attn, "v_proj", None), dl.mlp.gate_proj,
                    dl.mlp.up_proj):  # fmt: skip
            if isinstance(lin, nn.Linear):
                lin.out_features = lin.weight.shape[0]
        for lin in (attn.o_proj, dl.mlp.down_proj):
            lin.in_features = lin.weight.shape[1]
    model.tp = tp
    model.cfg = sharded_cfg
    model.attn_layers = layers
    _swap_class(model, _TPModel)
    reattach_tp_(model)
    return model


def reattach_tp_(model: Gemma4ForCausalLM) -> int:
    """(Re-)wrap o_proj / down_proj as row-parallel and the experts as expert-parallel on a sharded model.
    `shard_model_` calls it; call it again after anything swaps those modules for new ones (quantize_model_
    replaces Linears and experts by setattr: shard first, quantise the shards, then reattach_tp_). Returns how
    many modules were (re-)wrapped. Without it the swapped-in modules would skip the all-reduce."""
    tp: TPInfo = model.tp
    n = 0
    for dl in model.layers:
        for parent, attr in ((dl.self_attn, "o_proj"), (dl.mlp, "down_proj")):
            m = getattr(parent, attr)
            if not isinstance(m, _RowParallel):
                m.tp = tp
                _swap_class(m, _RowParallel)
                n += 1
        ex = getattr(dl, "experts", None)
        if ex is not None and not isinstance(ex, _ExpertParallel):
            ex.tp = tp
            ex.tp_num_local_experts = tp.experts_per_rank
            ex.tp_expert_start = tp.rank * tp.experts_per_rank
            _swap_class(ex, _ExpertParallel)
            n += 1
    return n


def build_sharded_model(
    cfg: Gemma4Config,
    rank: int,
    world_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int = 0,
    weights: str = "random",
    path: str | Path | None = None,
    group: Any = None,
    ple: str = "replicate",
) -> Gemma4ForCausalLM:
    """Build only `rank`'s shard on `device`, without materialising the full model.

    weights="random": the same seeded stream as `weights.init_random_` on the full model (same device type and
    dtype): every full tensor is drawn in state-dict order into a temporary on `device` and sliced, so a shard
    equals slicing the full random model. weights="hf": every tensor is read from the checkpoint (CPU, memory-
    mapped) and sliced. Peak extra memory: the largest single full tensor (31B: embed_tokens, 2.8 GB bf16)."""
    from perfkit.runtime.weights import INIT_STD, open_weights

    device = torch.device(device)
    state = open_weights(weights, path)
    model = Gemma4ForCausalLM(cfg, device="meta", dtype=dtype)
    full_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    slices = shard_slices(cfg, rank, world_size, ple)
    shard_model_(model, rank, world_size, group, ple)
    model.to_empty(device=device)
    model.requires_grad_(False)
    gen = None
    if state is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
    target = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, shape in full_shapes.items():
            t = target[name]
            f = slices.get(name)
            if state is None:
                if len(shape) <= 1:
                    t.fill_(1.0)
                    continue
                full = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, INIT_STD, generator=gen)
            else:
                full = _hf_tensor(state, name, shape)
            t.copy_(f(full) if f is not None else full)
            del full
    model.eval()
    model.setup_rope()
    return model


def tp_summary(model: Gemma4ForCausalLM) -> dict[str, Any]:
    """What this rank holds, for the result's runtime section (JSON-ready). Works on unsharded models too."""
    tp: TPInfo | None = getattr(model, "tp", None)
    layers = model.cfg.attn_layers()
    pools = {("sliding" if la.is_sliding else "full"): (la.num_heads, la.num_kv_heads) for la in layers}
    out: dict[str, Any] = {
        "tp_world_size": 1 if tp is None else tp.world_size,
        "tp_rank": 0 if tp is None else tp.rank,
        "heads_per_rank": {p: h for p, (h, _) in pools.items()},
        "kv_heads_per_rank": {p: k for p, (_, k) in pools.items()},
        "vocab_rows_per_rank": model.embed_tokens.weight.shape[0],
        "weights_bytes_per_rank": sum(p.numel() * p.element_size() for p in model.parameters()),
        "ple": None if not model.cfg.has_ple else ("shard" if tp and tp.ple_vocab_start is not None else "replicate"),
    }
    if model.cfg.enable_moe_block:
        out["experts_per_rank"] = model.layers[0].experts.gate_up_proj.shape[0]
    return out
