"""Launching blockspec commands as several ranks for the torch.distributed tests: torchrun on one host or as two
"hosts" (two agents, one c10d rendezvous, both on localhost), or ranks started by hand with the variables torchrun
would set. Outputs go through files, so a chatty rank can never block on a full pipe while its peer waits for it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile

LAUNCH_TIMEOUT = 150  # seconds: a two-rank launch of the tests' runs takes 10-20 s on two shared cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, port: int | None, world: int = 2) -> dict[str, str]:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
    return env if port is None else {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def run_all(commands: list[tuple[list[str], dict[str, str]]]) -> list[tuple[int, str]]:
    """Start every (argv, extra environment) at once, wait for all -> (exit status, stdout + stderr) of each."""
    outs = [tempfile.TemporaryFile("w+") for _ in commands]
    procs = [subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **extra})
             for (argv, extra), out in zip(commands, outs)]
    try:
        statuses = [p.wait(timeout=LAUNCH_TIMEOUT) for p in procs]
    finally:
        for p in procs:
            p.kill()
    texts = []
    for out in outs:
        out.seek(0)
        texts.append(out.read())
        out.close()
    return list(zip(statuses, texts))


def torchrun(args: list[str], nproc: int = 2) -> tuple[int, str]:
    """`torchrun --standalone --nproc-per-node nproc -m blockspec ARGS` -> (exit status, output)."""
    return run_all([([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                      "-m", "blockspec", *args], {})])[0]


def torchrun_two_hosts(args: list[str]) -> list[tuple[int, str]]:
    """Two torchrun agents, one rank each, meeting through a c10d rendezvous as two hosts would (here both on
    localhost) -> (exit status, output) of each."""
    flags = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{free_port()}", "--rdzv-id", "test"]
    argv = [sys.executable, "-m", "torch.distributed.run", *flags, "-m", "blockspec", *args]
    return run_all([(argv, {}), (argv, {})])


def ranks_by_hand(groups: list[list[list[str]]]) -> list[list[tuple[int, str]]]:
    """Groups of ranks started by hand (rank i of a group gets args group[i] and the variables torchrun would set),
    all at once -> per group, (exit status, output) of each rank."""
    commands = []
    for group in groups:
        port = free_port()
        commands += [([sys.executable, "-m", "blockspec", *args], rank_env(rank, port, len(group)))
                     for rank, args in enumerate(group)]
    results = iter(run_all(commands))
    return [[next(results) for _ in group] for group in groups]
