"""The export formats by name. A format is a module of this package (eagle.py, vllm.py, ...) whose `LAYOUTS` are
`Layout`s (layout.py), one per kind of head it writes, each declaring the `head_type`s it takes; a format may set
`REFUSAL`, the one line that refuses a head of another kind. Formats are registered by name and their modules
imported when first asked, so the command line lists the names without loading torch.

Terms: a *format* is what `eagletree export --format` names; a *layout* is the files one format writes for one
kind of head ("vllm" has two: EAGLE-1/2 heads for method "eagle", EAGLE-3 heads for method "eagle3").
"""

from __future__ import annotations

from importlib import import_module

_MODULES: dict[str, str] = {}  # format name -> its module, in registration order (the CLI lists them so)
# How a format refuses a head of a kind it does not take, unless its module sets REFUSAL (same fields).
REFUSAL = "format {format!r} takes {takes} heads, not {head} (head_type {head_type!r}), which exports as {formats}"


def register(name: str, module: str | None = None) -> None:
    """Add export format `name`, written and imported by `module` (default: eagletree.export.<name>)."""
    _MODULES[name] = module or f"{__package__}.{name}"


def format_names() -> tuple[str, ...]:
    """The registered formats, in registration order (`eagletree export --format`'s choices)."""
    return tuple(_MODULES)


def _module(name: str):
    if name not in _MODULES:
        from ..draft import HeadError

        raise HeadError(f"export format {name!r} is not one of {format_names()}")
    return import_module(_MODULES[name])


def format_layouts(name: str) -> tuple:
    """The layouts of format `name`; HeadError naming the formats when there is no such format."""
    return tuple(_module(name).LAYOUTS)


def all_layouts() -> list:
    """Every registered format's layouts, formats in registration order."""
    return [layout for name in _MODULES for layout in format_layouts(name)]


def formats_taking(head_type: str) -> list[str]:
    """The formats with a layout for heads of `head_type`."""
    return [name for name in _MODULES if any(head_type in layout.heads for layout in format_layouts(name))]


def layout_for(name: str, head):
    """The layout format `name` writes `head` in: the one that declares the head's type. HeadError (one line naming
    the format, the head's type and the formats that take it) when none does."""
    for layout in format_layouts(name):
        if head.head_type in layout.heads:
            return layout
    from ..draft import HeadError

    raise HeadError(refusal(name, head.head_type))


def _quoted(names) -> str:
    return ", ".join(repr(n) for n in names)


def _kinds(layouts) -> list[str]:
    """The kinds of head (their names in messages) these layouts take, each once, in order."""
    return list(dict.fromkeys(layout.kind for layout in layouts))


def refusal(name: str, head_type: str) -> str:
    """Why format `name` does not write a head of `head_type`: what it takes and where such a head goes instead."""
    formats = formats_taking(head_type)
    if not formats:
        kinds = " and ".join(_kinds(all_layouts()))
        return f"format {name!r} does not take a {head_type!r} head: only {kinds} heads export (to {format_names()})"
    kind = _kinds(layout for layout in all_layouts() if head_type in layout.heads)[0]
    template = getattr(_module(name), "REFUSAL", REFUSAL)
    return template.format(
        format=name,
        takes=" and ".join(_kinds(format_layouts(name))),
        head=f"{'an' if kind[:1] in 'AEIOU' else 'a'} {kind} head",
        head_type=head_type,
        formats=_quoted(formats),
    )


def recognize(config: dict, folder):
    """The layout of a foreign folder from its config.json: among the layouts that recognize it, the one whose format
    its eagletree marker names (layouts whose files coincide: EAGLE's and vLLM's EAGLE-1/2 without bias), else the
    first that is not its kind's fallback, else the first."""
    candidates = [layout for layout in all_layouts() if layout.recognizes(config)]
    marker = config.get("eagletree")
    named = marker.get("format") if isinstance(marker, dict) else None
    for picked in (
        [layout for layout in candidates if layout.format == named],
        [layout for layout in candidates if not layout.fallback],
        candidates,
    ):
        if picked:
            return picked[0]
    from ..draft import HeadError

    raise HeadError(f"{str(folder)!r} holds no export eagletree reads (its formats: {_quoted(format_names())})")
