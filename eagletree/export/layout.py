"""`Layout`: the files one export format writes for one kind of head, and how `eagletree import` reads them back.

A format module (eagle.py, vllm.py, ...) lists its layouts in `LAYOUTS`; a subclass sets the class attributes
(which heads, whether it needs the target, which targets its engines load) and the methods that differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..draft import DraftHead, HeadError
from ..files import building, publish

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


class Layout:
    """One format's files for one kind of head: config.json, model.safetensors and any companion files."""

    format = ""  # the --format name it belongs to
    heads: tuple[str, ...] = ()  # the head_type names it writes
    kind = ""  # what those heads are called in messages ("EAGLE-1/2")
    needs_target = False  # its export reads the target model (its embedding, or its folder)
    imports_with_model = False  # `import` builds the head from the target model, not only from its config
    fallback = False  # recognizes whatever of its kind of head no other layout does (EAGLE's own layouts)
    target_types: tuple[str, ...] = ("llama",)  # the target model_types its engines load heads for
    loaders = ""  # "the ... loaders take Llama-architecture heads": the refusal of another target
    folders: tuple[str, ...] = ()  # folders it writes, which an overwrite in another format removes
    names_hub_repo = False  # its files name the Hub repository they are pushed to (`hub_repo`)

    def check(self, head) -> None:
        """HeadError unless this layout's engines load heads for the head's target; loads nothing."""
        model_type = head.config.target["model_type"]
        if model_type not in self.target_types:
            raise HeadError(f"{self.loaders}; this head's target is {model_type!r}")

    def check_hub_repo(self, hub_repo: str) -> None:
        """HeadError unless `hub_repo` is a repository id this layout can name (for layouts that `names_hub_repo`)."""

    def state(self, head, embedding: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The exported weights; `embedding` is the target's input embedding (for a layout that carries it)."""
        raise NotImplementedError(f"{type(self).__name__} does not define state()")

    def config(self, head, dtype: torch.dtype, target=None, speculative_tokens: int | None = None) -> dict:
        """config.json of the export, in `dtype`; `target` is the target model, `speculative_tokens` a chain length
        for the layouts that write one."""
        raise NotImplementedError(f"{type(self).__name__} does not define config()")

    def embedding(self, target) -> torch.Tensor | None:
        """The target's tensor `state` takes, for a layout that carries it."""
        return None

    def write_companions(self, head, folder: Path) -> None:
        """Files written next to the weights (none unless a layout says so)."""

    def notes(self, head, target_config=None) -> list[str]:
        """What an engine will do differently from eagletree with this export (printed by `eagletree export`)."""
        return []

    def recognizes(self, config: dict) -> bool:
        """Whether a foreign folder's config.json is in this layout."""
        raise NotImplementedError(f"{type(self).__name__} does not define recognizes()")

    def load(self, folder: Path, target) -> DraftHead:
        """The head in `folder`, for `target`: the target model where `imports_with_model`, else its config."""
        raise NotImplementedError(f"{type(self).__name__} does not define load()")

    def write(
        self, head, out: Path, dtype: torch.dtype, overwrite=False, target=None, speculative_tokens=None, hub_repo=None
    ) -> Path:
        """Write the export folder atomically: built under a partial name, then published (`files.publish`) keeping
        the folder's other files; with `overwrite` these files replace those there. (`hub_repo`: for the layouts
        that name the Hub repository they are pushed to.)"""
        embedding = None if target is None else self.embedding(target)
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.state(head, embedding).items()}
        config = self.config(head, dtype, target, speculative_tokens)
        with building(out) as tmp:
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / WEIGHTS), metadata={"format": "pt"})
            (tmp / CONFIG).write_text(json.dumps(config, indent=2, default=str))
            self.write_companions(head, tmp)
        return publish_export(tmp, out, overwrite)


def publish_export(tmp: Path, out: Path, overwrite: bool) -> Path:
    """Publish the export built in `tmp` as the folder `out` (`files.publish`): whatever an earlier export there wrote
    and this one does not (`replaced_entries`) goes with the old folder, in the same rename; other files stay."""
    return publish(tmp, out, keep_others=True, replace=overwrite, drop=replaced_entries(out, tmp))


def replaced_entries(out: Path, tmp: Path) -> set[str]:
    """The entries of an earlier export in `out` that the new one in `tmp` does not write, which would describe
    another head: every format's file names (config.json, model.safetensors, token_map.pt, model.gguf), and the
    folders of the earlier export's format (its config.json's eagletree marker names it)."""
    from . import TOKEN_MAP
    from .gguf_file import FILE as GGUF_FILE
    from .registry import format_layouts

    names = {CONFIG, WEIGHTS, TOKEN_MAP, GGUF_FILE}
    try:
        before = json.loads((Path(out) / CONFIG).read_text())["eagletree"]["format"]
        names |= {name for other in format_layouts(before) for name in other.folders}
    except (OSError, ValueError, KeyError, TypeError, HeadError):  # none, or a format this eagletree does not know
        pass
    return names - {entry.name for entry in Path(tmp).iterdir()}
