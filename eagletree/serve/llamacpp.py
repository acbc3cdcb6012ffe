"""llama.cpp's `llama-server` as `plan` serves with it: a chain (`--spec-draft-n-max`, `--spec-draft-p-min`) drafted by
an EAGLE-3 or block head exported as GGUF (`--spec-type draft-eagle3`, `draft-dflash`), an n-gram mode, or plain
decoding; its plan is eagletree/plan_llamacpp.py's, from llama.cpp's own measured costs."""

from __future__ import annotations

from .registry import Engine


def settings(choice: dict, export_dir: str, spec_type: str) -> dict:
    """llama-server's flags for a plan's choice (plain, an n-gram mode, or the head at k and p_min) and the command."""
    flags = {"-t": choice["threads"], "-tb": choice["threads"]}
    if choice["mode"] == "head":
        flags |= {
            "-md": f"{export_dir}/model.gguf",
            "--spec-type": spec_type,
            "--spec-draft-n-max": choice["k"],
            "--spec-draft-p-min": choice["p_min"],
        }
    elif choice["mode"] != "plain":
        flags["--spec-type"] = choice["mode"]
    return {"flags": flags, "command": "llama-server -m TARGET.gguf " + " ".join(f"{k} {v}" for k, v in flags.items())}


ENGINE = Engine("llamacpp", chain=True, full_vocab=False, settings=settings, formats=("gguf",), measured_costs=True)
