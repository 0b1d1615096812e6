"""Building and loading the native kernels (blockspec/native/build.py, lib.py, structs.py): a compiler that fails is
reported in one line, once, and never run again for the same sources and flags; no compiler at all likewise; the
portable (non-x86) code builds and computes the same bits; every exported function is typed; a ctypes mirror that
drifted from its C struct fails at load, naming the struct and the field."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockspec.layers import cpu_quant
from blockspec.native import build, lib, q4, structs

ROOT = Path(__file__).resolve().parents[1]
# a process that asks for the library and prints why there is none
PROBE = "from blockspec.native import lib; assert lib.library() is None; print(lib.unavailable_reason())"


def probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    """PROBE in a fresh process with `env` over this one's (the logging module unconfigured, as in the CLI)."""
    full = {k: v for k, v in os.environ.items() if k not in ("CC", "BLOCKSPEC_NATIVE")} | env
    return subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=120)


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def test_cc_false_says_why_once_and_later_processes_do_not_try_again(tmp_path):
    env = {"CC": "false", "BLOCKSPEC_CACHE_DIR": str(tmp_path)}
    first = probe(env)
    assert first.returncode == 0, first.stderr
    assert len(lines(first.stderr)) == 1, first.stderr
    assert "false exited with status 1" in first.stderr and str(tmp_path / "native") in first.stderr
    second = probe(env)
    assert second.returncode == 0, second.stderr
    assert lines(second.stderr) == []  # nothing tried, nothing to say
    assert "false exited with status 1" in second.stdout  # the reason is still there for a report


def test_a_failing_compiler_is_run_once_per_try_and_never_again(tmp_path):
    calls = tmp_path / "calls"
    cc = tmp_path / "stub-cc"
    cc.write_text(f"#!/bin/sh\necho run >> {calls}\necho 'stub.c:1: error: this compiler is a stub' >&2\nexit 1\n")
    cc.chmod(0o755)
    env = {"CC": str(cc), "BLOCKSPEC_CACHE_DIR": str(tmp_path / "cache")}
    first = probe(env)
    assert len(lines(first.stderr)) == 1, first.stderr
    assert "stub-cc: stub.c:1: error: this compiler is a stub" in first.stderr
    assert len(lines(calls.read_text())) == len(build.TRIES)  # each try once: its flags are part of its key
    assert len(list((tmp_path / "cache" / "native").glob("*.failed"))) == len(build.TRIES)
    second = probe(env)
    assert lines(second.stderr) == [] and len(lines(calls.read_text())) == len(build.TRIES)
    off = probe(env | {"BLOCKSPEC_NATIVE": "0"})
    assert lines(off.stderr) == [] and off.stdout.strip() == "BLOCKSPEC_NATIVE=0"


def test_no_compiler_on_path_says_so_once(tmp_path):
    env = {"CC": "no-such-cc", "PATH": str(tmp_path), "BLOCKSPEC_CACHE_DIR": str(tmp_path / "cache")}
    first, second = probe(env), probe(env)
    assert len(lines(first.stderr)) == 1 and "no C compiler" in first.stderr, first.stderr
    assert lines(second.stderr) == [] and "no C compiler" in second.stdout


needs_library = pytest.mark.skipif(q4.library() is None, reason="no C compiler here")


@needs_library
def test_the_portable_build_has_no_x86_code_and_computes_the_same_bits(tmp_path, monkeypatch):
    """What another architecture compiles (BLOCKSPEC_PORTABLE: the x86 guards off): no x86 header or intrinsic left
    after preprocessing, the scalar path only, and the same bits as this machine's build on every path."""
    cc = build.compiler()
    for source in build.SOURCES:
        pre = subprocess.run([*cc, "-E", "-fopenmp", "-DBLOCKSPEC_PORTABLE", str(source)], capture_output=True,
                             text=True, check=True).stdout
        assert not any(word in pre for word in ("immintrin", "_mm256", "_mm512", "__builtin_cpu")), source.name
    built = build.build(["-DBLOCKSPEC_PORTABLE"], tmp_path)
    assert built.library is not None, built.reason
    portable = lib.load(built.library)
    assert portable.q4_best_path() == 0
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(40, 96, generator=g) * 0.05, torch.randn(9, 96, generator=g)
    want = [q4.Q4Weights(*cpu_quant.q4_1_quantize(w)).matmul(x, p) for p in range(q4.best_path() + 1)]
    want8 = [q4.Q8Weights(*cpu_quant.q8_0_quantize(w)).matmul(x, p) for p in range(q4.best_path() + 1)]
    codes = q4.quantize_rows(x, 3)
    monkeypatch.setattr(q4, "library", lambda: portable)
    got = q4.Q4Weights(*cpu_quant.q4_1_quantize(w)).matmul(x, 0)
    got8 = q4.Q8Weights(*cpu_quant.q8_0_quantize(w)).matmul(x, 0)
    assert all(torch.equal(got, y) for y in want) and all(torch.equal(got8, y) for y in want8)
    assert all(torch.equal(a, b) for a, b in zip(q4.quantize_rows(x, 3), codes))


@needs_library
@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm here")
def test_every_exported_function_is_typed():
    path = build.build().library  # the library this process loaded: cached, not built again
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    exported = {parts[2] for parts in map(str.split, out.splitlines()) if len(parts) == 3 and parts[1] == "T"}
    assert exported == set(lib.SIGNATURES)
    for name in lib.SIGNATURES:
        assert getattr(q4.library(), name).argtypes is not None, name


@needs_library
def test_a_mirror_that_drifted_from_its_struct_fails_naming_the_struct_and_field():
    P, I = ctypes.c_void_p, ctypes.c_int

    class Swapped(ctypes.Structure):  # d and m the wrong way round: the same size, shifted fields
        _c_name_ = "qweight"
        _fields_ = [("packed", P), ("m", P), ("d", P), ("bias", P), ("N", I), ("K", I), ("bits", I)]

    class Short(ctypes.Structure):  # a field left out
        _c_name_ = "context_batch"
        _fields_ = [("T", I), ("n_taps", I), ("cos", P), ("sin", P)]

    structs.check_layout(q4.library())  # the real mirrors match
    with pytest.raises(structs.LayoutMismatch, match=r"qweight\.m"):
        structs.check_layout(q4.library(), (Swapped,))
    with pytest.raises(structs.LayoutMismatch, match="context_batch"):
        structs.check_layout(q4.library(), (Short,))
