"""The one exception type for user mistakes.

A `UserError` carries a one-line message naming the cause and the fix. CLIs print it
without a traceback and exit non-zero; internal invariants use `assert` instead.
"""


class UserError(Exception):
    """A mistake in the user's input (path, flag, file contents, size), not a bug."""
