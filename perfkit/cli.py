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


def _console() -> Console:
    return Console(highlight=False, soft_wrap=True)


# --------------------------------------------------------------------------------------------------------------
# perfkit run
# --------------------------------------------------------------------------------------------------------------


@app.command()
@_guard
def run(
    config: Annotated[Optional[Path], typer.Argument(help="suite YAML; omitted = the packaged smoke suite")] = None,
    set_: SetOption = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="results directory (default: output.dir)")] = None,
    label: Annotated[Optional[str], typer.Option("--label", help="appended to the run id")] = None,
    profile: Annotated[
        Optional[str], typer.Option("--profile", help="profiler window: torch | cuda (see capture.profile_*)")
    ] = None,
) -> None:
    """Run a suite: scenarios x arms x repeats on one loaded model; results go to <out>/<run-id>/."""
    from perfkit.config import load_config
    from perfkit.runners.suite import default_config_path, run_suite

    overrides = list(set_ or [])
    if label:
        overrides.append(f"output.label={label}")
    if profile:
        if profile not in ("torch", "cuda", "none"):
            raise PerfkitError(f"--profile {profile!r}: allowed values are torch, cuda, none")
        overrides.append(f"capture.profile={profile}")
    cfg = load_config(config or default_config_path(), overrides)
    command = " ".join(["perfkit", *sys.argv[1:]]) if sys.argv and sys.argv[0].endswith("perfkit") else "perfkit run"
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


def main() -> None:  # pragma: no cover - console entry for `python -m perfkit`
    app()
