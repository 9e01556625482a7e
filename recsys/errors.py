"""Errors caused by the user's input (job files, data, requests): shown without a traceback."""


class UserError(ValueError):
    """Bad input: the message says where (file, column, row group, key) and what was expected."""
