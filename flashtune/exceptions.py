"""The project's exception hierarchy.

Every error flashtune raises on purpose derives from :class:`FlashtuneError`, so
callers can catch the whole family. Input validation on the public API raises
the builtin ``ValueError``/``TypeError`` (what PyTorch users expect); the
subclasses below that also derive from them keep that contract.
"""

from __future__ import annotations


class FlashtuneError(Exception):
    """Base class of every flashtune error."""


class InfeasibleConfigError(FlashtuneError, ValueError):
    """A kernel config cannot run on this problem or device (the message says why)."""


class StorageError(FlashtuneError):
    """The tuning database could not be opened, read or written."""


class DatabaseMissingError(StorageError, FileNotFoundError):
    """A database opened read-only (or a shipped file) does not exist."""


class SchemaError(StorageError):
    """The database is of a schema this version cannot use (too new, or not ours)."""


class SchemaOutdatedError(SchemaError):
    """A database opened read-only is of an older schema: one open for writing upgrades it."""


class ImportValidationError(FlashtuneError, ValueError):
    """An export file failed validation; nothing was written."""


class DispatchMissError(FlashtuneError, LookupError):
    """FLASHTUNE_STRICT=1 and the dispatcher has no tuned config for a call."""


class TuningError(FlashtuneError):
    """The tuner could not produce a result (e.g. every candidate failed)."""


class SweepError(FlashtuneError):
    """A sweep could not be set up or coordinated (the message says why)."""
