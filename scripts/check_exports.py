"""Load eagletree's EAGLE and EAGLE-3 exports with SafeAILab/EAGLE's own model code, on CPU.

    python scripts/check_exports.py --eagle-repo PATH [--head DIR] [--target smollm2-135m]

PATH is a checkout of https://github.com/SafeAILab/EAGLE (only `eagle/model/` is imported; EAGLE is
not installed and nothing is downloaded). For the EAGLE-1/2 head (default: the shipped one) and a
random EAGLE-3 head of the same target, the script exports the folder, builds EAGLE's draft model from
the exported config.json as EAGLE's transformers 4 reads it (cnets1.Model / cnets.Model, as `EaModel` does, with
load_emb=False: EaModel reads the embedding from the target's folder), loads model.safetensors with
`load_state_dict(strict=False)` as `EaModel` does, and reports missing and unexpected keys, shape
errors, RoPE base and the loaded tensors' agreement with eagletree's. Exit code 1 on any problem.
Not part of the test run (it needs the EAGLE checkout). scripts/check_engine_loaders.py does the same with
SGLang's own loaders (read out of its wheel); scripts/check_vllm.py serves the exports in vLLM itself.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import types
from pathlib import Path

import torch


def eagle_modules(repo: Path):
    """EAGLE's EConfig and its EAGLE-1/2 (cnets1) and EAGLE-3 (cnets) draft models, imported from the checkout."""
    if not (repo / "eagle" / "model" / "cnets1.py").is_file():
        raise SystemExit(
            f"error: --eagle-repo {str(repo)!r} has no eagle/model/cnets1.py; pass a SafeAILab/EAGLE checkout"
        )
    sys.path.insert(0, str(repo))
    from eagle.model import cnets, cnets1
    from eagle.model.configs import EConfig

    return EConfig, cnets1.Model, cnets.Model


def check(folder: Path, config_cls, model_cls, ours: dict, what: str) -> list[str]:
    """Build EAGLE's model from the export's config.json, load its weights as EaModel does; the problems found."""
    from safetensors.torch import load_file

    raw = json.loads((folder / "config.json").read_text())
    # EAGLE pins transformers 4, whose configs take every config.json key as an attribute as written; under
    # transformers 5 `rope_scaling` aliases `rope_parameters` and EAGLE's _init_rope cannot run at all. So the
    # config is read the transformers-4 way, and EConfig's own rope_scaling validation is applied to it.
    defaults = {
        k: v.default
        for k, v in inspect.signature(config_cls.__init__).parameters.items()
        if v.default is not inspect.Parameter.empty
    }
    config = types.SimpleNamespace(**{**defaults, **raw})
    config_cls._rope_scaling_validation(config)
    bias = raw.get("bias", True)  # ea_model.py: con["bias"], else True
    model = model_cls(config, load_emb=False, bias=bias)
    if getattr(config, "vocab_size", None) == getattr(config, "draft_vocab_size", None):
        del model.d2t, model.t2d  # EaModel drops them for a full-vocabulary EAGLE-3 head
    state = load_file(str(folder / "model.safetensors"))
    problems = []
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a shape mismatch
        return [f"{what}: load_state_dict failed: {e}"]
    # EaModel loads with strict=False. The embedding may be missing only where EAGLE reads it from the target's
    # folder: always for EAGLE-1/2 (cnets1), for EAGLE-3 (cnets) only without target_hidden_size.
    from_target = model_cls.__module__.endswith("cnets1") or not hasattr(config, "target_hidden_size")
    missing = [k for k in result.missing_keys if not (k == "embed_tokens.weight" and from_target)]
    if missing:
        problems.append(f"{what}: parameters EAGLE's model has and the export lacks: {missing}")
    if result.unexpected_keys:
        problems.append(f"{what}: tensors of the export EAGLE's model ignores: {result.unexpected_keys}")
    for name, tensor in model.state_dict().items():
        if name in ours and not torch.equal(tensor.to(ours[name].dtype), ours[name]):
            problems.append(f"{what}: {name} differs from eagletree's after loading")
    rope = [m for m in model.modules() if hasattr(m, "inv_freq")]
    want = raw["rope_parameters"]["rope_theta"]
    for m in rope:
        got = getattr(m, "base", None)
        if got is None or abs(float(got) - float(want)) > 1e-6 * float(want):
            problems.append(f"{what}: RoPE base {got}, the target's is {want}")
    print(
        f"{what}: {len(state)} tensors, missing {result.missing_keys}, unexpected {result.unexpected_keys}, "
        f"RoPE base {[getattr(m, 'base', None) for m in rope]}, fc bias {model.fc.bias is not None}"
    )
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--eagle-repo", required=True, type=Path, help="a SafeAILab/EAGLE checkout")
    parser.add_argument("--head", default=None, help="an EAGLE-1/2 head (default: the shipped one)")
    parser.add_argument("--target", default="smollm2-135m")
    args = parser.parse_args(argv)
    config_cls, model1, model3 = eagle_modules(args.eagle_repo)

    from eagletree.draft import Eagle3Head, load_head
    from eagletree.export.convert import export_head, exported_state
    from eagletree.loading import SHIPPED_HEADS
    from eagletree.target import load_target

    target, _ = load_target(args.target, dtype=torch.float32, device="cpu")
    head = load_head(args.head or SHIPPED_HEADS[args.target], target_config=target.config)
    torch.manual_seed(0)
    head3 = Eagle3Head.for_target(target, torch.arange(0, target.config.vocab_size, 7)).eval()
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for h, fmt, model_cls in ((head, "eagle", model1), (head3, "eagle3", model3)):
            out = export_head(h, Path(tmp) / fmt, fmt, dtype=torch.float32, target=target)
            ours = exported_state(h, fmt, target.get_input_embeddings().weight if fmt == "eagle3" else None)
            problems += check(
                out, config_cls, model_cls, {k: v.float() if v.is_floating_point() else v for k, v in ours.items()}, fmt
            )
    for p in problems:
        print(f"PROBLEM {p}")
    print("ok: EAGLE's own code loads both exports" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
