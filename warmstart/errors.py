"""User-facing errors: a one-paragraph message that names the fix; the CLI prints it without a traceback."""
from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input or environment, not a bug. `param` names the offending field when there is
    one (a SamplingParams field, a request field), so the server can put it in the OpenAI error's "param"."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
