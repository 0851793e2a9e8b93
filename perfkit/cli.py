"""perfkit's command line: every command is a thin shim over the modules below it.

Bad input raises `PerfkitError`; `_guard` prints its message (one line per problem) to stderr and exits 2,
with no traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from perfkit.errors import PerfkitError

app = typer.Typer(
    name="perfkit",
    help="Benchmark and profile Gemma4 serving: run suites, capture NVTX/memory/telemetry, A/B-compare code paths.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Validate configs and print their JSON Schema.", no_args_is_help=True)
app.add_typer(config_app, name="config")
kernels_app = typer.Typer(
    help="Kernel sweeps: A/B implementations over shapes (peak memory, latency, bound).", no_args_is_help=True
)
app.add_typer(kernels_app, name="kernels")

F = TypeVar("F", bound=Callable[..., Any])
SetOption = Annotated[
    Optional[list[str]], typer.Option("--set", help="override a config value: a.b.c=value (repeatable)")
]


def _guard(fn: F) -> F:
    """Turn user-facing errors into one-line messages and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PerfkitError as err:
            for line in str(err).splitlines() or ["error"]:
                typer.echo(f"error: {line}" if not line.startswith("error") else line, err=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


# options several commands share
_KernelOutDir = Annotated[Path, typer.Option("--out", help="results directory; the run goes to <out>/<run-id>/")]
_Label = Annotated[Optional[str], typer.Option("--label", help="appended to the run id")]


def _console() -> Console:
    # piped output (CI logs, `| tee`) gets a wide console so tables are not folded into unreadable columns
    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 180)


# --------------------------------------------------------------------------------------------------------------
# perfkit run
# --------------------------------------------------------------------------------------------------------------


@app.command()
@_guard
def run(
    config: Annotated[Optional[Path], typer.Argument(help="suite YAML; omitted = the packaged smoke suite")] = None,
    set_: SetOption = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="results directory (default: output.dir)")] = None,
    label: _Label = None,
    profile: Annotated[
        Optional[str], typer.Option("--profile", help="profiler window: torch | cuda | python (see capture.profile_*)")
    ] = None,
    tp: Annotated[
        Optional[int],
        typer.Option(
            "--tp",
            help="tensor-parallel GPUs: relaunches itself as N torchrun ranks (overrides runtime.tensor_parallel)",
        ),
    ] = None,
) -> None:
    """Run a suite: scenarios x arms x repeats on one loaded model; results go to <out>/<run-id>/."""
    from perfkit.config import load_config
    from perfkit.runners.suite import default_config_path, run_suite
    from perfkit.runners.tp_launch import in_torchrun, maybe_relaunch

    overrides = list(set_ or [])
    if label:
        overrides.append(f"output.label={label}")
    if profile:
        if profile not in ("torch", "cuda", "python", "none"):
            raise PerfkitError(f"--profile {profile!r}: allowed values are torch, cuda, python, none")
        overrides.append(f"capture.profile={profile}")
    if tp is not None:
        if tp < 1:
            raise PerfkitError(f"--tp {tp}: must be >= 1")
        overrides.append(f"runtime.tensor_parallel={tp}")
    cfg = load_config(config or default_config_path(), overrides)
    relaunched = maybe_relaunch(cfg.runtime.tensor_parallel)  # outside torchrun with TP > 1: run N ranks, wait
    if relaunched is not None:
        raise typer.Exit(relaunched)
    by_name = sys.argv and (sys.argv[0].endswith("perfkit") or in_torchrun())  # torchrun: argv[0] is tp_launch
    command = " ".join(["perfkit", *sys.argv[1:]]) if by_name else "perfkit run"
    code = run_suite(cfg, out_dir=out, command=command, console=_console())
    raise typer.Exit(code)


# --------------------------------------------------------------------------------------------------------------
# perfkit config ...
# --------------------------------------------------------------------------------------------------------------


@config_app.command("validate")
@_guard
def config_validate(
    files: Annotated[list[Path], typer.Argument(help="config files to check")],
    set_: SetOption = None,
) -> None:
    """Check config files: prints `ok` per valid file, one line per problem otherwise (exit 2)."""
    from perfkit.config import load_config

    problems: list[str] = []
    for f in files:
        try:
            cfg = load_config(f, list(set_ or []))
        except PerfkitError as err:
            problems.extend(str(err).splitlines())
            continue
        typer.echo(f"ok: {f} ({cfg.name}: {len(cfg.scenarios)} scenarios x {len(cfg.arm_list())} arms)")
    if problems:
        raise PerfkitError("\n".join(problems))


@config_app.command("schema")
def config_schema_cmd() -> None:
    """Print the JSON Schema of the run config (point your editor's YAML validation at it)."""
    from perfkit.config import config_schema

    typer.echo(json.dumps(config_schema(), indent=2))


# --------------------------------------------------------------------------------------------------------------
# perfkit env / toggles
# --------------------------------------------------------------------------------------------------------------


@app.command()
def env(as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False) -> None:
    """Where numbers would come from: perfkit commit, packages, CUDA, driver, GPU (or that there is none)."""
    from perfkit.provenance import collect

    info = collect()
    if as_json:
        typer.echo(json.dumps(info, indent=2, default=str))
        return
    con = _console()
    git = info["git"]
    dirty = " (dirty)" if git.get("dirty") else ""
    con.print(f"perfkit commit: {git.get('short') or 'not a git checkout'}{dirty}")
    con.print(f"python {info['python']} on {info['platform']}")
    table = Table("package", "version", box=None)
    for name, version in info["packages"].items():
        table.add_row(name, version or "-")
    con.print(table)
    gpu = info["gpu"]
    if not gpu.get("available"):
        con.print(f"GPU: none ({gpu.get('reason')}); torch CUDA build: {gpu.get('torch_cuda') or 'none (CPU build)'}")
        return
    mem = gpu.get("memory_total_bytes") or gpu.get("total_memory_bytes") or 0
    con.print(
        f"GPU: {gpu.get('name')} x{gpu.get('device_count', 1)}, sm_{str(gpu.get('compute_capability', '?')).replace('.', '')}, "
        f"{gpu.get('sm_count')} SMs, {mem / 2**30:.1f} GiB"
    )
    con.print(
        f"driver {gpu.get('driver')} (CUDA {gpu.get('cuda_driver')}), torch CUDA {gpu.get('torch_cuda')}, "
        f"SM clock max {gpu.get('sm_clock_max_mhz')} MHz, memory clock max {gpu.get('mem_clock_max_mhz')} MHz, "
        f"power limit {gpu.get('power_limit_w')} W"
    )


@app.command()
def toggles() -> None:
    """List the A/B toggles: name, values, default, what each changes."""
    from perfkit.config import TOGGLES

    table = Table("toggle", "values", "default", "what it changes", show_lines=True)
    for name, (values, default, doc) in TOGGLES.items():
        table.add_row(name, " | ".join(values), default, doc)
    _console().print(table)


# --------------------------------------------------------------------------------------------------------------
# perfkit kernels ...
# --------------------------------------------------------------------------------------------------------------


def _int_list(option: str, text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PerfkitError(f"{option} {text!r}: expected comma-separated integers, e.g. 8192,16384") from None
    if not vals or any(v < 0 for v in vals):
        raise PerfkitError(f"{option} {text!r}: expected one or more integers >= 0")
    return vals


def _kernel_result(kind: str, label: str | None, config: dict[str, Any], out: Path) -> tuple[Any, Path]:
    """An empty kernel-sweep Result (rows are appended and the file rewritten as each one is measured) and its path."""
    from perfkit.provenance import collect
    from perfkit.results import Result, make_run_id

    result = Result(
        run_id=make_run_id(kind, label), command=" ".join(["perfkit", *sys.argv[1:]]), config=config,
        provenance=collect(), kernels=[],
    )  # fmt: skip
    return result, out / result.run_id / "result.json"


@kernels_app.command("mask")
@_guard
def kernels_mask(
    q_lens: Annotated[
        str, typer.Option("--q-lens", help="new tokens per request, comma-separated")
    ] = "8192,16384,32768,65536",
    prefix_lens: Annotated[str, typer.Option("--prefix-lens", help="cached prefix tokens, comma-separated")] = "0,8192",
    window: Annotated[int, typer.Option("--window", help="sliding window W (0 = no window)")] = 1024,
    impl: Annotated[str, typer.Option("--impl", help="implementations: dense (A), triton (B)")] = "dense,triton",
    budget_gib: Annotated[
        Optional[float], typer.Option("--budget-gib", help="cap the CUDA allocator at this many GiB (OOM is recorded)")
    ] = None,
    repeats: Annotated[int, typer.Option("--repeats", help="timed calls per (shape, impl)")] = 20,
    write_bw_tb_s: Annotated[float, typer.Option("--write-bw-tb-s", help="write bandwidth for the bound, TB/s")] = 4.3,
    out: _KernelOutDir = Path("results"),
    label: _Label = None,
) -> None:
    """Gemma4 attention-mask build, dense vs Triton: peak memory, median latency, distance from the write bound."""
    import os

    import torch

    impls = [x.strip() for x in impl.split(",") if x.strip()]
    bad = [x for x in impls if x not in ("dense", "triton")]
    if bad or not impls:
        raise PerfkitError(f"--impl {impl!r}: allowed values are dense, triton (comma-separated)")
    if repeats < 1 or write_bw_tb_s <= 0 or window < 0 or (budget_gib is not None and budget_gib <= 0):
        raise PerfkitError("--repeats must be >= 1, --write-bw-tb-s > 0, --window >= 0, --budget-gib > 0")
    if not torch.cuda.is_available():  # CPU: Triton runs interpreted (slow; use small --q-lens)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from perfkit.results import KernelRow, write_result
    from perfkit.runners.kernel_sweep import run_mask_sweep

    qs, ps = _int_list("--q-lens", q_lens), _int_list("--prefix-lens", prefix_lens)
    sweep_cfg = {
        "kernel": "gemma_mask",
        "q_lens": qs,
        "prefix_lens": ps,
        "window": window or None,
        "impls": impls,
        "budget_gib": budget_gib,
        "repeats": repeats,
        "write_bw_bytes_s": write_bw_tb_s * 1e12,
    }
    result, path = _kernel_result("kernels-mask", label, sweep_cfg, out)
    con = _console()

    def on_row(row: dict[str, Any]) -> None:
        result.kernels.append(KernelRow(**row))
        write_result(path, result)
        s = row["shape"]
        con.print(
            f"  Q={s['q_len']} P={s['prefix_len']} {row['impl']}: {row['status']}"
            + (f" {row['median_ms']:.3f} ms" if row["median_ms"] is not None else f" ({row['message']})")
        )

    rows = run_mask_sweep(
        qs, ps, window or None, impls, budget_gib, repeats, write_bw_bytes_s=write_bw_tb_s * 1e12, on_row=on_row
    )
    result.status = "complete"
    write_result(path, result)

    def gib(x: Any) -> str:
        return "-" if x is None else f"{x / 2**30:.3f}"

    table = Table(
        "Q",
        "P",
        "impl",
        "status",
        "peak GiB",
        "pred. GiB",
        "out GiB",
        "median ms",
        "p10-p90 ms",
        "bound ms",
        "x bound",
        "device ms",
        "x bound (device)",
        "allowed",
        title=f"gemma mask, W={window or 'none'}, device {rows[0]['device'] if rows else '-'}",
    )
    counts: dict[tuple[int, int], set[int]] = {}
    for r in rows:
        if r["true_count"] is not None:
            counts.setdefault((r["shape"]["q_len"], r["shape"]["prefix_len"]), set()).add(r["true_count"])
    for r in rows:
        s, ok = r["shape"], r["median_ms"] is not None
        agree = counts.get((s["q_len"], s["prefix_len"]), set())
        table.add_row(
            str(s["q_len"]),
            str(s["prefix_len"]),
            r["impl"],
            r["status"] if r["status"] == "ok" else f"[red]{r['status']}[/red]",
            gib(r["peak_allocated_bytes"]),
            gib(r["predicted_peak_bytes"]),
            gib(r["output_bytes"]),
            f"{r['median_ms']:.3f}" if ok else "-",
            f"{r['p10_ms']:.3f}-{r['p90_ms']:.3f}" if ok else "-",
            f"{r['bound_ms']:.3f}",
            f"{r['x_bound']:.2f}" if ok else "-",
            "-" if r.get("device_median_ms") is None else f"{r['device_median_ms']:.3f}",
            "-" if r.get("x_bound_device") is None else f"{r['x_bound_device']:.2f}",
            "-"
            if r["true_count"] is None
            else (f"{r['true_count']}" + ("" if len(agree) == 1 else " [red]MISMATCH[/red]")),
        )
    con.print(table)
    con.print(
        "peak = max_memory_allocated - allocated before the call (output included); latency = CUDA events "
        "around one call from an idle GPU (host launch included), median of repeats; bound = output bytes / "
        f"{write_bw_tb_s} TB/s"
    )
    con.print(f"result: {path}")


@kernels_app.command("attention")
@_guard
def kernels_attention(
    preset: Annotated[str, typer.Option("--preset", help="model preset whose pool shapes are timed")] = "31b",
    pools: Annotated[str, typer.Option("--pools", help="pools: sliding, full (comma-separated)")] = "sliding,full",
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", help="decode batch sizes")] = "1,16,64",
    kv_lens: Annotated[
        str, typer.Option("--kv-lens", help="decode context lengths (a window caps sliding)")
    ] = "1024,4096",
    prefill_q_lens: Annotated[str, typer.Option("--prefill-q-lens", help="prefill lengths, one request")] = "8192",
    decode_impl: Annotated[
        str,
        typer.Option("--decode-impl", help="cuda_cores, tc_fa2, tc_fa3 (tensor cores through prefill kernels), triton"),
    ] = "cuda_cores,tc_fa2,tc_fa3,triton",
    prefill_impl: Annotated[str, typer.Option("--prefill-impl", help="fa2, fa3")] = "fa2,fa3",
    triton_tiles: Annotated[
        str,
        typer.Option("--triton-tiles", help="Triton decode tiles, BLOCK_NxWARPSxPROGRAMS_PER_SM, e.g. 32x4x2,64x4x4"),
    ] = "",
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help="bf16 | fp8")] = "bf16",
    page_size: Annotated[int, typer.Option("--page-size", help="KV page size")] = 16,
    repeats: Annotated[int, typer.Option("--repeats", help="timed replays per case")] = 20,
    out: _KernelOutDir = Path("results"),
    label: _Label = None,
) -> None:
    """Decode (FlashInfer CUDA cores vs tensor cores vs perfkit's Triton split-KV) and prefill (FA2 vs FA3) at a
    model's pool shapes."""
    from perfkit.results import KernelRow, write_result
    from perfkit.runners.attention_sweep import (
        attention_cases,
        best_impls,
        impl_label,
        parse_triton_tiles,
        run_attention_sweep,
    )

    if repeats < 1 or page_size < 1:
        raise PerfkitError("--repeats and --page-size must be >= 1")
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    rows = attention_cases(
        preset, split(pools), _int_list("--batch-sizes", batch_sizes), _int_list("--kv-lens", kv_lens),
        _int_list("--prefill-q-lens", prefill_q_lens), split(decode_impl), split(prefill_impl), kv_dtype,
        triton_tiles=parse_triton_tiles(triton_tiles),
    )  # fmt: skip
    config = {"kernel": "attention", "preset": preset, "page_size": page_size, "repeats": repeats}
    result, path = _kernel_result("kernels-attention", label, config, out)
    con = _console()

    def on_row(row: dict[str, Any]) -> None:
        result.kernels.append(KernelRow(**row))
        write_result(path, result)
        s = row["shape"]
        where = f"b{s['batch']} kv{s['kv_len']}" if "batch" in s else f"q{s['q_len']}"
        timing = f"{row['median_ms']:.4f} ms ({row['x_bound']:.2f}x bound)" if row["median_ms"] else row["message"]
        con.print(f"  {row['kernel']} {s['pool']} {where} {impl_label(row)}: {row['status']} {timing}")

    run_attention_sweep(rows, page_size, repeats, on_row=on_row)
    result.status = "complete"
    result.config["best"] = best_impls(rows)
    write_result(path, result)
    table = Table("case", "fastest impl", title=f"attention, {preset}, {result.provenance['gpu'].get('name', '-')}")
    for case, impl in result.config["best"].items():
        table.add_row(case, impl)
    con.print(table)
    con.print(f"result: {path}")


# --------------------------------------------------------------------------------------------------------------
# perfkit compare / plot
# --------------------------------------------------------------------------------------------------------------


@app.command()
@_guard
def compare(
    a: Annotated[Path, typer.Argument(help="result.json (or its run directory): A, or an interleaved A/B run")],
    b: Annotated[Optional[Path], typer.Argument(help="result.json of B; omitted = compare the arms inside A")] = None,
    markdown: Annotated[Optional[Path], typer.Option("--markdown", help="write a PR-ready Markdown table here")] = None,
    plots: Annotated[Optional[Path], typer.Option("--plots", help="write PNG figures into this directory")] = None,
    metrics: Annotated[
        Optional[list[str]],
        typer.Option("--metrics", help="rows to show: metric paths, dotted prefixes or globs (repeatable, or a,b)"),
    ] = None,
    fail_if: Annotated[
        Optional[list[str]],
        typer.Option("--fail-if", help="gate: METRIC:[+|-]PCT%, e.g. tpot_ms.p50:+5% (exit 1 when crossed)"),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="bootstrap seed")] = 0,
) -> None:
    """A/B compare: A, B, delta % with a 95% CI and a verdict per metric; exit 1 when a --fail-if gate trips."""
    import os

    from perfkit.compare import check_thresholds, parse_threshold, render_rich, to_markdown
    from perfkit.compare import compare as run_compare

    patterns = [p.strip() for m in metrics or [] for p in m.split(",") if p.strip()]
    thresholds = [parse_threshold(t) for t in fail_if or []]
    report = run_compare(a, b, patterns or None, seed=seed, extra_metrics=[t.metric for t in thresholds])
    con = _console()
    render_rich(report, con)
    images: list[tuple[str, str]] = []
    if plots is not None:
        from perfkit.plots import plot_results, write_delta_plots

        written = write_delta_plots(report, plots)
        written += [
            (p.stem.replace("_", " "), p)
            for p in plot_results([a] + ([b] if b else []), plots)
            if not p.name.endswith("_delta.png")
        ]
        base = markdown.parent if markdown is not None else Path.cwd()
        images = [(title, os.path.relpath(p, base)) for title, p in written]
        con.print(f"plots: {len(written)} PNGs in {plots}")
    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(to_markdown(report, images))
        con.print(f"markdown: {markdown}")
    failures = check_thresholds(report, thresholds)
    for f in failures:
        typer.echo(f"FAIL: {f}", err=True)
    if failures:
        raise typer.Exit(1)


@app.command()
@_guard
def plot(
    results: Annotated[list[Path], typer.Argument(help="result.json files (or run directories)")],
    out: Annotated[
        Optional[Path], typer.Option("--out", help="output directory (default: beside the first result)")
    ] = None,
) -> None:
    """Draw the figures that fit the given results (CDFs, deltas, throughput-latency, memory, NVTX, mask sweep)."""
    from perfkit.plots import plot_results

    first = results[0] if results[0].is_dir() else results[0].parent
    paths = plot_results(results, out or first)
    con = _console()
    for p in paths:
        con.print(str(p))
    if not paths:
        con.print("nothing to plot in these results")


# --------------------------------------------------------------------------------------------------------------
# perfkit generate
# --------------------------------------------------------------------------------------------------------------


@app.command()
@_guard
def generate(
    model: Annotated[str, typer.Option("--model", help="preset (random weights) or HF checkpoint directory")] = "tiny",
    prompt_ids: Annotated[str, typer.Option("--prompt-ids", help="comma-separated token ids, e.g. 2,10,11")] = "2",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="tokens to generate (greedy)")] = 16,
    device: Annotated[str, typer.Option("--device", help="cpu | cuda")] = "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="float32 | bfloat16")] = "float32",
    seed: Annotated[int, typer.Option("--seed", help="seed of random weights")] = 0,
    num_layers: Annotated[
        Optional[int], typer.Option("--num-layers", help="truncate (keeps the layer pattern)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help='print {"token_ids": [...]}')] = False,
) -> None:
    """Greedy-generate with the bundled Gemma4 runtime (contiguous reference attention); prints the new ids."""
    from perfkit.runtime.generate import greedy_generate, load_for_generate

    ids = _int_list("--prompt-ids", prompt_ids)
    if max_new_tokens < 1:
        raise PerfkitError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
    lm = load_for_generate(model, device=device, dtype=dtype, seed=seed, num_layers=num_layers)
    if max(ids) >= lm.cfg.vocab_size:
        raise PerfkitError(f"--prompt-ids: id {max(ids)} is outside the vocabulary ({lm.cfg.vocab_size})")
    out = greedy_generate(lm, ids, max_new_tokens)
    typer.echo(json.dumps({"token_ids": out}) if as_json else " ".join(map(str, out)))


def main() -> None:  # pragma: no cover - console entry for `python -m perfkit`
    app()
