"""Read a llama.cpp GGUF file as an HF-style config dict plus HF-named float32 tensors (and its tokenizer).

The header is parsed here rather than with `gguf.GGUFReader`: that reader builds a memmap view per
token string, which takes ~5 s for a 49k-token vocabulary; walking the same bytes with `struct` takes
a fraction of a second. The `gguf` package is still used for type constants and dequantization.
"""

from __future__ import annotations

import mmap
import re
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, GGUFValueType as VT
from gguf.quants import dequantize

from blockspec.errors import ModelLoadError
from blockspec.loading import gguf_gpt_oss
from blockspec.loading.gguf_moe import EXPERT_SLOT, MOE_BLK, check_bank, moe_config
from blockspec.models.registry import gguf_architectures

_TYPES = {QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.MXFP4}
_SCALARS = {VT.UINT8: "B", VT.INT8: "b", VT.UINT16: "H", VT.INT16: "h", VT.UINT32: "I", VT.INT32: "i",
            VT.FLOAT32: "f", VT.BOOL: "?", VT.UINT64: "Q", VT.INT64: "q", VT.FLOAT64: "d"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
# Tensors llama.cpp computes for its own kernels (e.g. Llama-3 RoPE frequency factors); no HF weight.
_NO_HF = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
_BLK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", **MOE_BLK}
_BLK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# an architecture's own block tensor kinds over _BLK, and its own config.json fields (meta, base config, path)
_ARCH_BLK = {gguf_gpt_oss.ARCH: {**_BLK, **gguf_gpt_oss.BLK}}
_ARCH_CONFIG = {gguf_gpt_oss.ARCH: gguf_gpt_oss.config}
_MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(frozen=True)
class _TensorInfo:
    name: str  # GGUF name
    hf_name: str
    shape: tuple[int, ...]  # numpy order (ggml's ne reversed), i.e. [out, in] for matrices
    qtype: QT
    offset: int  # absolute byte offset in the file
    nbytes: int
    unpermute_heads: int = 0  # >0: undo llama.cpp's q/k row permutation with this many heads


class _Header:
    """Sequential little-endian reader over the mapped file; struct.error on overrun means truncation."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string runs past the end of the file")
        s = self.buf[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        vtype = VT(vtype)
        if vtype == VT.STRING:
            return self.string()
        if vtype == VT.ARRAY:
            etype, count = VT(self.scalar("I")), self.scalar("Q")
            if etype in _SCALARS and etype != VT.BOOL:  # numeric arrays in one go (token types, scores)
                fmt = _SCALARS[etype]
                vals = np.frombuffer(self.buf, "<" + fmt, count, self.pos).tolist()
                self.pos += count * struct.calcsize(fmt)
                return [_f32(v) for v in vals] if etype == VT.FLOAT32 else vals
            return [self.value(etype) for _ in range(count)]
        v = self.scalar(_SCALARS[vtype])
        return _f32(v) if vtype == VT.FLOAT32 else v


def _f32(v: float) -> float:
    """Shortest decimal of a float32, so an eps stored as 1e-5 comes back as 1e-05, not 9.9999997e-06."""
    return float(str(np.float32(v)))


def _parse(path: Path) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], int, int]]]:
    """(metadata, {tensor name: (ggml dims, ggml type id, absolute offset)})."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            r = _Header(buf)
            if buf[:4] != b"GGUF":
                raise ModelLoadError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
            r.pos = 4
            version = r.scalar("I")
            if version & 0xFFFF == 0:
                raise ModelLoadError(f"{path}: big-endian GGUF files are not supported")
            if version not in (2, 3):
                raise ModelLoadError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
            n_tensors, n_kv = r.scalar("Q"), r.scalar("Q")
            if n_tensors > len(buf) or n_kv > len(buf):  # each entry takes bytes: garbage counts
                raise ModelLoadError(f"{path}: corrupt GGUF header (counts {n_tensors}/{n_kv})")
            meta = {}
            for _ in range(n_kv):
                key = r.string()
                meta[key] = r.value(r.scalar("I"))
            infos = []
            for _ in range(n_tensors):
                name, n_dims = r.string(), r.scalar("I")
                if n_dims > _MAX_DIMS:
                    raise ModelLoadError(f"{path}: corrupt GGUF header (tensor {name!r} has {n_dims} dims)")
                dims = tuple(r.scalar("Q") for _ in range(n_dims))
                infos.append((name, dims, r.scalar("I"), r.scalar("Q")))
            align = int(meta.get("general.alignment", 32))
            data_start = (r.pos + align - 1) // align * align
            return meta, {n: (d, t, data_start + off) for n, d, t, off in infos}
    except ModelLoadError:
        raise
    except (struct.error, ValueError, UnicodeDecodeError, KeyError, OverflowError) as e:
        # ValueError covers empty files (mmap) and unknown value-type enums; struct.error, truncation.
        raise ModelLoadError(f"{path}: not a GGUF file or corrupt GGUF header ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the file ({e})") from None


def _get(meta: dict[str, Any], key: str, path: Path, default: Any = ...) -> Any:
    if key not in meta:
        if default is ...:
            raise ModelLoadError(f"{path}: required GGUF metadata key {key!r} is missing")
        return default
    v = meta[key]
    if isinstance(v, list):
        raise ModelLoadError(f"{path}: per-layer values for {key!r} are not supported")
    return v


def _rope_scaling(meta: dict[str, Any], arch: str, path: Path) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"{path}: RoPE scaling type {kind!r} is not supported (supported: none, linear, yarn)")
    out: dict[str, Any] = {"rope_type": kind, "factor": float(_get(meta, f"{arch}.rope.scaling.factor", path))}
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn" and orig is not None:  # absent: HF (and our rotary) fall back to max_position_embeddings
        out["original_max_position_embeddings"] = int(orig)
    return out


def _hf_name(name: str, path: Path, blk: dict[str, str] = _BLK) -> tuple[str | None, str]:
    """(HF name or None when the tensor has no HF counterpart, GGUF kind such as 'attn_q')."""
    if name in _TOP or name in _NO_HF:
        return _TOP.get(name), name
    m = _BLK_RE.fullmatch(name)
    if m is None or m.group(2) not in blk:
        raise ModelLoadError(f"{path}: tensor {name!r} has no Hugging Face counterpart (unsupported layout)")
    return f"model.layers.{m.group(1)}.{blk[m.group(2)]}.{m.group(3)}", m.group(2)


@dataclass
class GGUFModel:
    path: Path
    config: dict[str, Any]  # HF config.json-style dict
    chat_template: str | None
    _infos: list[_TensorInfo] = field(default_factory=list, repr=False)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names -> float32 CPU tensors, one at a time so a big model is never held twice."""
        raw = np.memmap(self.path, dtype=np.uint8, mode="r")
        for t in self._infos:
            row_bytes = t.shape[-1] // GGML_QUANT_SIZES[t.qtype][0] * GGML_QUANT_SIZES[t.qtype][1]
            blob = raw[t.offset:t.offset + t.nbytes].reshape(*t.shape[:-1], row_bytes)
            try:
                w = dequantize(blob, t.qtype)
            except Exception as e:  # gguf raises ValueError/QuantError/NotImplementedError for bad data
                raise ModelLoadError(f"{self.path}: cannot dequantize tensor {t.name!r} ({t.qtype.name}): {e}") from None
            if w.shape != t.shape:
                raise ModelLoadError(f"{self.path}: tensor {t.name!r} dequantized to {w.shape}, expected {t.shape}")
            if t.unpermute_heads:
                # llama.cpp's converter reorders each head's rows from HF's [first half | second half]
                # (rotate-half RoPE) to interleaved pairs (GPT-J style): per head it views the rows as
                # (2, head_dim/2) and transposes. Reverse that: view as (head_dim/2, 2) and transpose back.
                n = t.unpermute_heads
                w = w.reshape(n, t.shape[0] // n // 2, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
            w = np.ascontiguousarray(w, dtype=np.float32)
            if np.may_share_memory(w, raw):  # F32 "dequantizes" to a view of the read-only map
                w = w.copy()
            if EXPERT_SLOT in t.hf_name:  # a stacked expert bank, dequantized once: one HF tensor per expert
                for e in range(w.shape[0]):
                    yield t.hf_name.replace(EXPERT_SLOT, str(e)), torch.from_numpy(w[e])
                continue
            yield t.hf_name, torch.from_numpy(w)
        del raw


def read_gguf(path: str | Path) -> GGUFModel:
    """Parse the header, validate every tensor up front (names, types, bounds) and build the HF config."""
    path = Path(path)
    meta, tinfo = _parse(path)
    archs = gguf_architectures()  # llama.cpp's name -> HF's, as each model family's file declares it
    arch = _get(meta, "general.architecture", path)
    if arch not in archs:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(archs)})")
    heads = int(_get(meta, f"{arch}.attention.head_count", path))
    kv_heads = int(_get(meta, f"{arch}.attention.head_count_kv", path, heads))
    hidden = int(_get(meta, f"{arch}.embedding_length", path))
    head_dim = int(_get(meta, f"{arch}.attention.key_length", path, hidden // heads))
    if "token_embd.weight" not in tinfo:
        raise ModelLoadError(f"{path}: tensor 'token_embd.weight' is missing")
    file_size = path.stat().st_size
    layers = int(_get(meta, f"{arch}.block_count", path))
    moe = moe_config(meta, arch, tinfo, layers, path)
    infos = []
    for name, (dims, type_id, offset) in tinfo.items():
        try:
            qtype = QT(type_id)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor {name!r} has unknown ggml type id {type_id}") from None
        if qtype not in _TYPES:
            raise ModelLoadError(f"{path}: tensor {name!r} has unsupported type {qtype.name} "
                                 f"(supported: {', '.join(sorted(q.name for q in _TYPES))})")
        hf, kind = _hf_name(name, path, _ARCH_BLK.get(arch, _BLK))
        if hf is None:
            if name == "rope_freqs.weight":
                warnings.warn(f"{path}: ignoring rope_freqs.weight (llama.cpp RoPE frequency factors, e.g. "
                              f"Llama-3 rope scaling); outputs may differ from the original model", stacklevel=2)
            continue
        block, type_size = GGML_QUANT_SIZES[qtype]
        if not dims or dims[0] % block:
            raise ModelLoadError(f"{path}: tensor {name!r} shape {list(dims)} does not fit {qtype.name} blocks")
        nbytes = int(np.prod(dims)) // block * type_size
        if offset + nbytes > file_size:
            raise ModelLoadError(f"{path}: tensor {name!r} runs past the end of the file (truncated download?)")
        shape = tuple(int(d) for d in reversed(dims))
        if EXPERT_SLOT in hf:
            check_bank(name, shape, moe.get("num_experts"), path)
        permute = 0
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            permute = heads if kind == "attn_q" else kv_heads
            if shape[0] != permute * head_dim or head_dim % 2:
                raise ModelLoadError(f"{path}: tensor {name!r} has {shape[0]} rows, expected {permute}x{head_dim}")
        infos.append(_TensorInfo(name, hf, shape, qtype, offset, nbytes, permute))
    # required (the `...` default), except in a MoE file, whose dense size nothing reads where every layer is MoE
    ffn = _get(meta, f"{arch}.feed_forward_length", path, moe.get("moe_intermediate_size", ...))
    config = {
        "architectures": [archs[arch]],
        "model_type": arch,
        # The embedding rows, not the token list: the weights must fit the config, and some models pad one.
        "vocab_size": int(tinfo["token_embd.weight"][0][-1]),
        "hidden_size": hidden,
        "intermediate_size": int(ffn),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(_get(meta, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        "rope_theta": float(_get(meta, f"{arch}.rope.freq_base", path, 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch, path),
        "max_position_embeddings": int(_get(meta, f"{arch}.context_length", path)),
        "tie_word_embeddings": "output.weight" not in tinfo,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        "attention_bias": "blk.0.attn_q.bias" in tinfo,
        **moe,
    }
    if arch in _ARCH_CONFIG:
        config.update(_ARCH_CONFIG[arch](meta, config, path))
    return GGUFModel(path, config, meta.get("tokenizer.chat_template"), infos)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The file's key/value metadata only (no tensor is read), with read_gguf's errors for a bad file."""
    return _parse(Path(path))[0]


def load_gguf_tokenizer(path: str | Path) -> Any:
    """A transformers fast tokenizer built from the file's tokenizer metadata (no weights are read).

    Constructed directly rather than via `AutoTokenizer.from_pretrained(dir, gguf_file=...)`: the auto
    path also resolves a model config through `gguf.GGUFReader` (~10 s on a 135M file), and
    `from_pretrained` would let a stray tokenizer.json next to the .gguf override the file's own vocabulary.
    """
    path = Path(path).resolve()
    meta, _ = _parse(path)  # clear errors for non-GGUF input before transformers sees it
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelLoadError(f"{path}: the GGUF has no tokenizer metadata (tokenizer.ggml.tokens)")
    from transformers import PreTrainedTokenizerFast

    try:
        tok = PreTrainedTokenizerFast(gguf_file=path.name, name_or_path=str(path.parent))
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot build the tokenizer from GGUF metadata "
                             f"({type(e).__name__}: {e})") from None
    template = meta.get("tokenizer.chat_template")
    if template:
        tok.chat_template = template
    return tok
