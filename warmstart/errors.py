"""User-facing errors: a one-paragraph message that names the fix; the CLI prints it without a traceback."""


class UserError(Exception):
    """A problem with the user's input or environment, not a bug."""
