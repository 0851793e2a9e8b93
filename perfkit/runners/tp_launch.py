"""Launching `perfkit run CONFIG --tp N` as N torchrun ranks (one GPU each), and the per-rank helpers.

    perfkit run CONFIG --tp 2
      -> maybe_relaunch(2)  (not under torchrun yet)
      -> python -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port P
             -m perfkit.runners.tp_launch run CONFIG --tp 2          (NCCL_NVLS_ENABLE=0 in the environment)
      -> in each rank: maybe_relaunch(2) sees WORLD_SIZE=2 and returns None; the command runs as one rank:
         ctx = init_tp(); shard the model (perfkit.runtime.tp); step the engine exactly like every other rank;
         only ctx.is_rank0 writes results and prints.

The re-executed module is this one (its `__main__` block calls perfkit.cli.main) because perfkit.cli has no
`if __name__ == "__main__"` guard; with one, `entry_module="perfkit.cli"` works the same.

NCCL: NCCL_NVLS_ENABLE=0 (NVLink SHARP / multicast off; the lent machines require it) is forced in the torchrun
environment and defaulted in `init_tp` for ranks started by a user's own torchrun. Rendezvous is on 127.0.0.1
only (single node).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from perfkit.errors import PerfkitError

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}
LOOPBACK = "127.0.0.1"
ENTRY_MODULE = "perfkit.runners.tp_launch"


# ---- where am I --------------------------------------------------------------------------------------------
def in_torchrun() -> bool:
    """True inside a process started by torchrun (or any launcher that sets RANK / WORLD_SIZE / LOCAL_RANK)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    if _dist_ready():
        import torch.distributed as dist

        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    if _dist_ready():
        import torch.distributed as dist

        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_rank0() -> bool:
    """The rank that prints, records and writes result files (True without torch.distributed)."""
    return rank() == 0


# ---- re-execution through torchrun -------------------------------------------------------------------------
def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def torchrun_command(
    nproc: int, cli_args: Sequence[str], port: int | None = None, entry_module: str = ENTRY_MODULE
) -> list[str]:
    """argv that runs `perfkit <cli_args>` as `nproc` local ranks (single node, loopback rendezvous)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--master-addr", LOOPBACK, "--master-port", str(port or free_loopback_port()),
        "-m", entry_module, *cli_args,
    ]  # fmt: skip


def torchrun_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(NCCL_ENV)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def relaunch(nproc: int, cli_args: Sequence[str], entry_module: str = ENTRY_MODULE) -> int:
    """Run `perfkit <cli_args>` under torchrun with `nproc` ranks; returns torchrun's exit code. Ctrl-C reaches
    the ranks through the terminal's process group (torchrun forwards it too); we wait for them to finish."""
    proc = subprocess.Popen(torchrun_command(nproc, cli_args, entry_module=entry_module), env=torchrun_env())
    try:
        return proc.wait()
    except KeyboardInterrupt:
        try:
            return proc.wait(timeout=60)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.terminate()
            proc.wait()
            return 130


def maybe_relaunch(tp: int, cli_args: Sequence[str] | None = None, entry_module: str = ENTRY_MODULE) -> int | None:
    """For the CLI's `--tp N`: None = carry on in this process (tp == 1, or already one of N torchrun ranks);
    an int = the exit code of the torchrun job this call ran (the CLI exits with it)."""
    if tp < 1:
        raise PerfkitError(f"--tp {tp}: must be >= 1")
    if in_torchrun():
        if int(os.environ["WORLD_SIZE"]) != tp:
            raise PerfkitError(f"--tp {tp} but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} ranks")
        return None
    if tp == 1:
        return None
    if torch.cuda.is_available() and torch.cuda.device_count() < tp:
        raise PerfkitError(f"--tp {tp} needs {tp} GPUs; this machine has {torch.cuda.device_count()}")
    return relaunch(tp, list(sys.argv[1:] if cli_args is None else cli_args), entry_module)


# ---- per-rank process group ----------------------------------------------------------------------------------
@dataclass
class TPContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # nccl | gloo
    group: Any = None  # tensor-parallel collectives (model); None = WORLD
    control_group: Any = None  # host-side control messages: a gloo group beside NCCL (no GPU stream sync)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`obj` of rank `src` on every rank (control messages: what to submit before a step, stop flags)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.control_group, device=torch.device("cpu"))
        return box[0]

    def min_int(self, value: int) -> int:
        """The minimum of `value` over ranks (e.g. KV pages measured per GPU: every rank must use the same)."""
        if self.world_size == 1:
            return int(value)
        import torch.distributed as dist

        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """[obj of rank 0, obj of rank 1, ...] on every rank (per-scenario status, device names)."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        objs: list[Any] = [None] * self.world_size
        dist.all_gather_object(objs, obj, group=self.control_group)
        return objs

    def assert_identical(self, obj: Any, what: str = "value") -> None:
        """Debug guard: raise on every rank when `obj` differs between ranks (e.g. a step's scheduled ids)."""
        if self.world_size == 1:
            return
        import torch.distributed as dist

        objs: list[Any] = [None] * self.world_size
        dist.all_gather_object(objs, obj, group=self.control_group)
        if any(o != objs[0] for o in objs):
            raise RuntimeError(f"tensor parallel ranks diverged on {what}: {objs}")

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.control_group)

    def shutdown(self) -> None:
        """Barrier, then destroy the process groups: no rank tears down (rank 0 hosts the rendezvous store)
        while another still talks to it."""
        import torch.distributed as dist

        if dist.is_initialized():
            if self.world_size > 1:
                dist.barrier(group=self.control_group)
            dist.destroy_process_group()


def parallel_info(ctx: TPContext) -> dict[str, Any]:
    """provenance["parallel"]: world size, backend, NCCL version and every rank's device name. Collective (the
    device names are gathered): every rank calls it; the result is the same on every rank."""
    info: dict[str, Any] = {"tp": ctx.world_size, "world_size": ctx.world_size, "backend": ctx.backend}
    if ctx.device.type == "cuda":
        v = torch.cuda.nccl.version()
        info["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        name = torch.cuda.get_device_name(ctx.device)
    else:
        name = "cpu"
    info["devices"] = ctx.all_gather_object(name)
    info["env"] = {k: os.environ.get(k) for k in NCCL_ENV}
    return info


def init_tp(device: str = "auto", timeout_s: float = 1800.0) -> TPContext:
    """Initialise torch.distributed for this rank from torchrun's environment: NCCL with cuda:LOCAL_RANK when
    CUDA is available (device="auto"/"cuda"), else gloo on the CPU. Without torchrun: a 1-rank context."""
    import datetime

    import torch.distributed as dist

    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    lr = local_rank()
    dev = torch.device("cuda", lr) if use_cuda else torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    if not in_torchrun():
        return TPContext(0, 1, 0, dev, backend)
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    if use_cuda:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        kw: dict[str, Any] = {"device_id": dev} if use_cuda else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    control = dist.new_group(backend="gloo") if backend == "nccl" else None  # collective: every rank calls it
    return TPContext(dist.get_rank(), dist.get_world_size(), lr, dev, backend, control_group=control)


if __name__ == "__main__":  # the module torchrun re-executes: one rank of `perfkit <argv>`
    from perfkit.cli import main

    main()
