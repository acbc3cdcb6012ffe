"""Run SGLang's own draft-model classes, weight loading and config reading on eagletree's exports, on CPU.

    python scripts/check_engine_loaders.py --wheels DIR [--sglang-wheel Y.whl]
        [--head DIR ...] [--target smollm2-135m] [--self-test]

SGLang only: vLLM is checked for real by scripts/check_vllm.py, which serves the `vllm` export with vLLM's CPU
build. SGLang does not run on a CPU from PyPI packages: the sglang 0.5.23 wheel requires torch==2.14.1 (PyPI's
CUDA build), cuda-python, flashinfer_python[cu13] and nvidia-cutlass-dsl[cu13], and its kernel package
sglang-kernel 0.4.10 holds CUDA kernels only (SGLang's CPU backend needs its kernel built from source). So this
script re-hosts the part of SGLang that reads an export: DIR holds the sglang wheel (`pip download --no-deps
sglang`); SGLang is not installed: the Python source of the modules below is read out of the wheel and executed,
and the GPU, distributed and kernel modules they import are replaced by the stand-ins listed in the output. For
each head (default: the shipped EAGLE-1/2 head and two random EAGLE-3 heads of the same target, over a draft
vocabulary and over the whole one) the script writes eagletree's export in the format SGLang loads (EAGLE-1/2:
'sglang', EAGLE-3: 'eagle3'), then:
- reads config.json with transformers' AutoConfig (as SGLang does) and picks the model class by the
  `EntryClass` of models/llama_eagle.py and llama_eagle3.py;
- builds that class (llama_eagle.py / llama_eagle3.py over llama.py) and runs its own `load_weights` over
  model.safetensors;
- runs SGLang's sharing of the target's embedding and lm_head after loading (the model's own
  `set_embed_and_head` / `set_embed`, with the token map read by spec_utils.py `load_token_map`);
- for EAGLE-3, reads the fused target layers with llama.py `set_eagle3_layers_to_capture` and compares them with
  the head's, and the draft-to-target token ids SGLang ends up with (hot_token_id or token map) with the head's.
Problems reported: parameters never (or only partly) loaded, checkpoint tensors SGLang skipped, shape mismatches
(SGLang would stop there; the check goes on to list all), SGLang raising, a RoPE base other than the target's,
fused layers or draft token ids other than the head's. Exit code 1 on any problem. The few SGLang rules that are
restated rather than run are printed with the stand-ins (RESTATED). `--self-test` also breaks exports on purpose
(SGLang's known failure modes) and checks that every one is reported (and that one SGLang must load is not).
Not part of the test run: it needs the wheel. scripts/check_exports.py does the same for SafeAILab/EAGLE's own
model code.
The parts live in scripts/engines/: sandbox.py (the wheel's source, run over stand-ins), standins.py (the layers
stood in for), load_audit.py (what a load did), sglang_loaders.py (SGLang's classes), broken_exports.py (the
self-test), exports.py (eagletree's export code, the one place it is imported).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/engines, also when loaded by path

from engines.broken_exports import self_test  # noqa: E402
from engines.exports import export_head, sglang_format  # noqa: E402
from engines.load_audit import Export  # noqa: E402
from engines.sandbox import Sandbox, Wheel, find_wheel  # noqa: E402
from engines.sglang_loaders import RESTATED, SGLang  # noqa: E402


def write_exports(heads, target, out: Path) -> list[Export]:
    """Every head exported by eagletree's own export code in the format SGLang loads it in (`sglang_format`:
    EAGLE-1/2 heads as 'sglang', EAGLE-3 heads, which fuse target layers, as 'eagle3')."""
    exports = []
    for i, head in enumerate(heads):
        fmt, layers = sglang_format(head), head.feature_spec.layers
        folder = export_head(head, out / f"head{i}-{fmt}", fmt, target=target)
        draft_ids = None if head.config.draft_vocab_size is None else head.d2t.long().tolist()
        exports.append(Export(folder, fmt, list(layers) if layers else None, draft_ids))
    return exports


def load_heads(args):
    """The target, and the heads to export: --head folders, or the shipped head and two random EAGLE-3 heads."""
    from eagletree.draft import Eagle3Head, load_head
    from eagletree.loading import SHIPPED_HEADS
    from eagletree.target import load_target

    target, _ = load_target(args.target, dtype=torch.bfloat16, device="cpu")  # as served, and as exported
    if args.head:
        return target, [load_head(h, target_config=target.config) for h in args.head]
    torch.manual_seed(0)
    return target, [
        load_head(SHIPPED_HEADS[args.target], target_config=target.config),
        Eagle3Head.for_target(target, torch.arange(0, target.config.vocab_size, 7)).eval(),
        Eagle3Head.for_target(target).eval(),  # the whole vocabulary: the training default
    ]


def print_provenance(box: Sandbox):
    """What ran as SGLang's own code, what was stood in for, and what was restated."""
    print(f"\n== {box.label}: the engine's own code that ran")
    print("\n".join(f"  {e}" for e in box.executed))
    print(f"== {box.label}: stand-ins (not the engine's code)")
    print("\n".join(f"  {m}: {names} -- {why}" for m, names, why in box.stand_ins))
    print(f"== {box.label}: RESTATED (engine rules applied by this script, not run)")
    print("\n".join(f"  {r}" for r in RESTATED))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, required=True, help="folder with sglang-*.whl")
    parser.add_argument("--sglang-wheel", type=Path, default=None)
    parser.add_argument(
        "--head",
        action="append",
        default=None,
        help="an eagletree head folder (EAGLE-1/2 or EAGLE-3); repeatable. Default: the shipped head "
        "and two random EAGLE-3 heads",
    )
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--self-test", action="store_true", help="also check broken exports are reported")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)

    sglang = SGLang(Wheel(find_wheel(args.wheels, "sglang", args.sglang_wheel)))
    target, heads = load_heads(args)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        exports = write_exports(heads, target, Path(tmp))
        print("== eagletree's exports")
        for export in exports:
            audit = sglang.check(export, target)
            print(audit.line())
            failures += bool(audit.problems)
        if args.self_test:
            failures += self_test(sglang, exports, target, Path(tmp))
    print_provenance(sglang.box)
    print("\nok: SGLang's own loaders take every export" if not failures else f"\n{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
