"""`blockspec export-draft`: write a DFlash drafter in another engine's format; today llama.cpp's GGUF, which
`llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type draft-dflash` loads (blockspec/loading/gguf_export.py)."""

from __future__ import annotations

import argparse

from blockspec.cli.flags import add_model_arg

FORMATS = ("gguf",)
OUTTYPES = ("auto", "f32", "f16", "bf16")  # loading/gguf_export.OUTTYPES; repeated here so --help imports no torch


def add_args(p: argparse.ArgumentParser) -> None:
    # dest draft_model: cli/inputs.py checks it as a model source (named DRAFT) before the command runs
    p.add_argument("draft_model", metavar="DRAFT",
                   help="the DFlash drafter: a z-lab checkpoint directory (config.json with dflash_config + "
                        "model.safetensors), e.g. one from `blockspec train-draft`, or a hub id")
    add_model_arg(p, "--target")
    p.add_argument("--format", default="gguf", choices=FORMATS,
                   help="gguf: llama.cpp's DFlash drafter GGUF (the vocabulary is the target's; default)")
    # dest out_file: cli/inputs.py checks its folder before the command runs
    p.add_argument("--out", dest="out_file", required=True, metavar="FILE",
                   help="the file to write (its folder must exist; written whole or not at all)")
    p.add_argument("--outtype", default="auto", choices=OUTTYPES,
                   help="the matrices' type; auto: as llama.cpp's converter, bf16 for a bf16 checkpoint, else f16 "
                        "(norms and other 1-D tensors are f32 in every case)")


def run(args: argparse.Namespace) -> int:
    from blockspec.loading.gguf_export import export_draft_gguf

    done = export_draft_gguf(args.draft_model, args.target, args.out_file, args.outtype)
    print(f"wrote {done.path} ({done.tensors} tensors, {done.file_type}, target layers {done.target_layers} as "
          f"llama.cpp counts them, mask token {done.mask_token_id}); run it with: llama-server -m TARGET.gguf "
          f"-md {done.path} --spec-type draft-dflash")
    return 0
