"""Write a DFlash drafter (z-lab checkpoint directory) as the GGUF file llama.cpp's DFlash speculative decoding loads:
`llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type draft-dflash`.

The file is what llama.cpp's own converter writes for a `DFlashDraftModel` checkpoint (convert_hf_to_gguf.py; its
`DFlashModel` class in conversion/qwen.py, a Qwen3 body; read at upstream commit 82bb485 of 2026-08-07, and checked
against the loader `llama_model_dflash` in src/models/dflash.cpp):
- `general.architecture` "dflash"; the Qwen3 hyper-parameters under `dflash.*`; `dflash.block_size`;
  `dflash.target_layers` = each `target_layer_ids` entry + 1 (llama.cpp taps the *input* of a target layer, the
  checkpoint names the layer whose *output* it reads: the same tensor);
- the target's vocabulary (`tokenizer.*`: llama.cpp checks that draft and target vocabularies match) plus the mask
  token as `tokenizer.ggml.mask_token_id`;
- no embedding and no lm_head: llama.cpp shares the target's at run time;
- 1-D tensors and norms in F32, matrices in the checkpoint's 16-bit type (bf16 stays bf16; anything else F16), as the
  converter's `--outtype auto` does.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch
from gguf import GGMLQuantizationType as QT, LlamaFileType as FT

from blockspec.config import SpeculativeConfig
from blockspec.errors import BlockspecError, ModelLoadError
from blockspec.loading.dflash_options import resolve_spec
from blockspec.loading.gguf_io import read_metadata
from blockspec.loading.source import ModelSource, resolve_source
from blockspec.models.config import ModelConfig
from blockspec.models.dflash_config import DFlashConfig

ARCH = "dflash"  # llama.cpp's LLM_ARCH_DFLASH
OUTTYPES = ("auto", "f32", "f16", "bf16")
_FILE_TYPES = {QT.F32: FT.ALL_F32, QT.F16: FT.MOSTLY_F16, QT.BF16: FT.MOSTLY_BF16}
# checkpoint name -> GGUF name: llama.cpp's Qwen3 tensor map, plus the two DFlash tensors (fc fuses the target's
# features; hidden_norm, the norm after it, is the "encoder output norm" to llama.cpp)
_TOP = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight"}
_BLOCK = {"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "attn_q",
          "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
          "self_attn.o_proj.weight": "attn_output", "self_attn.q_norm.weight": "attn_q_norm",
          "self_attn.k_norm.weight": "attn_k_norm", "post_attention_layernorm.weight": "ffn_norm",
          "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down"}


@dataclass(frozen=True)
class ExportedDraft:
    path: Path
    tensors: int
    file_type: str  # e.g. "MOSTLY_BF16"
    target_layers: list[int]  # as written (checkpoint ids + 1)
    mask_token_id: int


def gguf_tensor_name(name: str) -> str | None:
    """The GGUF name of a drafter checkpoint tensor, or None where llama.cpp's DFlash drafter has none."""
    name = name.removeprefix("model.")  # the converter maps both spellings
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdecimal() and parts[2] in _BLOCK:
        return f"blk.{parts[1]}.{_BLOCK[parts[2]]}.weight"
    return None


def _expected_shapes(cfg: DFlashConfig, taps: int) -> dict[str, tuple[int, ...]]:
    h, hd, ff = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    block = {"attn_norm": (h,), "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
             "attn_q_norm": (hd,), "attn_k_norm": (hd,), "ffn_norm": (h,), "ffn_gate": (ff, h), "ffn_up": (ff, h),
             "ffn_down": (h, ff)}
    shapes = {"fc.weight": (h, taps * h), "enc.output_norm.weight": (h,), "output_norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"blk.{i}.{k}.weight": s for k, s in block.items()})
    return shapes


def _check_exportable(cfg: DFlashConfig, where: str) -> None:
    """What llama.cpp's DFlash drafter cannot express: refused, not written into a file that would draft wrong."""
    if cfg.attention_bias:
        raise ModelLoadError(f"{where}: attention_bias=true: llama.cpp's DFlash drafter has no attention biases")
    if any(cfg.layer_causal) or any(w is not None for w in cfg.layer_window):
        raise ModelLoadError(f"{where}: layer_types/is_causal/sliding_window give causal or windowed draft layers; "
                             f"llama.cpp runs every DFlash layer as full non-causal attention")
    for name, value, neutral in (("input_embedding_scale", cfg.input_embedding_scale, 1.0),
                                 ("output_multiplier", cfg.output_multiplier, 1.0),
                                 ("final_logit_softcapping", cfg.final_logit_softcapping, None)):
        if value != neutral:
            raise ModelLoadError(f"{where}: {name}={value}: llama.cpp's DFlash drafter has no such field")
    kind = (cfg.rope_scaling or {}).get("rope_type")
    if kind not in (None, "linear", "yarn"):
        raise ModelLoadError(f"{where}: rope scaling {kind!r} is not exported (llama.cpp's converter writes "
                             f"none, linear or yarn for this architecture)")


def _qtype(outtype: str, tensors: dict[str, torch.Tensor]) -> QT:
    """The matrices' type. auto: as the converter guesses it, from the first matrix of the checkpoint."""
    if outtype != "auto":
        return {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16}[outtype]
    first = next((t for t in tensors.values() if t.dim() >= 2), None)
    return QT.BF16 if first is not None and first.dtype == torch.bfloat16 else QT.F16


def _write_params(w: gguf.GGUFWriter, cfg: DFlashConfig, target_layers: list[int], file_type: FT) -> None:
    """The hyper-parameters, as the converter's TextModel / Qwen3 / DFlash classes write them."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_scaling or {}
    if rope.get("rope_type") in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(float(rope["factor"]))
        if rope["rope_type"] == "yarn":
            orig = rope.get("original_max_position_embeddings", cfg.max_position_embeddings)
            w.add_rope_scaling_orig_ctx_len(int(orig))
            for field, key in (("extrapolation_factor", "yarn_ext_factor"), ("attention_factor", "yarn_attn_factor"),
                               ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
                if rope.get(field) is not None:
                    w.add_float32(f"{ARCH}.rope.scaling.{key}", float(rope[field]))
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)  # transformers' Qwen3Config always carries head_dim, so the converter writes it
    w.add_value_length(cfg.head_dim)
    w.add_file_type(file_type)
    w.add_uint32(f"{ARCH}.block_size", cfg.block_size)  # the speculative loop reads it to size its blocks
    w.add_array(f"{ARCH}.target_layers", target_layers)  # a list of Python ints: an INT32 array, as the converter's


def _copy_gguf_vocab(w: gguf.GGUFWriter, path: Path) -> None:
    """A GGUF target's vocabulary: its tokenizer.* keys, which llama.cpp's converter wrote with the same vocabulary code
    the DFlash class runs on the target's tokenizer files."""
    meta = read_metadata(path)
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelLoadError(f"{path}: the target GGUF has no tokenizer metadata (tokenizer.ggml.tokens)")
    for key, value in meta.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.ggml.mask_token_id":
            continue
        if isinstance(value, bool):  # before int: bool is an int to Python
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)  # token ids and counts: the writer's type for every integer tokenizer key
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:  # arrays: str -> STRING, int -> INT32 (token types), float -> FLOAT32 (scores), as the writer infers
            w.add_array(key, value)


def _hf_vocab(w: gguf.GGUFWriter, d: Path, n_vocab: int) -> None:
    """An HF target's byte-level BPE vocabulary, as the converter's 'gpt2' vocabulary: the tokens by id (added
    special tokens CONTROL, other added ones USER_DEFINED, ids without a token '[PAD<id>]' UNUSED), then merges,
    special ids, add_bos / add_eos and the chat template through gguf's SpecialVocab, as the converter does.
    tokenizer.ggml.pre is left out: the converter finds it by hashing a sample's token ids against its own table;
    llama.cpp then uses its default pre-tokenizer for this vocabulary, which the draft never tokenizes text with."""
    spm, tj = d / "tokenizer.model", d / "tokenizer.json"
    byte_fallback = tj.is_file() and bool(json.loads(tj.read_text(encoding="utf-8")).get("model", {})
                                          .get("byte_fallback"))
    if spm.is_file() or byte_fallback:
        raise ModelLoadError(f"{spm if spm.is_file() else tj}: a SentencePiece-style vocabulary, which this export "
                             f"does not rebuild; pass --target the target's llama.cpp GGUF (its vocabulary is copied)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(d))
    except Exception as e:
        raise ModelLoadError(f"{d}: cannot load the target's tokenizer ({type(e).__name__}: {e})") from None
    by_id = {i: t for t, i in tok.get_vocab().items()}
    if max(by_id) >= n_vocab:
        raise ModelLoadError(f"{d}: the tokenizer has id {max(by_id)}, outside vocab_size={n_vocab}")
    added, decoder = tok.get_added_vocab(), tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(n_vocab):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        kind = gguf.TokenType.NORMAL
        if t in added:
            if not decoder[i].normalized:  # llama.cpp assumes added tokens pre-normalized: round-trip them
                t = tok.decode(tok.encode(t, add_special_tokens=False))
            if decoder[i].special or (t.startswith("<|") and t.endswith("|>")):
                kind = gguf.TokenType.CONTROL
            else:
                t, kind = t.replace("\u2581", " "), gguf.TokenType.USER_DEFINED
        tokens.append(t)
        types.append(kind)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(d, load_merges=True)
    # llama.cpp refuses a draft whose add_bos / add_eos differ from the target's, and without a pre-tokenizer name
    # it cannot infer them: where the tokenizer files leave them implicit, write what the tokenizer does
    ids = tok.encode("a")
    for which, tid, at in (("bos", tok.bos_token_id, 0), ("eos", tok.eos_token_id, -1)):
        special.add_special_token.setdefault(which, tid is not None and bool(ids) and ids[at] == tid)
    special.add_to_gguf(w)


def _read_draft(draft: str) -> tuple[ModelSource, DFlashConfig, str]:
    """The drafter's source, config and the config file's name (for messages); refuses anything but a DFlash one."""
    src = resolve_source(draft)
    where = str(src.path / "config.json") if src.path.is_dir() else str(src.path)
    archs = src.config.get("architectures") or []
    if src.path.is_dir() and archs[:1] == ["DFlash2DraftModel"]:
        raise ModelLoadError(f"{where}: architectures={archs}: GGUF export of DFlash 2 drafters is not supported yet "
                             f"(DFlash 1 drafters only, architectures=['DFlashDraftModel'])")
    if not src.path.is_dir() or archs[:1] != ["DFlashDraftModel"] or "dflash_config" not in src.config:
        raise ModelLoadError(f"{where}: not a DFlash drafter (expected a directory whose config.json has "
                             f"architectures=['DFlashDraftModel'] and a dflash_config; got architectures={archs})")
    cfg = DFlashConfig.from_hf(src.config, where)
    cfg.validate_block_size()
    return src, cfg, where


def _read_tensors(src: ModelSource, cfg: DFlashConfig, taps: int) -> dict[str, torch.Tensor]:
    """GGUF name -> the checkpoint's tensor (its own dtype), every one present, known and of the config's shape."""
    tensors: dict[str, torch.Tensor] = {}
    for name, t in src.tensors():
        gname = gguf_tensor_name(name)
        if gname is None:  # an own embedding or head, a vocabulary map: llama.cpp's converter refuses them too
            raise ModelLoadError(f"{src.path}: tensor {name!r} has no counterpart in llama.cpp's DFlash drafter")
        tensors[gname] = t
    shapes = _expected_shapes(cfg, taps)
    for gname, shape in shapes.items():
        if gname not in tensors:
            raise ModelLoadError(f"{src.path}: the tensor for {gname!r} is missing (expected shape {list(shape)})")
        if tuple(tensors[gname].shape) != shape:
            raise ModelLoadError(f"{src.path}: the tensor for {gname!r} has shape {list(tensors[gname].shape)}, "
                                 f"expected {list(shape)}")
    extra = sorted(set(tensors) - set(shapes))
    if extra:
        raise ModelLoadError(f"{src.path}: the tensor for {extra[0]!r} is beyond num_hidden_layers="
                             f"{cfg.num_hidden_layers}")
    return tensors


def _write_atomic(w: gguf.GGUFWriter, out: Path) -> None:
    """Into a name of our own next to `out` (same file system: the rename is atomic; created with the umask's mode),
    then renamed over it: `out` is the whole new file or what it was before."""
    tmp = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=False)
        w.close()
        os.replace(tmp, out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise


def export_draft_gguf(draft: str, target: str | None, out: str | Path, outtype: str = "auto") -> ExportedDraft:
    """Write `draft` (a DFlash drafter: directory or hub id) for `target` (any model source; None: the bundled one)
    to `out` as a llama.cpp DFlash GGUF, atomically."""
    out = Path(out).expanduser()
    if out.is_dir():
        raise BlockspecError(f"--out {out}: is a directory; give the file to write")
    if not out.parent.is_dir():
        raise BlockspecError(f"--out {out}: the folder {out.parent} does not exist")
    if outtype not in OUTTYPES:
        raise BlockspecError(f"--outtype {outtype!r}: expected one of {', '.join(OUTTYPES)}")
    src, cfg, where = _read_draft(draft)
    tgt = resolve_source(target)
    tcfg = ModelConfig.from_hf(tgt.config, str(tgt.path))
    spec = resolve_spec(SpeculativeConfig(draft_model=draft), cfg, tcfg, where)  # the engine's checks vs the target
    _check_exportable(cfg, where)
    tensors = _read_tensors(src, cfg, len(spec.target_layer_ids))

    qtype = _qtype(outtype, tensors)
    w = gguf.GGUFWriter(path=None, arch=ARCH)  # adds general.architecture
    for gname, t in tensors.items():
        data = t.detach().to(torch.float32).numpy()  # bf16 has no numpy type: widen (exact), then narrow
        kind = QT.F32 if data.ndim <= 1 or gname.endswith("_norm.weight") else qtype
        w.add_tensor(gname, gguf.quants.quantize(data, kind), raw_dtype=kind)
    # the converter's order: type, the model card's general.* keys, parameters, quantization version, vocabulary
    w.add_type(gguf.GGUFType.MODEL)
    total, shared, expert, n_expert = w.get_total_parameter_count()
    card = gguf.Metadata.load(None, src.path, None, total)  # name, size label, ... guessed as the converter does
    card.name = card.name or src.path.name
    if card.size_label is None and total > 0:
        card.size_label = gguf.size_label(total, shared, expert, n_expert)
    card.set_gguf_meta_model(w)
    target_layers = [i + 1 for i in spec.target_layer_ids]
    _write_params(w, cfg, target_layers, _FILE_TYPES[qtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tgt.path.is_file():
        _copy_gguf_vocab(w, tgt.path)
    else:
        _hf_vocab(w, tgt.path, tcfg.vocab_size)
    w.add_uint32("tokenizer.ggml.mask_token_id", spec.mask_token_id)  # the draft block's filler token
    _write_atomic(w, out)
    return ExportedDraft(out, len(tensors), _FILE_TYPES[qtype].name, target_layers, spec.mask_token_id)
