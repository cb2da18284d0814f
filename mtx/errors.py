"""Errors that reach the user as one line (no traceback) with a non-zero exit code."""


class MtxError(Exception):
    """A problem the user can fix: bad config, bad data, bad run directory."""

    exit_code = 1


class ConfigError(MtxError):
    """Invalid config file, key, type or value."""


class DataError(MtxError):
    """Missing, malformed or inconsistent data files."""


class CheckpointError(MtxError):
    """Missing, corrupted, unsafe or mismatched checkpoint."""
