"""The one base class of eagletree's own errors: the CLI catches it and prints its message as one line.

Every error eagletree raises for bad input or files derives from `EagletreeError`, so `except EagletreeError`
catches them all, and also from the built-in class it always was (ValueError, TypeError, OSError, RuntimeError),
so code that caught those still does. A module whose errors have a name of their own defines it (`HeadError`,
`TargetError`, `TrainingError`, ...); elsewhere `InvalidValue`, `InvalidType` and `MissingFile` are raised.
"""


class EagletreeError(Exception):
    """Bad input or files that eagletree refuses, with a message naming the bad value and what was expected."""


class InvalidValue(EagletreeError, ValueError):
    """A value of the right type that eagletree refuses (out of range, unknown name, malformed)."""


class InvalidType(EagletreeError, TypeError):
    """A value of a type eagletree does not take where it was given (a string for a list of prompts, a path for a
    loaded head)."""


class MissingFile(EagletreeError, FileNotFoundError):
    """A file or installed package eagletree needs and does not find; the message says how to get it."""
