"""Format "hf-generate": a folder transformers' `generate` runs as its decoding, with
`model.generate(**inputs, custom_generate=FOLDER, trust_remote_code=True)` (or the Hub repository it is pushed to).

    FOLDER/custom_generate/generate.py   `generate(model, **kwargs)`: eagletree.hf.folder_generate with this export
    FOLDER/custom_generate/requirements.txt   what transformers checks before it runs generate.py
    FOLDER/head/                         the head as eagletree saves it, with its calibration tables and datastore
    FOLDER/config.json                   what the export holds: {"custom_generate": {head_type, head, tree, ...}}

transformers copies generate.py into its own modules cache before running it, so generate.py cannot find the head
next to itself: it names the folder it was written to (absolute) and, with `--hub-repo`, the Hub repository the
folder is pushed to, from which `huggingface_hub` fetches `head/` when that folder is not on the machine. Every kind
of head eagletree decodes with exports this way (one layout per kind, so refusals and `import` name the kind).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from pprint import pformat

from ..decode.resources import COMPANION_FILES
from ..draft import DraftHead, HeadError
from ..files import building
from .layout import CONFIG, Layout, publish_export

HEAD = "head"  # the head's folder inside the export
HUB_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
FOLDER = "custom_generate"  # where transformers looks for generate.py
REQUIREMENTS = ("eagletree>={eagletree}", "transformers>=5.17", "torch>=2.4")  # one bound a line: transformers' parser

GENERATE_PY = '''"""eagletree's draft trees inside `model.generate`: `eagletree export --format hf-generate` wrote this.

    out = model.generate(**inputs, custom_generate={where!r}, trust_remote_code=True, max_new_tokens=128)

Greedy output is what `generate` returns without it, token for token; sampled output has the target's distribution.
Besides generate's own options: eagletree_head=PATH (a head folder to draft with instead of this export's),
eagletree_tree="auto"|"eagle2"|"optimal"|... (how the tree is searched).
"""

from eagletree.hf import folder_generate

EXPORT = {export}


def generate(model, **kwargs):
    return folder_generate(model, EXPORT, **kwargs)
'''


class HfGenerate(Layout):
    """One kind of head as a `custom_generate` folder: the head saved as eagletree saves it, and generate.py."""

    format = "hf-generate"
    names_hub_repo = True
    folders = (HEAD, FOLDER)
    target_types = ()  # any decoder-only model transformers generates with: `check` asks nothing of the target

    def __init__(self, head_type: str, kind: str):
        self.heads, self.kind = (head_type,), kind

    def check_hub_repo(self, hub_repo: str) -> None:
        """HeadError unless `hub_repo` reads as a Hub repository id, OWNER/NAME (letters, digits, '-', '_', '.')."""
        if not HUB_REPO.fullmatch(hub_repo):
            raise HeadError(f"--hub-repo {hub_repo!r} is not a Hub repository id; expected OWNER/NAME")

    def check(self, head) -> None:
        """Nothing to refuse: the folder runs inside the user's own `generate`, on whatever target the head was
        trained for (the head checks its target when it is loaded)."""

    def recognizes(self, config: dict) -> bool:
        """A config naming generate.py's export of this kind of head."""
        export = config.get(FOLDER)
        return isinstance(export, dict) and export.get("head_type") in self.heads

    def load(self, folder: Path, target) -> DraftHead:
        """The head saved in the export's head folder (`target`: the target's config, checked against the head's)."""
        from ..draft import load_head

        config = target if not hasattr(target, "config") else target.config
        return load_head(Path(folder) / HEAD, target_config=config)

    def write(self, head, out: Path, dtype, overwrite=False, target=None, speculative_tokens=None, hub_repo=None):
        """The folder, built whole and published at once (`files.publish`): the head in `dtype` with the
        companion files decoding reads next to it, generate.py naming where it is, requirements.txt, config.json."""
        export = export_settings(head, Path(os.path.realpath(out)), hub_repo)
        with building(out) as tmp:
            head.save_pretrained(tmp / HEAD, dtype=dtype)
            for name in COMPANION_FILES:
                source = head.companion_file(name)
                if source is not None:
                    shutil.copy2(source, tmp / HEAD / name)
            (tmp / FOLDER).mkdir()
            where = hub_repo or str(export["folder"])
            text = GENERATE_PY.format(where=where, export=pformat(export, sort_dicts=False))
            (tmp / FOLDER / "generate.py").write_text(text)
            (tmp / FOLDER / "requirements.txt").write_text("\n".join(requirements()) + "\n")
            config = {FOLDER: export, "eagletree": {"format": self.format}}
            (tmp / CONFIG).write_text(json.dumps(config, indent=2))
        return publish_export(tmp, out, overwrite)


def export_settings(head, folder: Path, hub_repo: str | None) -> dict:
    """What generate.py needs: the head's kind and folder (absolute, and inside the Hub repository)."""
    return {"head_type": head.head_type, "folder": str(folder), "head": HEAD, "hub_repo": hub_repo, "tree": "auto"}


def requirements() -> list[str]:
    """requirements.txt's lines: this eagletree or newer, and the transformers and torch it runs on."""
    from importlib.metadata import version

    return [line.format(eagletree=version("eagletree")) for line in REQUIREMENTS]


LAYOUTS = (
    HfGenerate("eagle", "EAGLE-1/2"),
    HfGenerate("eagle3", "EAGLE-3"),
    HfGenerate("dflash", "block (DFlash)"),
    HfGenerate("medusa", "Medusa"),
)
