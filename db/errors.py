"""The one error readers and writers of the database need to catch."""


class DatabaseError(Exception):
    """The database cannot be opened or used: unreachable, corrupt, missing, or of another schema version.

    The message is one line and names the database URL (password hidden).
    """
