"""`eagletree viz`: one real drafting step (tree, attention mask, verification replay) as an HTML page."""

from __future__ import annotations

from ..errors import InvalidValue
from .common import add_decoding_args, at_least, refuse_head_none


def add_viz_parser(sub) -> None:
    """The subparser of viz."""
    p = sub.add_parser("viz", help="one drafting step as an HTML page: tree, attention mask, verification replay")
    add_decoding_args(p, tree="eagle2", needs_head=True)  # a picture of a tree: auto may verify the root alone
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--step", type=at_least(1), default=1, help="show the K-th target pass of the generation (1 = the first)"
    )
    p.add_argument("-o", "--output", default="tree.html", help="the HTML file to write")
    p.set_defaults(func=cmd_viz)


def cmd_viz(args) -> int:
    """Write one real drafting step (tree, mask, acceptance replay) as a self-contained HTML page."""
    from pathlib import Path

    from ..decode import check_utf8
    from ..decode.config import DecodeConfig
    from ..files import check_output_file, write_text_atomic
    from ..viz import render_html, viz_step
    from .models import load_from_args

    check_utf8(args.prompt, "--prompt")
    if not args.prompt.strip():
        raise InvalidValue("--prompt is empty; give the text to answer")
    check_output_file(args.output, "-o/--output")  # before the work
    refuse_head_none(args, "viz", "shows the tree a draft head drafts")
    config = DecodeConfig.from_args(args)
    model, tok, head = load_from_args(args)
    messages = [{"role": "user", "content": args.prompt}]
    data = viz_step(model, tok, head, messages, step=args.step, config=config.for_device(model.device))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, render_html(data))
    greedy = len(data["greedy"]["accepted"])
    print(
        f"wrote {out}: step {args.step}, {args.tree} tree of {len(data['tokens'])} nodes, "
        f"E[tokens/pass] {data['expected']:.3f} (under the target {data['target_expected']:.3f}), "
        f"greedy verification emits {greedy} token{'s' if greedy > 1 else ''}"
    )
    return 0
