"""Comparators: the kinds of evidence a comparison computes, each with its declared tables.

``compare_runs`` (``capturestore.analysis``) keeps the run checks, the prompt loop and the
``comparisons`` row (written last); the comparators do the rest (``base`` has the protocol and
the pass / phase / localisation rules). Built in: ``logits``, ``kv``, ``fp8_kv_floor`` (``nki_fp8.target``),
``modules``, ``routing`` (MoE expert choices), ``raw_errors`` (opt-in: the KV errors ``capturestore.aggregate`` pools). Another
package adds one by registering it (``register_comparator``) or through the Python entry-point
group ``capturestore.comparators`` (``name = "package.module:ComparatorClass"``), loaded on the
first lookup.

``declared_tables()`` is every table a registered comparator writes, plus ``comparisons``: the
catalog's views and docs/tables.md are checked against it.
"""
from __future__ import annotations

from capturestore.comparators.base import (
    COMPARISONS_SCHEMA_VERSION,
    Comparator,
    ComparisonContext,
    Localisation,
    PromptCaptures,
    PromptResult,
    TableSpec,
    Verdict,
    comparisons_schema,
    decoder_layer_index,
    finite_or_null,
    localise,
    overall_passed,
    phase_at,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Comparator",
    "ComparisonContext",
    "Localisation",
    "PromptCaptures",
    "PromptResult",
    "TableSpec",
    "Verdict",
    "comparator_class",
    "comparator_names",
    "comparisons_schema",
    "declared_tables",
    "decoder_layer_index",
    "finite_or_null",
    "localise",
    "overall_passed",
    "phase_at",
    "register_comparator",
]

ENTRY_POINT_GROUP = "capturestore.comparators"

_BUILTIN = {
    "logits": "capturestore.comparators.logits:LogitsComparator",
    "kv": "capturestore.comparators.kv:KVComparator",
    "fp8_kv_floor": "nki_fp8.target:Fp8KVFloorComparator",
    "modules": "capturestore.comparators.modules:ModulesComparator",
    "raw_errors": "capturestore.comparators.raw_errors:RawErrorsComparator",
    "routing": "capturestore.comparators.routing:RoutingComparator",
    "cachecheck": "capturestore.comparators.cachecheck:CacheCheckTables",  # tables only (capturestore.cachecheck)
    "isolation": "capturestore.isolate:IsolationTables",  # tables only (capturestore.isolate)
}
_registry: dict[str, type[Comparator]] = {}
_loaded = False


def register_comparator(cls: type[Comparator], *, replace: bool = False) -> type[Comparator]:
    """Register ``cls`` under ``cls.name`` (usable as a class decorator). A name already taken by
    another class is refused unless ``replace``; so is a table another comparator declares."""
    if not isinstance(cls, type) or not issubclass(cls, Comparator) or not cls.name:
        raise ValueError(f"register_comparator: {cls!r} is not a Comparator subclass with a name")
    _load()
    old = _registry.get(cls.name)
    if old is not None and old is not cls and not replace:
        raise ValueError(f"register_comparator: the name {cls.name!r} is taken by {old.__module__}.{old.__qualname__}")
    for other in _registry.values():
        clash = set(other.tables) & set(cls.tables)
        if other.name != cls.name and clash:
            raise ValueError(f"register_comparator: {cls.name!r} declares table(s) {sorted(clash)} that "
                             f"comparator {other.name!r} writes")
    _registry[cls.name] = cls
    return cls


def _import(target: str):
    import importlib

    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _load() -> None:
    """Built-ins first, then the entry points (a broken plugin is named, not skipped silently)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name, target in _BUILTIN.items():
        _registry[name] = _import(target)
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _registry:
            continue
        try:
            cls = ep.load()
        except Exception as e:  # noqa: BLE001 - one line naming the plugin
            raise ValueError(f"comparator plugin {ep.name!r} ({ep.value}) cannot be loaded: {e}") from None
        register_comparator(cls)


def comparator_names() -> list[str]:
    _load()
    return list(_registry)


def comparator_class(name: str) -> type[Comparator]:
    _load()
    try:
        return _registry[name]
    except KeyError:
        raise ValueError(f"unknown comparator {name!r}; registered: {', '.join(_registry)}") from None


def declared_tables() -> dict[str, TableSpec]:
    """{table: TableSpec} of every registered comparator's tables and ``comparisons``."""
    _load()
    out: dict[str, TableSpec] = {}
    for cls in _registry.values():
        out.update(cls.tables)
    out["comparisons"] = TableSpec(comparisons_schema(_registry.values()), COMPARISONS_SCHEMA_VERSION)
    return out
