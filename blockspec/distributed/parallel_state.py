"""The tensor-parallel process group: who this process is and which groups carry tensors and step messages.

One process per rank. Tensors (all-reduce, all-gather) go over the backend of the device: NCCL on CUDA, gloo on CPU.
Step messages (pickled Python objects broadcast by rank 0) always go over a gloo group, so they never have to be
copied onto a GPU first."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) can take a shared host's GPUs out of service: keep it off in NCCL, PyTorch and NVSHMEM,
# including in the processes we spawn (they inherit os.environ).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# Long enough for every rank to read a large checkpoint before the first collective.
TIMEOUT = timedelta(minutes=20)


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world_size: int
    group: dist.ProcessGroup  # tensors
    control: dist.ProcessGroup  # pickled step messages (gloo)
    device: torch.device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r computes on cuda:r (or on the CPU)."""
    return torch.device("cuda", rank) if base.type == "cuda" else base


def init_tp(rank: int, world_size: int, port: int, base_device: torch.device) -> TPGroup:
    for k, v in MULTICAST_OFF.items():
        os.environ[k] = v
    device = rank_device(base_device, rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=TIMEOUT)
    group = dist.group.WORLD
    control = dist.new_group(backend="gloo", timeout=TIMEOUT) if backend == "nccl" else group
    return TPGroup(rank, world_size, group, control, device)


def destroy_tp() -> None:
    if dist.is_initialized():
        if dist.get_backend() == "gloo":
            # Tear down together: a gloo rank that destroys its group while its peer is still sending aborts the
            # peer's process ("terminate called without an active exception"). Bounded, so a dead peer cannot hang us.
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=60))
            except RuntimeError:
                pass
        dist.destroy_process_group()
