"""User-facing errors.

Anything a user can cause (a wrong key, a missing file, a layout that does not
fit) is raised as one of these, with a message that names the key, file or
value and says what to do. The CLI prints the message without a traceback and
exits non-zero; every other exception keeps its traceback. ``assert`` is
reserved for internal invariants.
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem with the user's input: config, paths, layout, data."""


class ConfigError(UserError):
    """A config file or ``key=value`` override is invalid."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the user named (or that their input implies) does not exist.
    Also a ``FileNotFoundError``, so callers that probe for a file can catch it as such."""
