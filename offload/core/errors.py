"""The one exception type for user mistakes.

A `UserError` carries a one-line message naming the cause and the fix. CLIs print it
without a traceback and exit non-zero; internal invariants use `assert` instead.
"""


class UserError(Exception):
    """A mistake in the user's input (path, flag, file contents, size), not a bug."""


class PromptTooLong(UserError):
    """A prompt that leaves no room in the model's context: offload-run refuses a job
    holding one before the model loads, unless --skip-invalid records it as an error."""
