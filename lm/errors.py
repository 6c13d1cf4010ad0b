"""User-facing errors: raised for bad input, printed as one line by the CLI."""


class UserError(Exception):
    """Bad input from the user (config, data, paths). The message says what and what to do."""
