"""`check_engine_loaders.py --self-test`: copies of the exports broken the ways SGLang has failed on such files,
each of which SGLang's loaders must report (and one they must take)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .load_audit import Export
from .sglang_loaders import SGLang


def edit_config(folder: Path, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def edit_weights(folder: Path, drop=(), **replace):
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    state = {k: v for k, v in state.items() if k not in drop}
    state.update(replace)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def broken_exports(exports: list[Export], work: Path) -> list[tuple[str, Export, bool]]:
    """Copies of the exports broken the ways SGLang has failed on such files: (what, export, whether SGLang must
    report it). The copies are of the first 'sglang' and the first 'eagle3' export over a draft vocabulary (the token
    map and d2t cases need one)."""
    by_fmt = {}
    for export in exports:
        if export.draft_ids is not None:
            by_fmt.setdefault(export.fmt, export)
    if set(by_fmt) != {"sglang", "eagle3"}:
        raise SystemExit(
            "error: --self-test breaks an EAGLE-1/2 and an EAGLE-3 export, each over a draft vocabulary: pass one "
            "head of each kind with --head, or none"
        )
    cases = []

    def case(what, fmt, reported, change):
        src = by_fmt[fmt]
        dst = work / f"broken{len(cases)}-{fmt}"
        shutil.copytree(src.folder, dst)
        change(dst)
        cases.append((what, Export(dst, fmt, src.layers, src.draft_ids), reported))

    break_sglang(case)
    break_eagle3(case, by_fmt["eagle3"].draft_ids)
    return cases


def aux_layer_ids(folder: Path) -> list[int]:
    """The EAGLE-3 export's layer ids as SGLang reads them (eagle_config)."""
    return json.loads((folder / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]


def aux_eagle_config(ids) -> dict:
    """config.json's eagle_config entry naming `ids` as the layers to capture."""
    return {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}


def break_sglang(case):
    """The EAGLE-1/2 'sglang' export broken the ways SGLang must report."""
    case(
        "tie_word_embeddings true (SGLang ties lm_head to the draft's embedding)",
        "sglang",
        True,
        lambda d: edit_config(d, tie_word_embeddings=True),
    )
    case("no fc.bias (SGLang's fc always has one)", "sglang", True, lambda d: edit_weights(d, drop=["fc.bias"]))
    case(
        "architectures LlamaForCausalLM (not an SGLang EAGLE class)",
        "sglang",
        True,
        lambda d: edit_config(d, architectures=["LlamaForCausalLM"]),
    )
    case(
        "token_map.pt in another order",
        "sglang",
        True,
        lambda d: torch.save(torch.load(d / "token_map.pt")[::-1], d / "token_map.pt"),
    )


def break_eagle3(case, draft_ids: list[int]):
    """The 'eagle3' export broken the ways SGLang must report (and one it must take); `draft_ids` are the head's
    target ids."""
    case("tie_word_embeddings true", "eagle3", True, lambda d: edit_config(d, tie_word_embeddings=True))
    case("no d2t", "eagle3", True, lambda d: edit_weights(d, drop=["d2t"]))
    case("d2t as target ids instead of offsets", "eagle3", True, lambda d: edit_weights(d, d2t=torch.tensor(draft_ids)))
    case(
        "eagle_config layer ids + 1 (SGLang adds 1 itself)",
        "eagle3",
        True,
        lambda d: edit_config(d, **aux_eagle_config([i + 1 for i in aux_layer_ids(d)])),
    )
    case(
        "two layer ids in eagle_config (fc built for 2 hidden states, the file has 3)",
        "eagle3",
        True,
        lambda d: edit_config(d, **aux_eagle_config(aux_layer_ids(d)[:2])),
    )
    case(
        "no embed_tokens (SGLang takes the target's; only EAGLE's own code needs it, see check_exports.py)",
        "eagle3",
        False,
        lambda d: edit_weights(d, drop=["embed_tokens.weight"]),
    )


def self_test(sglang: SGLang, exports: list[Export], target, work: Path) -> int:
    """Load the broken copies of `exports`; the number of cases SGLang did not treat as it must."""
    print("\n== exports broken on purpose (each must be reported by SGLang, unless marked 'must load')")
    failures = 0
    for what, export, reported in broken_exports(exports, work):
        audit = sglang.check(export, target)
        caught = bool(audit.problems)
        verdict = "as expected" if caught == reported else "MISSED" if reported else "WRONGLY REPORTED"
        failures += caught != reported
        expect = "" if reported else " (must load)"
        print(f"-- {export.fmt}: {what}{expect}: {'reported' if caught else 'not reported'}: {verdict}")
        for p in audit.problems:
            print(f"    [{audit.engine}] {p}")
    return failures
