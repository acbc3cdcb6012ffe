"""One error family (issue 69): every error eagletree raises for bad input derives from EagletreeError and from
the built-in class callers expect, so `except EagletreeError` catches them and `except ValueError` still does."""

import ast
import builtins
import json
from pathlib import Path

import pytest

from eagletree.errors import EagletreeError

ROOT = Path(__file__).resolve().parent.parent

# Built-in exceptions raised on purpose, each with why: a bug in the caller's use of an internal object, not bad
# input (RuntimeError), an abstract method (NotImplementedError), a module's attribute protocol (AttributeError)
# and the exit of a script (SystemExit).
ALLOWED = {
    ("eagletree/__init__.py", "AttributeError"),
    ("eagletree/decode/__init__.py", "AttributeError"),
    ("eagletree/train/vllm_connector.py", "AttributeError"),
    ("eagletree/draft/drafter.py", "RuntimeError"),
    ("eagletree/draft/batch_drafter.py", "RuntimeError"),
    ("eagletree/draft/block_drafter.py", "RuntimeError"),
    ("eagletree/draft/medusa.py", "RuntimeError"),
    ("eagletree/target/ragged.py", "RuntimeError"),
    ("eagletree/train/evaluate.py", "SystemExit"),
    *((path, "NotImplementedError") for path in ("eagletree/draft/base.py", "eagletree/export/layout.py")),
    ("eagletree/search/kinds.py", "NotImplementedError"),
}
BUILTIN_ERRORS = {
    name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)
}


def builtin_raises(path: Path) -> list[tuple[int, str]]:
    """(line, class name) of each `raise X(...)` or `raise X` of a built-in exception class in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTIN_ERRORS:
                found.append((node.lineno, exc.id))
    return found


def test_eagletree_raises_no_builtin_exception_class_outside_the_allow_list():
    bad = []
    for path in sorted(ROOT.glob("eagletree/**/*.py")):
        name = path.relative_to(ROOT).as_posix()
        bad += [f"{name}:{line} raises {cls}" for line, cls in builtin_raises(path) if (name, cls) not in ALLOWED]
    assert not bad, "raise an EagletreeError (errors.InvalidValue, InvalidType, a module's own) instead:\n" + "\n".join(
        bad
    )


def test_except_eagletree_error_catches_bad_options_prompts_heads_and_export_formats(tmp_path):
    from eagletree.decode import Decoder, encode_prompt
    from eagletree.decode.config import DecodeConfig
    from eagletree.draft import EagleHead, MedusaHead
    from eagletree.export.convert import check_format
    from eagletree.loading import load_head
    from eagletree.prompts import mtbench_subset

    from helpers import tiny_model, tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    (tmp_path / "config.json").write_text(json.dumps({"head_type": "eagle"}))
    for call, builtin in (
        (lambda: DecodeConfig.from_options(budget=0), ValueError),  # bad option
        (lambda: DecodeConfig.from_options(budgett=8), TypeError),
        (lambda: encode_prompt(tok, 3.5), TypeError),  # bad prompt
        (lambda: encode_prompt(tok, [{"role": "wizard", "content": "hi"}]), ValueError),
        (lambda: Decoder(model, tok, None, DecodeConfig(tree="eagle2")).generate_batch("hi"), TypeError),
        (lambda: load_head(tmp_path / "nowhere"), ValueError),  # bad head folder
        (lambda: load_head(tmp_path), ValueError),
        (lambda: check_format(MedusaHead.for_target(model.config), "vllm"), ValueError),  # bad export format
        (lambda: check_format(EagleHead.for_target(model.config), "onnx"), ValueError),
        (lambda: mtbench_subset(0), ValueError),
    ):
        with pytest.raises(EagletreeError) as e:
            call()
        assert isinstance(e.value, builtin), (type(e.value).__mro__, builtin)
        assert "\n" not in str(e.value)


def test_the_option_error_names_the_flag_on_the_command_line_and_stays_in_the_family():
    from eagletree.decode.config import OptionError

    error = OptionError("max_new_tokens", "must be >= 1, got 0")
    assert isinstance(error, EagletreeError) and isinstance(error, ValueError)
    cli = error.for_cli()
    assert isinstance(cli, EagletreeError) and isinstance(cli, ValueError)
    assert str(cli) == "--max-new-tokens must be >= 1, got 0"
