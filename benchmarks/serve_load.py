"""Concurrent streams through `blockspec serve`, with the drafter (its defaults: the calibrated draft length
schedule) and without: wall time, tokens/s, and whether every stream's tokens equal the same prompt's output when
sent alone (docs/performance.md). Each server is a `blockspec serve` process of its own, started untimed (load and
calibration stay out of the timing); the streams are chat completions of the shipped MT-Bench and HumanEval prompts,
greedy. Usage:
  python -m benchmarks.serve_load [--streams 48] [--max-tokens 96] [--draft DIR] [--out FILE] [-- SERVE FLAGS]"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from blockspec.data.eval_prompts import load_eval_prompts
from blockspec.loading.bundled_draft import bundled_draft_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str], log: Path) -> tuple[subprocess.Popen, str, str, float]:
    """A `blockspec serve` process, its URL and model name, once /v1/models answers; the seconds it took."""
    port = free_port()
    cmd = [sys.executable, "-m", "blockspec", "serve", "--port", str(port), *flags]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            models = httpx.get(f"{url}/v1/models", timeout=2)
            if models.status_code == 200:
                return proc, url, models.json()["data"][0]["id"], time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


async def stream_one(client: httpx.AsyncClient, server: tuple[str, str], prompt: str, max_tokens: int) -> list[int]:
    url, model = server
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    ids: list[int] = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    ids += c.get("token_ids") or []
    return ids


async def concurrent(server: tuple[str, str], prompts: list[str], max_tokens: int) -> tuple[list[list[int]], float]:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=len(prompts))) as client:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(stream_one(client, server, p, max_tokens) for p in prompts))
        return list(outs), time.perf_counter() - t0


async def one_by_one(server: tuple[str, str], prompts: list[str], max_tokens: int) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=None) as client:
        return [await stream_one(client, server, p, max_tokens) for p in prompts]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--draft", default=None, help="DFlash drafter (default: the bundled one)")
    ap.add_argument("--no-sequential", action="store_true", help="skip the one-at-a-time reference run")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("serve_flags", nargs="*", help="after --: flags for both servers (e.g. --cpu-quant auto)")
    args = ap.parse_args(argv)
    args.draft = args.draft or str(bundled_draft_path())  # resolved only when not given
    chat, code = load_eval_prompts("mtbench", args.streams), load_eval_prompts("humaneval", args.streams)
    prompts = [p for pair in zip(chat, code) for p in pair][: args.streams]
    logs = Path(args.out.parent if args.out else ".")
    result: dict = {"streams": args.streams, "max_tokens": args.max_tokens, "serve_flags": args.serve_flags,
                    "command": "python -m benchmarks.serve_load " + " ".join(argv if argv is not None else
                    sys.argv[1:])}
    outputs = {}
    for mode, extra in (("plain", []), ("spec", ["--draft", args.draft])):
        proc, url, model, ready_s = start_server(["--device", "cpu", *extra, *args.serve_flags],
                                                 logs / f"serve_{mode}.log")
        server = (url, model)
        try:
            asyncio.run(concurrent(server, prompts[:2], 8))  # first-request costs stay out of the timing
            outs, wall = asyncio.run(concurrent(server, prompts, args.max_tokens))
            outputs[mode] = outs
            tokens = sum(map(len, outs))
            result[mode] = {"wall_s": round(wall, 2), "tokens": tokens, "tok_s": round(tokens / wall, 1),
                            "ready_s": round(ready_s, 1)}
            if mode == "plain" and not args.no_sequential:
                outputs["sequential"] = asyncio.run(one_by_one(server, prompts, args.max_tokens))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        schedule = [line for line in (logs / f"serve_{mode}.log").read_text().splitlines() if "draft length" in line]
        result[mode]["schedule"] = schedule[-1] if schedule else None
        print(f"{mode}: {result[mode]}", flush=True)
    result["speedup"] = round(result["spec"]["tok_s"] / result["plain"]["tok_s"], 3)
    ref = outputs.get("sequential", outputs["plain"])
    result["identical_to"] = "sequential" if "sequential" in outputs else "plain concurrent"
    result["spec_differs"] = sum(a != b for a, b in zip(outputs["spec"], ref))
    result["plain_differs"] = sum(a != b for a, b in zip(outputs["plain"], ref))
    print(json.dumps({k: v for k, v in result.items() if k not in ("plain", "spec")}))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
