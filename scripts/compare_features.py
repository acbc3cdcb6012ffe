"""Compare two feature caches of the same conversations (`eagletree features`, e.g. --engine vllm against hf).

    python scripts/compare_features.py runs/feats-vllm runs/feats-hf [--tolerance 0.01]

Both must be for the same target, config and conversations, in the same shards. Per conversation: the token ids
and loss masks must be equal, and per block of the features (the post-norm last hidden state, then each fused
layer's output) every position's relative error, |a - b| / |b| over the hidden size, must stay within the tolerance
(default 0.01: bf16's rounding is about 0.004 per value). Prints the worst and 99th-percentile errors per block and
exits 1 where a record differs or an error passes the tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path, help="a feature cache (its features_dir)")
    ap.add_argument("b", type=Path, help="the cache it is compared with (the reference)")
    ap.add_argument("--tolerance", type=float, default=0.01, help="largest relative error per position and block")
    args = ap.parse_args(argv)
    if not args.tolerance > 0:
        ap.error(f"--tolerance must be > 0, got {args.tolerance}")
    return args


def manifest(folder: Path) -> dict:
    path = folder / "manifest.json"
    if not path.is_file():
        raise SystemExit(f"error: {folder} has no manifest.json: not a feature cache")
    return json.loads(path.read_text())


def records(folder: Path, entry: dict):
    """(conversation id, ids, mask, features) of one shard's records, in order."""
    with safe_open(str(folder / entry["file"]), framework="pt") as f:
        for i, conv in enumerate(entry["conversations"]):
            yield conv, f.get_tensor(f"{i}.ids"), f.get_tensor(f"{i}.mask"), f.get_tensor(f"{i}.hidden").float()


def compare(args) -> tuple[list[str], dict]:
    """(problems, {block: [per-position relative errors]})."""
    ma, mb = manifest(args.a), manifest(args.b)
    problems = []
    if ma["identity"] != mb["identity"]:
        return [f"the caches are for different targets or configs: {ma['identity']} vs {mb['identity']}"], {}
    hidden = ma["identity"]["target"]["hidden_size"]
    errors: dict[str, list[torch.Tensor]] = {}
    for sa, sb in zip(ma["shards"], mb["shards"], strict=False):
        if sa["conversations"] != sb["conversations"]:
            problems.append(f"shard {sa['index']}: other conversations")
            continue
        for (conv, ids_a, mask_a, fa), (_, ids_b, mask_b, fb) in zip(records(args.a, sa), records(args.b, sb)):
            if not torch.equal(ids_a, ids_b) or not torch.equal(mask_a, mask_b):
                problems.append(f"conversation {conv!r}: token ids or loss masks differ")
                continue
            for k in range(fa.shape[1] // hidden):
                block = "last state (post-norm)" if k == 0 else f"fused layer {k}"
                a, b = fa[:, k * hidden : (k + 1) * hidden], fb[:, k * hidden : (k + 1) * hidden]
                errors.setdefault(block, []).append((a - b).norm(dim=1) / b.norm(dim=1).clamp(min=1e-12))
    if len(ma["shards"]) != len(mb["shards"]):
        problems.append(f"{len(ma['shards'])} shards against {len(mb['shards'])}")
    return problems, {k: torch.cat(v) for k, v in errors.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    problems, errors = compare(args)
    positions = next(iter(errors.values())).numel() if errors else 0
    print(f"{args.a} against {args.b}: {positions} positions")
    print("| block | worst relative error | 99th percentile | median |\n|---|---|---|---|")
    for block, e in errors.items():
        print(f"| {block} | {e.max():.2e} | {e.quantile(0.99):.2e} | {e.median():.2e} |")
        if e.max() > args.tolerance:
            problems.append(f"{block}: relative error up to {e.max():.2e} > {args.tolerance}")
    if problems:
        print("FAIL: " + "; ".join(problems[:5]))
        return 1
    print(f"ok: the same token ids and masks, every feature within {args.tolerance} relative")
    return 0


if __name__ == "__main__":
    sys.exit(main())
