"""Joining a torchrun launch: the rendezvous environment it sets, the process groups (set up within a bounded time,
so a launch with a missing rank ends instead of hanging) and leaving them.

`torchrun --nproc-per-node N [--nnodes M --rdzv-endpoint HOST:PORT ...] -m blockspec train-draft ...` starts one
process per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set; rank r computes on
cuda:LOCAL_RANK over NCCL, or on the CPU over gloo."""

from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from blockspec.distributed.parallel_state import MULTICAST_OFF
from blockspec.errors import BlockspecError
from blockspec.loading.loader import resolve_device
from blockspec.train.distributed import AllRanksError, DataParallel

RENDEZVOUS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Collectives after set-up wait this long: rank 0 alone runs the engine's tau evaluation and writes checkpoints
# while the others wait in the next collective.
OP_TIMEOUT = timedelta(hours=1)


def launched() -> bool:
    """Whether this process was started as one rank of several (torchrun, or the variables set by hand)."""
    return any(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the environment; one clear error when the rendezvous is incomplete."""
    missing = [k for k in RENDEZVOUS if not os.environ.get(k)]
    if missing:
        raise BlockspecError(f"distributed launch: {', '.join(missing)} not set in the environment (torchrun sets "
                             f"{', '.join(RENDEZVOUS)}: `torchrun --nproc-per-node N -m blockspec ...`)")
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        int(os.environ["MASTER_PORT"])
    except ValueError:
        found = ", ".join(f"{k}={os.environ.get(k)!r}" for k in (*RENDEZVOUS, "LOCAL_RANK") if k in os.environ)
        raise BlockspecError(f"distributed launch: RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers, "
                             f"got {found}") from None
    if not 0 <= rank < size:
        raise BlockspecError(f"distributed launch: RANK={rank} is outside WORLD_SIZE={size}")
    return rank, size, local


def join(device: str | None, setup_timeout_s: float, fsdp: bool = False,
         op_timeout: timedelta = OP_TIMEOUT) -> DataParallel:
    """Join the launch this process belongs to. Set-up (every rank reaching the rendezvous and the groups) must end
    within setup_timeout_s, else one line says so on every rank that got that far."""
    rank, size, local = world()
    base = resolve_device(device)
    dev = torch.device("cuda", local) if base.type == "cuda" else base
    if dev.type == "cuda":
        if local >= torch.cuda.device_count():
            raise BlockspecError(f"rank {rank}: LOCAL_RANK={local} but this host has {torch.cuda.device_count()} GPUs")
        os.environ.update(MULTICAST_OFF)
        torch.cuda.set_device(dev)
    setup = timedelta(seconds=setup_timeout_s)
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    where = f"{addr}:{port}"
    if rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        _wait_for_store(addr, port, time.monotonic() + setup_timeout_s, rank, where)
    try:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method="env://", timeout=setup,
                                **({"device_id": dev} if dev.type == "cuda" else {}))
        control = dist.new_group(backend="gloo", timeout=op_timeout)
        group = dist.new_group(backend="nccl", timeout=op_timeout) if dev.type == "cuda" else control
    except (RuntimeError, dist.DistError) as e:
        leave(None)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BlockspecError(f"rank {rank}: distributed set-up did not complete within {setup_timeout_s:g} s at "
                             f"{where} ({reason}): are all {size} ranks started? (--dist-timeout SECONDS)") from None
    return DataParallel(rank, size, dev, group, control, fsdp)


def _wait_for_store(addr: str, port: int, deadline: float, rank: int, where: str) -> None:
    """Wait until the rendezvous store accepts connections (quietly: torch's own client logs every failed attempt
    with a C++ stack trace)."""
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise BlockspecError(f"rank {rank}: no rendezvous store answered at {where} within the set-up "
                                     f"timeout: is rank 0 started, and MASTER_ADDR/MASTER_PORT right? "
                                     f"(--dist-timeout SECONDS)") from None
            time.sleep(0.2)


def leave(dp: DataParallel | None, together: bool = False) -> None:
    """Destroy the process groups. together: first wait (bounded) for every rank, as after a run that ended well: a
    gloo rank that tears down while a peer still sends aborts that peer."""
    if not dist.is_initialized():
        return
    if together and dp is not None:
        try:
            dist.monitored_barrier(group=dp.control, timeout=timedelta(seconds=60))
        except RuntimeError:
            pass
    dist.destroy_process_group()


@contextmanager
def session(dp: DataParallel | None) -> Iterator[None]:
    """The body of a launched command: on the way out the ranks leave their process groups together (a bounded
    barrier first) after a good run or an error every rank raised at once (AllRanksError), else at once."""
    together = False
    try:
        yield
        together = True
    except AllRanksError:
        together = True
        raise
    finally:
        leave(dp, together=together)
