"""tools/carry.py: a file cut into parts, carried call by call (the planned shell commands, run here with bash) or
joined here, comes back byte for byte; a corrupted, missing or out-of-order part is refused with one line naming it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tool_utils import load_tool

carry = load_tool("carry")
PART = 3000


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def blob(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(os.urandom(4 * PART + 123))  # 5 parts, the last one short
    return path


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A stand-in for the repository root: the planned commands run from it, as on the device machine."""
    root = tmp_path / "repo"
    root.mkdir()
    return root


def split_into(repo: Path, blob: Path) -> tuple[Path, dict]:
    parts_dir = repo / ".carry" / "m"
    return parts_dir, carry.split(blob, parts_dir, PART)


def run_call(repo: Path, call: carry.Call) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", call.command], cwd=repo, capture_output=True, text=True)


def planned(repo: Path, manifest: dict) -> list[carry.Call]:
    return carry.plan(".carry/m", manifest, "models/model.gguf", str(repo / "stage"))


def test_split_writes_sized_hashed_parts_and_manifest(repo: Path, blob: Path) -> None:
    parts_dir, m = split_into(repo, blob)
    assert [p["size"] for p in m["parts"]] == [PART] * 4 + [123]
    assert m["size"] == blob.stat().st_size and m["sha256"] == sha256_of(blob) and m["file"] == "model.gguf"
    assert json.loads((parts_dir / carry.MANIFEST).read_text()) == m
    data = blob.read_bytes()
    for i, p in enumerate(m["parts"]):
        assert (parts_dir / p["name"]).read_bytes() == data[i * PART:(i + 1) * PART]
        assert sha256_of(parts_dir / p["name"]) == p["sha256"]


def test_join_round_trip(repo: Path, blob: Path, tmp_path: Path) -> None:
    parts_dir, _ = split_into(repo, blob)
    out = carry.join(parts_dir, tmp_path / "out" / "joined.gguf")
    assert out.read_bytes() == blob.read_bytes()
    assert not (tmp_path / "out" / "joined.gguf.partial").exists()


def test_planned_calls_in_order_rebuild_the_file_at_dest(repo: Path, blob: Path) -> None:
    parts_dir, m = split_into(repo, blob)
    calls = planned(repo, m)
    assert [c.carry for c in calls] == [f".carry/m/part{i:03d}.bin" for i in range(1, 6)]
    for i, call in enumerate(calls, start=1):
        done = run_call(repo, call)
        assert done.returncode == 0, done.stdout
        assert f"part {i}/5 appended" in done.stdout
        assert not (repo / call.carry).exists()  # the machine drops each part once appended
    assert "models/model.gguf verified" in done.stdout
    assert (repo / "models" / "model.gguf").read_bytes() == blob.read_bytes()
    assert not (repo / "stage" / "m.partial").exists()


def test_planned_call_out_of_order_is_refused(repo: Path, blob: Path) -> None:
    _, m = split_into(repo, blob)
    calls = planned(repo, m)
    skipped = run_call(repo, calls[1])  # call 2 before call 1: nothing staged yet (or a machine gone cold)
    assert skipped.returncode == 3
    assert skipped.stdout.strip() == (f"carry m: part 2/5 goes at byte {PART} but {repo}/stage/m.partial holds no "
                                      "bytes (a call skipped or repeated, or the machine went cold: start again at "
                                      "call 1)")
    assert run_call(repo, calls[0]).returncode == 0
    jumped = run_call(repo, calls[2])  # call 3 right after call 1
    assert jumped.returncode == 3 and f"part 3/5 goes at byte {2 * PART} but" in jumped.stdout
    assert f"holds {PART} bytes" in jumped.stdout
    assert (repo / "stage" / "m.partial").stat().st_size == PART  # nothing appended by the refused calls


def test_corrupted_part_is_refused_naming_it(repo: Path, blob: Path, tmp_path: Path) -> None:
    parts_dir, m = split_into(repo, blob)
    bad = parts_dir / "part002.bin"
    data = bytearray(bad.read_bytes())
    data[7] ^= 0xFF
    bad.write_bytes(bytes(data))
    got = sha256_of(bad)
    with pytest.raises(carry.CarryError) as e:
        carry.join(parts_dir, tmp_path / "joined.gguf")
    assert str(e.value) == f"{bad}: sha256 expected {m['parts'][1]['sha256']}, got {got}"
    assert not (tmp_path / "joined.gguf").exists() and not (tmp_path / "joined.gguf.partial").exists()
    calls = planned(repo, m)
    assert run_call(repo, calls[0]).returncode == 0
    done = run_call(repo, calls[1])
    assert done.returncode == 3
    assert done.stdout.strip() == (f"carry m: part 2/5: .carry/m/part002.bin sha256 expected "
                                   f"{m['parts'][1]['sha256']}, got {got}")


def test_missing_part_is_refused_naming_it(repo: Path, blob: Path, tmp_path: Path) -> None:
    parts_dir, m = split_into(repo, blob)
    (parts_dir / "part004.bin").unlink()
    with pytest.raises(carry.CarryError, match=r"part004\.bin: missing \(the manifest lists 5 parts\)"):
        carry.join(parts_dir, tmp_path / "joined.gguf")
    done = run_call(repo, planned(repo, m)[3])
    assert done.returncode == 3
    assert done.stdout.strip() == "carry m: part 4/5: .carry/m/part004.bin is missing (name it in this call's carry)"


def test_joined_file_with_wrong_whole_sha_is_not_kept(repo: Path, blob: Path, tmp_path: Path) -> None:
    parts_dir, m = split_into(repo, blob)
    wrong = {**m, "sha256": "0" * 64}
    (parts_dir / carry.MANIFEST).write_text(json.dumps(wrong))
    with pytest.raises(carry.CarryError, match=f"joined.gguf: sha256 of the joined parts expected {'0' * 64}, got "
                                              f"{m['sha256']}"):
        carry.join(parts_dir, tmp_path / "joined.gguf")
    assert not (tmp_path / "joined.gguf").exists()
    calls = planned(repo, wrong)
    outputs = [run_call(repo, c) for c in calls]
    assert [o.returncode for o in outputs] == [0] * 4 + [3]
    assert outputs[-1].stdout.strip().endswith(f"m.partial sha256 expected {'0' * 64}, got {m['sha256']}")
    assert not (repo / "models" / "model.gguf").exists()


def test_split_refuses_bad_input(repo: Path, blob: Path, tmp_path: Path) -> None:
    with pytest.raises(carry.CarryError, match="nope.gguf: no such file, or empty"):
        carry.split(tmp_path / "nope.gguf", repo / ".carry" / "x", PART)
    with pytest.raises(carry.CarryError, match="--mib: a part must hold at least one byte"):
        carry.split(blob, repo / ".carry" / "x", 0)
    with pytest.raises(carry.CarryError, match="the folder's name may hold only"):
        carry.split(blob, repo / ".carry" / "a b", PART)
    split_into(repo, blob)
    with pytest.raises(carry.CarryError, match="already holds files; remove it first"):
        split_into(repo, blob)
    with pytest.raises(carry.CarryError, match="manifest.json: missing or not a manifest"):
        carry.join(tmp_path, tmp_path / "joined.gguf")
    with pytest.raises(carry.CarryError, match="--dest 'a b': may hold only"):
        carry.plan(".carry/m", carry.read_manifest(repo / ".carry" / "m"), "a b", "/tmp/carry")


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def test_tree_size_counts_what_a_call_sends(tmp_path: Path) -> None:
    root = tmp_path / "r"
    root.mkdir()
    git(root, "init", "-q")
    (root / ".gitignore").write_text("/.carry/\n")
    (root / "tracked.bin").write_bytes(b"x" * 1000)
    git(root, "add", ".gitignore", "tracked.bin")
    (root / "untracked.txt").write_bytes(b"y" * 300)  # not ignored: it travels too
    (root / ".carry").mkdir()
    (root / ".carry" / "big.bin").write_bytes(b"z" * 5000)  # ignored: only what a call names in carry travels
    assert carry.tree_bytes(root) == len("/.carry/\n") + 1000 + 300
    assert carry.check_carriable(root, root / ".carry" / "m") == ".carry/m"
    with pytest.raises(carry.CarryError, match="not ignored by git, so every call would send all its parts"):
        carry.check_carriable(root, root / "parts")
    with pytest.raises(carry.CarryError, match="not inside the repository"):
        carry.check_carriable(root, tmp_path / "elsewhere")


def test_default_part_size_fills_the_call_with_margin() -> None:
    tree = 33_213_113  # the repository's tracked files when this tool was written
    part = carry.default_part_bytes(tree)
    assert part == 30 * carry.MIB
    assert tree + part + carry.MARGIN <= carry.CALL_LIMIT < tree + part + carry.MIB + carry.MARGIN
    with pytest.raises(carry.CarryError, match="no room for a part"):
        carry.default_part_bytes(63 * carry.MIB)


def test_cli_split_and_plan(tmp_path: Path, blob: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "r"
    root.mkdir()
    git(root, "init", "-q")
    (root / ".gitignore").write_text("/.carry/\n")
    monkeypatch.setattr(carry, "ROOT", root)
    monkeypatch.chdir(root)
    with pytest.raises(SystemExit, match="error: parts: not ignored by git"):
        carry.main(["split", str(blob), "--parts-dir", "parts"])
    with pytest.raises(SystemExit, match=r"error: --mib 64.0: 0.0 MiB of tree \+ 64.0 MiB of part is over"):
        carry.main(["split", str(blob), "--parts-dir", ".carry/m", "--mib", "64"])
    carry.main(["split", str(blob), "--parts-dir", ".carry/m", "--mib", str(PART / carry.MIB)])
    assert "-> 5 parts" in capsys.readouterr().out
    carry.main(["plan", ".carry/m"])
    out = capsys.readouterr().out
    assert out.count("\ncarry: [") == 5 and '# call 5/5\ncarry: [".carry/m/part005.bin"]' in out
    assert "mv $T .cache/models/model.gguf" in out


def test_back_parts_fit_the_way_back_and_join_to_the_same_drafter(tmp_path: Path) -> None:
    """A drafter's model.safetensors, cut on the device by `back` and joined here, loads to the same tensors."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    tensors = {"fc.weight": torch.randn(64, 96).to(torch.bfloat16), "norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    src = tmp_path / "run" / "model.safetensors"
    src.parent.mkdir()
    save_file(tensors, str(src), metadata={"format": "pt"})
    back = tmp_path / "OUT" / "model-parts"
    m = carry.split_back(src, back, 5000)
    assert [p["size"] for p in m["parts"]][:-1] == [5000] * (len(m["parts"]) - 1) and len(m["parts"]) == 3
    assert m["file"] == "model.safetensors" and m["sha256"] == sha256_of(src)
    assert all(carry.SAFE_NAME.match(p.name) for p in back.iterdir())  # the only names a call brings back
    joined = carry.join(back, tmp_path / "drafter" / "model.safetensors")
    assert joined.read_bytes() == src.read_bytes()
    got = load_file(str(joined))
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_back_refuses_parts_over_the_return_cap(blob: Path, tmp_path: Path) -> None:
    with pytest.raises(carry.CarryError) as e:
        carry.split_back(blob, tmp_path / "p", carry.RETURN_FILE + 1)
    assert str(e.value) == f"--mib: a part that comes back holds 1 byte to 16 MiB (got {16 * carry.MIB + 1} bytes)"
    with pytest.raises(SystemExit, match=r"^error: --mib: a part that comes back holds 1 byte to 16 MiB "
                                         r"\(got 17825792 bytes\)$"):
        carry.main(["back", str(blob), "--parts-dir", str(tmp_path / "p"), "--mib", "17"])
    assert not (tmp_path / "p").exists()


def test_return_calls_count_files_and_bytes() -> None:
    mib = carry.MIB
    assert carry.return_calls([mib] * 8) == 1
    assert carry.return_calls([mib] * 9) == 2  # eight files a call
    assert carry.return_calls([15 * mib] * 5) == 2  # 75 MiB: over the 64 a call returns
    assert carry.return_calls([16 * mib] * 4 + [1]) == 2
    # the Qwen2.5-Coder-1.5B drafter of tools/train_target_drafter.sh (47,994,392 bytes): manifest, 4 parts, run.tgz
    drafter = 47_994_392
    assert carry.return_calls([2_000] + [carry.BACK_PART] * 3 + [drafter - 3 * carry.BACK_PART] + [200_000]) == 1
    with pytest.raises(carry.CarryError, match=r"^a 16\.0 MiB file never comes back \(at most 16 MiB a file\)"):
        carry.return_calls([16 * mib + 1])


def test_cli_back_then_join(blob: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parts = tmp_path / "OUT" / "model-parts"
    carry.main(["back", str(blob), "--parts-dir", str(parts), "--mib", str(PART / carry.MIB)])
    out = capsys.readouterr().out
    assert f"-> 5 parts + manifest.json in {parts}: 1 call(s) bring them back" in out
    carry.main(["join", str(parts), str(tmp_path / "here" / "model.gguf")])
    assert (tmp_path / "here" / "model.gguf").read_bytes() == blob.read_bytes()
