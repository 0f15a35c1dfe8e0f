"""The one exception type for user mistakes.

A `UserError` carries a one-line message naming the cause and the fix. CLIs print it
without a traceback and exit non-zero; internal invariants use `assert` instead. It is
a `ValueError`, so code written for vLLM (which raises `ValueError` for bad arguments)
catches it.
"""


class UserError(ValueError):
    """A mistake in the user's input (path, flag, file contents, size), not a bug."""


class PromptTooLong(UserError):
    """A prompt that leaves no room in the model's context: offload-run refuses a job
    holding one before the model loads, unless --skip-invalid records it as an error."""


class BadTokenIds(UserError):
    """Prompt token ids outside the model's vocabulary: refused before the load, like a
    prompt past the context (or recorded as an error with --skip-invalid)."""


class DiskFull(UserError):
    """A write found no space left: the message names the path, the space needed and
    the fix; what was written before stays (results, the weight store's stages)."""
