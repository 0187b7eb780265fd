"""Errors raised for bad user input. Each message says what to change."""


class ConfigError(ValueError):
    """The composed configuration cannot run; the message names the key and the fix."""


class DataError(ValueError):
    """A data file is missing or malformed; the message names the file (and line)."""
