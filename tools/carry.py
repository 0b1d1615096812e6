"""Carry a file larger than one device call to the GPU machine, in parts, verified at every step.

Each device `run` call sends the repository's tracked tree plus the ignored paths named in `carry`, 64 MiB at most,
and the machine keeps what a call wrote only while it stays warm. So a big file (a real target's GGUF) travels as
parts, one per call, back to back: `split` cuts it into parts that fit next to the measured tree and writes a
manifest (each part's size and sha256, the whole file's); `plan` prints, per call, the `carry` path and the shell
command that checks the part and appends it on the machine, the last one joining, checking and moving the whole
file into place; `join` does the same here. The way back is narrower (a call returns at most 8 files of 16 MiB, 64 MiB
in all, from the device's $OUT): `back` cuts a file written there (a trained drafter's model.safetensors) into parts
that each come back, in any folder, and `join` re-assembles them here. Usage:
  python tools/carry.py split FILE --parts-dir .carry/NAME [--mib N]
  python tools/carry.py plan .carry/NAME [--dest PATH] [--stage DIR]
  python tools/carry.py join .carry/NAME DEST
  python tools/carry.py back FILE --parts-dir $OUT/NAME [--mib N]     # on the device machine; then join here"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # what one device call may send: the tree plus its carried paths
MARGIN = 2 * MIB  # the tree grows between a split and the last call (other people's edits)
MANIFEST = "manifest.json"
RETURN_FILE = 16 * MIB  # the largest file one call brings back from the device's $OUT
RETURN_FILES = 8  # files one call brings back
RETURN_TOTAL = 64 * MIB  # bytes one call brings back
BACK_PART = 15 * MIB  # a MiB under RETURN_FILE: a part at the cap itself is one rounding away from being left out
# names and paths end up unquoted inside the device commands: keep them to characters no shell treats specially
SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
SAFE_PATH = re.compile(r"^[A-Za-z0-9._/-]+$")


class CarryError(Exception):
    """Bad input to a step (a file, a part, an option); the message names it."""


class Call(NamedTuple):
    carry: str  # the path, relative to the repository root, that this call names in `carry`
    command: str  # what it runs on the device machine, from the repository root


def tree_bytes(root: Path) -> int:
    """What every call sends before any carried path: tracked files and untracked ones git does not ignore (as they
    are on disk now), plus a shared/ folder inside the checkout, which travels even when ignored."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.decode().split("\0")
    paths = {root / p for p in listed if p}
    if (root / "shared").is_dir():
        paths.update(p for p in (root / "shared").rglob("*") if not p.is_dir())
    return sum(p.lstat().st_size for p in paths if os.path.lexists(p))


def default_part_bytes(tree: int) -> int:
    """The largest whole number of MiB that fits one call next to the tree, with MARGIN to spare."""
    mib = (CALL_LIMIT - tree - MARGIN) // MIB
    if mib < 1:
        raise CarryError(f"the tree alone is {tree / MIB:.1f} MiB: no room for a part within a 64 MiB call")
    return mib * MIB


def check_carriable(root: Path, parts_dir: Path) -> str:
    """parts_dir relative to the repository root: inside it (a call carries only paths there) and ignored by git
    (else every call would send all the parts as untracked files)."""
    try:
        rel = parts_dir.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        raise CarryError(f"{parts_dir}: not inside the repository {root}, so no call can carry it") from None
    if subprocess.run(["git", "check-ignore", "-q", rel], cwd=root).returncode != 0:
        raise CarryError(f"{parts_dir}: not ignored by git, so every call would send all its parts "
                         "(add it to .gitignore)")
    return rel


def split(file: Path, parts_dir: Path, part_bytes: int) -> dict:
    """parts_dir/part001.bin ... of part_bytes each (the last one shorter) and the manifest; returns the manifest."""
    if not SAFE_NAME.match(parts_dir.name):
        raise CarryError(f"{parts_dir}: the folder's name may hold only letters, digits, '.', '_' and '-'")
    if not file.is_file() or file.stat().st_size == 0:
        raise CarryError(f"{file}: no such file, or empty")
    if part_bytes < 1:
        raise CarryError(f"--mib: a part must hold at least one byte (got {part_bytes} bytes)")
    if parts_dir.exists() and any(parts_dir.iterdir()):
        raise CarryError(f"{parts_dir}: already holds files; remove it first")
    parts_dir.mkdir(parents=True, exist_ok=True)
    whole, parts = hashlib.sha256(), []
    with open(file, "rb") as src:
        while data := src.read(part_bytes):
            whole.update(data)
            name = f"part{len(parts) + 1:03d}.bin"
            (parts_dir / name).write_bytes(data)
            parts.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"file": file.name, "size": sum(p["size"] for p in parts), "sha256": whole.hexdigest(),
                "parts": parts}
    (parts_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def split_back(file: Path, parts_dir: Path, part_bytes: int = BACK_PART) -> dict:
    """split() for the way back from the device: any folder (no tree shares the way back, so no size is measured),
    parts no larger than one returned file may be."""
    if not 1 <= part_bytes <= RETURN_FILE:
        raise CarryError(f"--mib: a part that comes back holds 1 byte to {RETURN_FILE // MIB} MiB "
                         f"(got {part_bytes} bytes)")
    return split(file, parts_dir, part_bytes)


def return_calls(sizes: list[int]) -> int:
    """How many calls bring back files of these sizes, in order, each call at most RETURN_FILES files and
    RETURN_TOTAL bytes."""
    calls, files, total = 1, 0, 0
    for size in sizes:
        if size > RETURN_FILE:
            raise CarryError(f"a {size / MIB:.1f} MiB file never comes back (at most {RETURN_FILE // MIB} MiB a file)")
        if files == RETURN_FILES or total + size > RETURN_TOTAL:
            calls, files, total = calls + 1, 0, 0
        files, total = files + 1, total + size
    return calls


def read_manifest(parts_dir: Path) -> dict:
    path = parts_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        manifest = None
    keys = {"file", "size", "sha256", "parts"}
    if not isinstance(manifest, dict) or not keys <= manifest.keys() or not manifest["parts"]:
        raise CarryError(f"{path}: missing or not a manifest written by `carry.py split`")
    return manifest


def _fail(name: str, message: str) -> str:
    """A shell clause that ends the whole command with one line; $-variables in message expand there."""
    return f'{{ echo "carry {name}: {message}"; exit 3; }}'


def _sha_check(name: str, var: str, sha: str, where: str) -> str:
    return (f"e={sha}; g=$(sha256sum < ${var} | cut -d' ' -f1); "
            f'[ "$g" = "$e" ] || {_fail(name, f"{where}${var} sha256 expected $e, got $g")}')


def plan(parts_dir_rel: str, manifest: dict, dest: str, stage: str) -> list[Call]:
    """One Call per part. Each checks its part's sha256 and that the staged file holds exactly the parts before it
    (a skipped or repeated call, or a machine that went cold between calls, is refused, not silently joined), then
    appends it; the last one checks the whole file's sha256 and moves it to dest."""
    name = Path(parts_dir_rel).name
    for what, value in (("--dest", dest), ("--stage", stage), ("parts dir", parts_dir_rel)):
        if not SAFE_PATH.match(value):
            raise CarryError(f"{what} {value!r}: may hold only letters, digits, '.', '_', '-' and '/'")
    parts, staged = manifest["parts"], f"{stage}/{name}.partial"
    calls, offset = [], 0
    for i, part in enumerate(parts, start=1):
        where = f"part {i}/{len(parts)}"
        p, end = f"{parts_dir_rel}/{part['name']}", offset + part["size"]
        steps = [f"P={p} T={staged}",
                 "[ -f $P ] || " + _fail(name, f"{where}: $P is missing (name it in this call's carry)"),
                 _sha_check(name, "P", part["sha256"], f"{where}: ")]
        if i == 1:
            steps += [f"mkdir -p {stage}", "rm -f $T"]
        else:
            steps.append("n=$(stat -c %s $T 2>/dev/null || echo no); "
                         f'[ "$n" = {offset} ] || '
                         + _fail(name, f"{where} goes at byte {offset} but $T holds $n bytes (a call skipped or "
                                       "repeated, or the machine went cold: start again at call 1)"))
        steps += ["cat $P >> $T || " + _fail(name, f"{where}: could not append $P to $T"),
                  f'rm $P; echo "carry {name}: {where} appended, {end} of {manifest["size"]} bytes"']
        if i == len(parts):
            steps += [_sha_check(name, "T", manifest["sha256"], ""),
                      f"mkdir -p {Path(dest).parent.as_posix()} && mv $T {dest} || "
                      + _fail(name, f"could not move $T to {dest}"),
                      f'echo "carry {name}: {dest} verified"']
        calls.append(Call(p, "; ".join(steps)))
        offset = end
    return calls


def join(parts_dir: Path, dest: Path) -> Path:
    """What the planned calls do, here: every part checked before it is appended, the whole checked before it is
    moved to dest (a failed join leaves no dest behind)."""
    manifest = read_manifest(parts_dir)
    partial = dest.with_name(dest.name + ".partial")
    dest.parent.mkdir(parents=True, exist_ok=True)
    whole = hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for part in manifest["parts"]:
                path = parts_dir / part["name"]
                if not path.is_file():
                    raise CarryError(f"{path}: missing (the manifest lists {len(manifest['parts'])} parts)")
                data = path.read_bytes()
                got = hashlib.sha256(data).hexdigest()
                if got != part["sha256"]:
                    raise CarryError(f"{path}: sha256 expected {part['sha256']}, got {got}")
                whole.update(data)
                out.write(data)
        if whole.hexdigest() != manifest["sha256"]:
            raise CarryError(f"{dest}: sha256 of the joined parts expected {manifest['sha256']}, "
                             f"got {whole.hexdigest()}")
    except CarryError:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(dest)
    return dest


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="cut FILE into parts that each fit one call")
    s.add_argument("file", type=Path)
    s.add_argument("--parts-dir", type=Path, required=True, help="an ignored folder in the repository: .carry/NAME")
    s.add_argument("--mib", type=float, help="part size (default: what fits next to the measured tree)")
    pl = sub.add_parser("plan", help="print each call's carry path and device command")
    pl.add_argument("parts_dir", type=Path)
    pl.add_argument("--dest", help="final path on the device, from the repository root (default .cache/models/FILE)")
    pl.add_argument("--stage", default="/tmp/carry", help="where the device stages the partial file")
    b = sub.add_parser("back", help="on the device: cut FILE into parts that each come back from $OUT")
    b.add_argument("file", type=Path)
    b.add_argument("--parts-dir", type=Path, required=True, help="a new folder under the device's $OUT")
    b.add_argument("--mib", type=float, default=BACK_PART / MIB, help=f"part size (default {BACK_PART // MIB})")
    j = sub.add_parser("join", help="join and verify the parts here")
    j.add_argument("parts_dir", type=Path)
    j.add_argument("dest", type=Path)
    args = p.parse_args(argv)
    try:
        if args.cmd == "split":
            tree = tree_bytes(ROOT)
            check_carriable(ROOT, args.parts_dir)
            part = default_part_bytes(tree) if args.mib is None else round(args.mib * MIB)
            if tree + part > CALL_LIMIT:
                raise CarryError(f"--mib {args.mib}: {tree / MIB:.1f} MiB of tree + {part / MIB:.1f} MiB of part "
                                 f"is over the 64 MiB a call may send")
            m = split(args.file, args.parts_dir, part)
            print(f"{args.file}: {m['size']} bytes, sha256 {m['sha256']} -> {len(m['parts'])} parts of at most "
                  f"{part / MIB:.1f} MiB in {args.parts_dir} (tree {tree / MIB:.1f} MiB: one part per call)")
        elif args.cmd == "plan":
            rel = check_carriable(ROOT, args.parts_dir)
            m, tree = read_manifest(args.parts_dir), tree_bytes(ROOT)
            largest = max(part["size"] for part in m["parts"])
            if tree + largest > CALL_LIMIT:
                raise CarryError(f"{args.parts_dir}: the tree grew to {tree / MIB:.1f} MiB: a {largest / MIB:.1f} MiB "
                                 "part no longer fits a 64 MiB call (split again)")
            calls = plan(rel, m, args.dest or f".cache/models/{m['file']}", args.stage.rstrip("/"))
            print(f"# {m['file']}: {m['size']} bytes, sha256 {m['sha256']}, {len(calls)} calls back to back "
                  f"(each within ~30 s of the last, while the machine is warm)")
            for i, call in enumerate(calls, start=1):
                print(f"\n# call {i}/{len(calls)}\ncarry: {json.dumps([call.carry])}\ncommand: {call.command}")
        elif args.cmd == "back":
            m = split_back(args.file, args.parts_dir, round(args.mib * MIB))
            sizes = [(args.parts_dir / MANIFEST).stat().st_size] + [part["size"] for part in m["parts"]]
            print(f"{args.file}: {m['size']} bytes, sha256 {m['sha256']} -> {len(m['parts'])} parts + {MANIFEST} in "
                  f"{args.parts_dir}: {return_calls(sizes)} call(s) bring them back; then "
                  f"`python tools/carry.py join <that folder> DEST` here")
        else:
            dest = join(args.parts_dir, args.dest)
            print(f"{dest}: joined and verified")
    except CarryError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
