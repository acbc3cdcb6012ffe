"""`eagletree` command line: data, generate (more subcommands arrive with later issues)."""

from __future__ import annotations

import argparse
import json
import sys
import time


def cmd_data(args) -> int:
    from .train.data import load_dataset, stats

    data = load_dataset(args.dataset)
    if args.stats:
        print(json.dumps(stats(data, args.heldout_fraction), indent=2))
    return 0


def cmd_generate(args) -> int:
    """Answer one chat prompt with the target alone and report its speed."""
    import torch
    from transformers import TextStreamer

    from .target import load_target

    if not args.prompt.strip():
        raise SystemExit("error: --prompt is empty; give the text to answer")
    t0 = time.perf_counter()
    model, tok = load_target(args.target, device=args.device)
    print(f"loaded {args.target} ({type(model).__name__}, {model.dtype}, {model.device}) in "
          f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    inputs = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True).to(model.device)
    streamer = None if args.json else TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, streamer=streamer)
    seconds = time.perf_counter() - t0
    new = out[0, inputs["input_ids"].shape[1]:]
    result = {"text": tok.decode(new, skip_special_tokens=True), "new_tokens": int(new.numel()),
              "seconds": round(seconds, 3), "tokens_per_s": round(new.numel() / seconds, 2), "method": "plain"}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"[plain decoding: {result['new_tokens']} tokens in {seconds:.2f}s = {result['tokens_per_s']} tokens/s]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .train.data import HELDOUT_FRACTION

    parser = argparse.ArgumentParser(prog="eagletree", description="Lossless speculative decoding with draft trees.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("data", help="inspect training data (ShareGPT or your own JSON/JSONL)")
    p.add_argument("--dataset", default="sharegpt", help="'sharegpt' (shipped) or a .json/.jsonl path")
    p.add_argument("--stats", action="store_true", help="print one JSON object of counts")
    p.add_argument("--heldout-fraction", type=float, default=HELDOUT_FRACTION)
    p.set_defaults(func=cmd_data)

    p = sub.add_parser("generate", help="answer a chat prompt")
    p.add_argument("--target", default="smollm2-135m", help="alias, HF model folder or .gguf file")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv=None) -> int:
    from .target import TargetError
    from .train.data import DataError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (TargetError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
