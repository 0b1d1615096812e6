"""--cpu-quant's default (loading/quant_default.py): auto for a quantized GGUF target on the CPU, off for a float GGUF,
an HF directory, the GPU and tensor parallelism; an explicit value always wins; the commands load the bundled Q4_1
model on the fast path without a flag."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from blockspec.loading.load_config import LoadConfig
from blockspec.loading.quant_default import quantized_gguf, with_cpu_quant_default
from gguf_utils import write_gguf


def _gguf(tmp_path, file_type: int | None):
    meta = {"general.file_type": file_type} if file_type is not None else {}
    return str(write_gguf(tmp_path / f"m{file_type}.gguf", "llama", meta, [("x", np.zeros((8, 8), np.float32), None)]))


def test_bundled_q4_1_runs_quantized_on_the_cpu():
    assert quantized_gguf(None)
    assert with_cpu_quant_default(LoadConfig(device="cpu"), None).cpu_quant == "auto"
    assert with_cpu_quant_default(LoadConfig(device="cpu", cpu_quant="off"), None).cpu_quant == "off"
    assert with_cpu_quant_default(LoadConfig(device="cpu", cpu_quant="q8"), None).cpu_quant == "q8"
    assert with_cpu_quant_default(LoadConfig(device="cpu"), None, tensor_parallel_size=2).cpu_quant == "off"
    for other_path in ({"cpu_packed": True}, {"batch_invariant": True}):  # asked for another path: not overridden
        assert with_cpu_quant_default(LoadConfig(device="cpu", **other_path), None).cpu_quant == "off"


@pytest.mark.parametrize("file_type,quantized", [(0, False), (1, False), (32, False), (None, False), (2, True),
                                                 (7, True), (15, True)])
def test_float_files_stay_as_loaded(tmp_path, file_type, quantized):
    path = _gguf(tmp_path, file_type)
    assert quantized_gguf(path) is quantized
    assert with_cpu_quant_default(LoadConfig(device="cpu"), path).cpu_quant == ("auto" if quantized else "off")


def test_an_hf_directory_stays_as_loaded(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert not quantized_gguf(str(tmp_path))


def test_generate_without_flags_says_it_runs_the_fast_path():
    done = subprocess.run([sys.executable, "-m", "blockspec", "generate", "--prompt", "hi", "--chat",
                           "--max-tokens", "2", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    line = next(ln for ln in done.stderr.splitlines() if ln.startswith("blockspec: cpu"))
    assert "target q4" in line or "target q8" in line, line
    off = subprocess.run([sys.executable, "-m", "blockspec", "generate", "--prompt", "hi", "--chat", "--max-tokens",
                          "2", "--device", "cpu", "--cpu-quant", "off"], capture_output=True, text=True, timeout=300)
    assert off.returncode == 0, off.stderr
    assert "target q4" not in off.stderr and "target q8" not in off.stderr
