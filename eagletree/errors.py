"""The one base class of eagletree's own errors: the CLI catches it and prints its message as one line."""


class EagletreeError(Exception):
    """Bad input or files that eagletree refuses, with a message naming the bad value and what was expected.

    Each module's error also derives from the built-in class it always was (ValueError, OSError,
    RuntimeError), so code that caught those still does.
    """
