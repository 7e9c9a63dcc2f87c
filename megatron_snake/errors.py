"""The one kind of error a user's input causes.

A ``UserError`` is a run refused because of something the user gave it: a flag, a path, a
checkpoint, a dataset, the room on a drive or in memory. Its message is one line that names
that input and says what to do. An entry point prints the message alone (no traceback) and
exits with ``exit_status``; any other exception is a defect and keeps its traceback.
Specific errors subclass it together with the builtin they refine (``ValueError``,
``OSError``, ...), so callers that catch the builtin still do.
"""


class UserError(Exception):
    """Refused because of the user's input; the message names it and what to do."""

    exit_status = 1
