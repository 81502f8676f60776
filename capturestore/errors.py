"""Errors raised by the store. Bad input is a plain ValueError (naming what and where)."""


class StoreError(Exception):
    """A store cannot be used as asked (not a store, newer format, corrupt data)."""


class FormatVersionError(StoreError):
    """The store was written by a newer capturestore format than this code reads."""


class CorruptChunkError(StoreError):
    """A chunk failed its checksum or is missing; the message names run, prompt, array, chunk."""


class WriterIdTaken(StoreError):
    """A writer id's pending lock (``pending/<id>.json``) is held by a live writer, or left by a
    dead one on a medium where only ``gc`` may remove it (a lease on object storage)."""


class QueryError(StoreError):
    """A query through ``Store.sql`` was refused (not read-only, or outside the store) or failed; one line naming why."""
