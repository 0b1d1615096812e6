"""Compiling the native kernels (the C files beside this one) with the machine's C compiler, once per source version,
compiler and CPU, into the user cache: BLOCKSPEC_CACHE_DIR (default ~/.cache/blockspec) + /native.

Each build try (TRIES: -march=native, then without AMX intrinsics, then for a generic x86) has its own cache key:
a hash of the sources and headers, COMMON_FLAGS, the CPU's feature flags, the compiler (its resolved path, size and
modification time: an upgraded compiler builds again) and the try's flags. A try that built leaves
`blockspec-native-<source>-<key>.so`; one that failed leaves `<...>.failed` holding the compiler's reason, and no later
process runs it again (the negative cache). Where every try failed, or there is no compiler, the process that found out
logs one line with the reason (logger "blockspec.native", a warning: on stderr unless logging is configured); later
processes read the reason from the cache and stay quiet. Deleting the cache directory makes the next process try
again (the line says which directory).

BLOCKSPEC_NATIVE (read by lib.py): "0" (or "off", "false", "no") never builds nor loads the kernels; anything else,
or unset, builds them on first use. CC: the compiler to run (a command, words split as a shell would), else `cc`, else
`gcc`."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

log = logging.getLogger("blockspec.native")

HERE = Path(__file__).parent
SOURCES = [HERE / n for n in ("q4gemm.c", "q8gemm.c", "amx.c", "attend.c", "decoder.c", "draft.c", "layout.c")]
HEADERS = [HERE / "native.h"]
# -ffp-contract=off: no multiply-add is fused in one place and not in another (decoder.c's exactness);
# -fno-math-errno, -fno-trapping-math: sqrtf and lrintf become single instructions and the loops with conversions and
# clamps (exp, SiLU) vectorize; neither lets the compiler change a result (no reassociation, no fast math)
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]
# in order: the SIMD paths carry their own target attributes; -march=native vectorizes decoder.c's loops; a compiler
# without AMX intrinsics builds the other paths (BLOCKSPEC_NO_AMX); one without -march=native builds generic code
TRIES: tuple[tuple[str, ...], ...] = (("-march=native",), ("-march=native", "-DBLOCKSPEC_NO_AMX"), (),
                                      ("-DBLOCKSPEC_NO_AMX",))
PREFIX = "blockspec-native-"


@dataclass(frozen=True)
class Build:
    """The outcome of build(): the library's path, or None and why there is none (one line)."""

    library: Path | None
    reason: str | None = None


def cache_dir() -> Path:
    return Path(os.environ.get("BLOCKSPEC_CACHE_DIR") or Path.home() / ".cache" / "blockspec") / "native"


def compiler() -> list[str] | None:
    """The compiler command (CC, else cc, else gcc) with its path resolved, or None where there is none."""
    words = shlex.split(os.environ.get("CC", "")) or ["cc"]
    found = shutil.which(words[0]) or shutil.which("gcc")
    return None if found is None else [found, *words[1:]]


def _digest(*parts: bytes) -> str:
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _cpu() -> bytes:
    """The machine and its CPU's feature flags: a -march=native library runs on this instruction set only, so a cache
    shared by two machines keeps one build each."""
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_bytes().splitlines() if ln.startswith(b"flags")), b"")
    except OSError:
        flags = b""
    return platform.machine().encode() + b" " + flags


def source_key(extra_flags: Sequence[str] = ()) -> str:
    """What every build of these sources for this CPU shares, whatever the compiler."""
    return _digest(*(p.read_bytes() for p in SOURCES + HEADERS), " ".join(COMMON_FLAGS + list(extra_flags)).encode(),
                   _cpu())


def _compiler_id(cc: list[str]) -> bytes:
    """The compiler as it is now: a new version (another file, size or time) is another key, so it builds again."""
    try:
        st = Path(cc[0]).resolve().stat()
    except OSError:
        return " ".join(cc).encode()
    return f"{Path(cc[0]).resolve()} {st.st_size} {st.st_mtime_ns} {' '.join(cc[1:])}".encode()


def _reason(cc: list[str], done: subprocess.CompletedProcess) -> str:
    """The compiler's failure in one line: its first error line, else its first line, else the exit status."""
    lines = [ln.strip() for ln in (done.stderr or "").splitlines() if ln.strip()]
    line = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "")
    if not line:
        return f"{Path(cc[0]).name} exited with status {done.returncode} and printed nothing"
    return f"{Path(cc[0]).name}: {line[:200]}"


def _compile(cc: list[str], out: Path, flags: Sequence[str]) -> str | None:
    """Build the library at `out`; None, or why it did not build."""
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    try:
        done = subprocess.run([*cc, *COMMON_FLAGS, *flags, "-o", str(tmp), *map(str, SOURCES), "-lm"],
                              capture_output=True, text=True, errors="replace")
    except OSError as e:  # not executable, vanished
        return f"{Path(cc[0]).name} could not run: {e}"
    if done.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        return _reason(cc, done)
    tmp.replace(out)  # atomic: two processes building at once never load half a file
    return None


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)


def _give_up(directory: Path, reason: str) -> Build:
    log.warning("blockspec: the native CPU kernels are not built (%s); --cpu-quant runs torch's kernels instead. "
                "Delete %s to try again, or set BLOCKSPEC_NATIVE=0 to skip them.", reason, directory)
    return Build(None, reason)


def build(extra_flags: Sequence[str] = (), directory: Path | None = None) -> Build:
    """The library for these sources, this CPU and this compiler: cached, else built now (a few seconds per try),
    else Build(None, reason). extra_flags go into every try and the keys (the build test's portable build)."""
    directory = directory or cache_dir()
    source = source_key(extra_flags)
    cc = compiler()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return _give_up(directory, f"the cache directory cannot be made: {e}")
    if cc is None:
        # no compiler: a library an earlier one built for these sources still runs
        built = sorted(directory.glob(f"{PREFIX}{source}-*.so"), key=lambda p: p.stat().st_mtime)
        if built:
            return Build(built[-1])
        marker = directory / f"{PREFIX}{source}-no-compiler.failed"
        if marker.is_file():  # said once already (once a compiler is on PATH, this marker is not read)
            return Build(None, marker.read_text().strip())
        reason = f"no C compiler: neither {os.environ.get('CC') or 'cc'} nor gcc is on PATH"
        try:
            _write(marker, reason)
        except OSError:
            pass  # an unwritable cache: the next process says so again
        return _give_up(directory, reason)
    ident, reason, tried = _compiler_id(cc), None, False
    for flags in TRIES:
        key = _digest(source.encode(), ident, " ".join(flags).encode())
        lib, failed = directory / f"{PREFIX}{source}-{key}.so", directory / f"{PREFIX}{source}-{key}.failed"
        if lib.is_file():
            return Build(lib)
        if failed.is_file():  # this compiler failed these flags before: not again
            reason = failed.read_text().strip()
            continue
        log.info("blockspec: building the native CPU kernels (%s)", " ".join([*cc, *extra_flags, *flags]))
        reason, tried = _compile(cc, lib, [*extra_flags, *flags]), True
        if reason is None:
            return Build(lib)
        log.info("blockspec: the native build with %r failed: %s", " ".join(flags), reason)
        try:
            _write(failed, reason)
        except OSError:
            pass  # an unwritable cache: the next process tries again (and says so again)
    # every try failed: the process that ran the compiler says why, once; later ones found it all in the cache
    return _give_up(directory, reason or "") if tried else Build(None, reason)
