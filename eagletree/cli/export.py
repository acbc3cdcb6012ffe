"""`eagletree export` (a head in the layout EAGLE, vLLM or SGLang loads) and `eagletree import` (a head trained
elsewhere, in any export format, as an eagletree head): the formats come from `eagletree.export`'s registry."""

from __future__ import annotations

from ..export import format_names

EXPORT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype: torch's names


def add_export_parsers(sub) -> None:
    """The subparsers of export and import."""
    p = sub.add_parser("export", help="export a head for EAGLE, vLLM or SGLang")
    p.add_argument("--head", required=True)
    p.add_argument(
        "--format",
        required=True,
        choices=format_names(),
        help="EAGLE-1/2 heads: eagle, vllm or sglang; EAGLE-3 heads: eagle3 (SGLang, EAGLE), vllm "
        '(speculative_config method "eagle3") or speculators (vLLM starts it alone, LLM(model=OUT); its config '
        "names the --target folder as the verifier vLLM loads); every head: hf-generate (a folder for "
        "model.generate(custom_generate=OUT, trust_remote_code=True))",
    )
    p.add_argument("--out", required=True, help="a new or empty folder (never the head's own)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out: replace an earlier export there (config.json, model.safetensors, "
        "token_map.pt, model.gguf, an hf-generate folder's head/ and custom_generate/: whatever this export does not "
        "write again is removed), keep the rest of its files",
    )
    p.add_argument("--dtype", default="bf16", choices=list(EXPORT_DTYPES))
    p.add_argument(
        "--hub-repo",
        default=None,
        help="hf-generate: the Hub repository (OWNER/NAME) the folder will be pushed to, where generate.py fetches "
        "the head from when the folder is not on the machine",
    )
    p.add_argument(
        "--target",
        default="smollm2-135m",
        help="eagle3: the target whose embedding the export carries; gguf: whose GGUF file gives the tokenizer",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="import an EAGLE-1/2 head trained elsewhere")
    p.add_argument("--eagle", required=True, help="folder with config.json and model.safetensors/pytorch_model.bin")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--out", required=True, help="a new or empty folder (never the --eagle folder)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out: replace config.json and model.safetensors there and delete the "
        "calibration.json and copy_calibration*.json measured for the head replaced; keep its other files",
    )
    p.set_defaults(func=cmd_import)


def cmd_export(args) -> int:
    """Write a head in the layout EAGLE, vLLM (also as a speculators checkpoint) or SGLang loads."""
    from pathlib import Path

    import torch

    from .. import target
    from ..export.convert import check_format, engine_notes, export_head
    from ..files import check_output_dir
    from ..loading import load_head

    check_output_dir(Path(args.out), args.overwrite, sources=[args.head])  # before the head is read
    head = load_head(args.head)
    layout = check_format(head, args.format, args.hub_repo)  # before the target loads
    model = None
    if layout.needs_target:  # e.g. the target's embedding ("eagle3"), the verifier's folder ("speculators")
        model, _ = target.load_target(args.target, device="cpu")
    dtype = getattr(torch, EXPORT_DTYPES[args.dtype])
    out = export_head(head, args.out, args.format, dtype, args.overwrite, model, hub_repo=args.hub_repo)
    print(f"exported {args.head} as {args.format} ({args.dtype}) to {out}")
    for note in engine_notes(head, args.format, None if model is None else model.config):
        print(f"note: {note}")
    return 0


def cmd_import(args) -> int:
    """Read a head in any export format (`eagletree.export`'s registry recognizes it) and save it as an eagletree
    head."""
    from pathlib import Path

    from ..export.convert import import_head
    from ..files import check_output_dir

    check_output_dir(Path(args.out), args.overwrite, sources=[args.eagle])
    import_head(args.eagle, args.target, args.out, overwrite=args.overwrite)
    print(f"imported {args.eagle} for {args.target} into {args.out}")
    return 0
