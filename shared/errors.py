"""The one exception type that the CLI turns into a single clear error line."""


class SplitspecError(RuntimeError):
    """A problem the user can fix; the message says what was wrong and how to fix it."""
