"""Export a head to a registered format's folder, and import a folder in any registered format: what
`eagletree export` and `eagletree import` do, through the layout the registry picks."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import target as targets  # targets.load_target is looked up per call, so a test can stand a tiny model in
from ..draft import DraftHead, HeadError
from ..files import check_output_dir
from ..search.copy import copy_calibration_names
from .layout import Layout
from .registry import format_layouts, format_names, layout_for, recognize
from .shared import read_export_config


def check_format(head, fmt: str, hub_repo: str | None = None) -> Layout:
    """The layout `fmt` writes `head` in; HeadError (one line, naming the formats the head takes) unless the format
    takes the head and its engines load heads for the head's target, and names a Hub repository if given one.
    Loads nothing."""
    layout = layout_for(fmt, head)
    layout.check(head)
    if hub_repo is not None and not layout.names_hub_repo:
        takers = [name for name in format_names() if any(lay.names_hub_repo for lay in format_layouts(name))]
        raise HeadError(f"format {fmt!r} names no Hub repository (--hub-repo {hub_repo!r}); that is for {takers}")
    if hub_repo is not None:
        layout.check_hub_repo(hub_repo)
    return layout


def exported_state(head, fmt: str, embedding: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The weight dict of an export (in the head's precision). `embedding` (the target's input embedding) is required
    by a format that carries it ("eagle3": EAGLE's code loads it from there)."""
    return check_format(head, fmt).state(head, embedding)


def engine_notes(head, fmt: str, target_config=None) -> list[str]:
    """What an engine will do differently from eagletree with this export (printed by `eagletree export`)."""
    return layout_for(fmt, head).notes(head, target_config)


def export_head(
    head,
    out_dir,
    fmt: str,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
    target=None,
    speculative_tokens: int | None = None,
    hub_repo: str | None = None,
) -> Path:
    """Write the export folder (config.json + model.safetensors, and a format's companion files) atomically.

    `out_dir` must be absent or empty unless `overwrite`, which replaces these files and keeps the
    folder's other files; it is never the head's own folder. `target` (the target model) is needed by a format
    whose layout `needs_target` ("eagle3" carries the target's embedding; "speculators" names the target's folder
    as the verifier vLLM loads); `speculative_tokens` is the speculators config's chain length (default 3);
    `hub_repo` the Hub repository ("OWNER/NAME") a layout that names one will be pushed to ("hf-generate").
    """
    layout = check_format(head, fmt, hub_repo)
    out = Path(out_dir)
    source = head.folder
    check_output_dir(out, overwrite, sources=[source] if source else [])
    if target is not None:
        head.check_target(target.config)
    return layout.write(head, out, dtype, overwrite, target, speculative_tokens, hub_repo)


def recognize_folder(folder) -> Layout:
    """The layout of a folder to import (read from its config.json, or the metadata of the GGUF file it holds instead);
    HeadError naming the file when it is unreadable or an eagletree head's."""
    from .gguf_file import gguf_export_config

    return recognize(gguf_export_config(folder) or read_export_config(folder), folder)


def import_folder(folder, target) -> DraftHead:
    """The head in a folder of any registered format, for `target`: the target model, or its config where the
    folder's layout does not need the model (`recognize_folder(folder).imports_with_model` says which)."""
    return recognize_folder(folder).load(Path(folder), target)


def import_head(folder, target_spec: str, out, overwrite: bool = False) -> DraftHead:
    """`eagletree import`: the head in `folder` (any registered format) for the target `target_spec` names (the
    model, on the CPU, where the folder's layout builds the head from it; else only its config), saved as an
    eagletree head in `out`. `overwrite` writes into a non-empty `out`, keeping its other files but the
    calibration tables measured for the head it replaces."""
    layout = recognize_folder(folder)
    if layout.imports_with_model:
        model, _ = targets.load_target(target_spec, device="cpu")
        head = layout.load(Path(folder), model)
    else:
        from transformers import AutoConfig  # lazy: the config alone, where no model is loaded

        head = layout.load(Path(folder), AutoConfig.from_pretrained(targets.resolve_target(target_spec)))
    head.save_pretrained(out, keep_others=True, replace=overwrite)
    for name in ("calibration.json", *copy_calibration_names(False)):  # measured for the head replaced there
        (Path(out) / name).unlink(missing_ok=True)
    return head


def import_for_config(folder, target_config) -> DraftHead:
    """`import_folder` given only the target's config: HeadError naming `eagletree import` for a layout that builds
    its head from the target model."""
    return importable_layout(folder).load(Path(folder), target_config)


def importable_layout(folder) -> Layout:
    """The layout of an export folder that `import_for_config` imports, read from its config.json alone; HeadError
    naming `eagletree import` for a layout that builds its head from the target model."""
    layout = recognize_folder(folder)
    if layout.imports_with_model:
        raise HeadError(
            f"{str(folder)!r} holds an export of {layout.kind} heads (format {layout.format!r}), which import builds "
            "from the target model: run `eagletree import --eagle DIR --target T --out HEAD` and use HEAD"
        )
    return layout
