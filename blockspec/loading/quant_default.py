"""--cpu-quant's default: the quantized fast path for a quantized GGUF target on the CPU, the model as loaded
otherwise.

A Q4 / Q8 GGUF holds its weights in blocks the native kernels compute with as they are (native/q4gemm.c); dequantizing
them to fp32 for torch's matmuls reads 4-8x the bytes every step, and a new user who ran `blockspec generate` on the
bundled Q4_1 model got 0.16x the speed of the demo (issue 54). The fp32 dequantized model stays one flag away
(--cpu-quant off). A float GGUF, an HF directory and every GPU run keep their own weights (off)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from blockspec.loading.load_config import LoadConfig

# GGUF general.file_type values of unquantized files (llama.cpp's LLAMA_FTYPE_ALL_F32, MOSTLY_F16, MOSTLY_BF16)
FLOAT_FILE_TYPES = (0, 1, 32)


def quantized_gguf(model: str | None) -> bool:
    """Whether `model` (None: the bundled default) is a GGUF file whose weights are quantized (its metadata only is
    read; anything else, or a file that cannot be read, is left to the loader and its errors)."""
    from blockspec.errors import BlockspecError
    from blockspec.loading.bundled import find_bundled
    from blockspec.loading.gguf_io import read_metadata

    path = find_bundled() if model is None else Path(model).expanduser()
    if path is None or path.suffix != ".gguf" or not path.is_file():
        return False
    try:
        file_type = read_metadata(path).get("general.file_type")
    except BlockspecError:
        return False
    return file_type is not None and int(file_type) not in FLOAT_FILE_TYPES


def with_cpu_quant_default(load: LoadConfig, model: str | None, tensor_parallel_size: int = 1) -> LoadConfig:
    """`load` with cpu_quant decided where the user left it unset (None): "auto" for a quantized GGUF on the CPU with
    one process, else "off" (also where another CPU path was asked for: --cpu-packed, --batch-invariant)."""
    if load.cpu_quant is not None:
        return load
    if load.cpu_packed or load.batch_invariant:
        return replace(load, cpu_quant="off")
    from blockspec.loading.platform import resolve_device

    on_cpu = resolve_device(load.device).type == "cpu"
    fast = on_cpu and tensor_parallel_size == 1 and quantized_gguf(model)
    return replace(load, cpu_quant="auto" if fast else "off")
