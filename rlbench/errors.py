"""Errors raised for bad user input. Each message says what to change."""


class ConfigError(ValueError):
    """The composed configuration cannot run; the message names the key and the fix."""


class DataError(ValueError):
    """A data file is missing or malformed; the message names the file (and line)."""


class AlreadyFinished(Exception):
    """``resume=`` of a run that finished, with nothing left to train: the message says so and how to
    evaluate it again or train it longer; the process exits 0 and the run's files stay as they were."""


def error_message(err: BaseException) -> str:
    """The one-line report of a refused or failed run: ``ConfigError: ...``; a ``???`` left in the
    config (omegaconf's MissingMandatoryValue) says which key to add on the command line."""
    from omegaconf.errors import MissingMandatoryValue

    if isinstance(err, MissingMandatoryValue):
        key = getattr(err, "full_key", "") or str(err)
        return f"ConfigError: {key} must be set (it is ??? in the config); add {key}=<value> to the command line"
    return f"{type(err).__name__}: {err}"
