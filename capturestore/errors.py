"""Errors raised by the store. Bad input is a plain ValueError (naming what and where)."""


class StoreError(Exception):
    """A store cannot be used as asked (not a store, newer format, corrupt data)."""


class FormatVersionError(StoreError):
    """The store was written by a newer capturestore format than this code reads."""


class CorruptChunkError(StoreError):
    """A chunk failed its checksum or is missing; the message names run, prompt, array, chunk."""


class QueryError(StoreError):
    """A query through ``Store.sql`` was refused (not read-only, or outside the store) or failed; one line naming why."""
