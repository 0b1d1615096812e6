"""MXFP4 weights in HF safetensors checkpoints (gpt-oss's released expert banks), dequantized on the CPU at load.

A bank W [E, out, in] is stored as two uint8 tensors: `<name>_blocks` [E, out, in/32, 16], two e2m1 codes a byte (the
low nibble is the earlier value), and `<name>_scales` [E, out, in/32], one E8M0 exponent (bias 127) per 32 values:
w = FP4[code] * 2^(scale - 127). transformers' parameter `<name>` is the transpose [E, in, out] (what its bf16 gpt-oss
checkpoints store), so that is what `dequantized` hands on, under that name: the family's loader (models/gpt_oss.py)
then reads either kind of checkpoint alike. Every value is exact in bf16 (at most two significant bits, exponents
within bf16's range), so bf16 is the dequantized dtype: half of fp32's memory, nothing rounded.

On the GPU the weights are dequantized at load too (to the model's dtype, by the same loader): no MXFP4 kernel yet."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from blockspec.errors import ModelLoadError

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SUFFIXES = ("_blocks", "_scales")
_CHUNK = 1 << 18  # groups of 32 values dequantized at once


def _byte_table() -> torch.Tensor:
    """[256, 2] fp32: the two values of each byte, low nibble first (one gather per byte instead of two)."""
    codes = torch.arange(256)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    return torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=1)


def _powers_of_two(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8) -> 2^(s - 127) in fp32, exactly: built from the bits (s = 0 is the subnormal 2^-127,
    s = 255 is NaN), not through exp2, whose rounding at the range's ends is the library's."""
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, torch.tensor(1 << 22, dtype=torch.int32), s << 23)
    bits = torch.where(s == 255, torch.tensor(0x7FC00000, dtype=torch.int32), bits)
    return bits.view(torch.float32)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] in `dtype`, _CHUNK groups at a time so
    the fp32 and index temporaries stay small whatever the bank's size."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         f"(blocks are [..., G, 16], scales [..., G])")
    table = _byte_table()
    groups, exps = blocks.reshape(-1, 16), scales.reshape(-1)
    out = torch.empty(groups.shape[0], 32, dtype=dtype)
    for a in range(0, groups.shape[0], _CHUNK):
        b = min(a + _CHUNK, groups.shape[0])
        # a power of two times a value of at most two significant bits: exact in fp32 and in bf16
        out[a:b] = table[groups[a:b].long()].flatten(1) * _powers_of_two(exps[a:b])[:, None]
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * 32)


def dequantized(tensors: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs with each `<name>_blocks` + `<name>_scales` pair (uint8) replaced by
    `<name>`, dequantized and transposed to HF's [E, in, out] (a view); every other tensor passed on as it is. The
    two halves of a pair may come in either order and from different shard files: the first is held until the
    second arrives."""
    pending: dict[str, tuple[str, torch.Tensor]] = {}
    for name, t in tensors:
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None or t.dtype != torch.uint8:
            yield name, t
            continue
        base = name[:-len(suffix)]
        other = pending.pop(base, None)
        if other is None or other[0] == suffix:
            if other is not None:
                raise ModelLoadError(f"{source}: tensor {name!r} appears twice")
            pending[base] = (suffix, t)
            continue
        blocks, scales = (t, other[1]) if suffix == "_blocks" else (other[1], t)
        try:
            dense = dequantize(blocks, scales)
        except ValueError as e:
            raise ModelLoadError(f"{source}: MXFP4 tensors {base + '_blocks'!r} / {base + '_scales'!r}: {e}") from None
        yield base, dense.transpose(-1, -2)
    if pending:
        base, (suffix, _) = next(iter(pending.items()))
        missing = base + ("_scales" if suffix == "_blocks" else "_blocks")
        raise ModelLoadError(f"{source}: MXFP4 tensor {base + suffix!r} has no {missing!r} to pair with")
