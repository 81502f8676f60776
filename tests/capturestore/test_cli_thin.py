"""Each ``capturestore`` command is a thin wrapper (STYLE.md, issue 19 §2): its handler
(``cmd_<command>`` in capturestore/cli/commands.py) parses its arguments, calls exactly one
function of the library and formats what it returns. Work that strings several library calls
together (open the store, check it can be written, decide what kind of thing an id names, ...)
belongs in that one library function, where a library user gets it too.

A small AST scan. A library call is a call of a name imported from a project package outside the
CLI (``capturestore.*`` but ``capturestore.cli``, ``extractors``, ``metrics``, ``nki_fp8``,
``reports``), or of an attribute of such an imported module (``pipeline.run``), made in the
handler or in a helper of commands.py it calls (followed transitively). Calls of methods on
objects (``store.runs()`` on the store the handler opened, ``result.summary()``) are not counted:
a Store-method command is ``open_store`` then that method. Imported constants are not calls.
KNOWN_DEBT lists the handlers still calling more than one when this test was written: it may only
shrink."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMANDS = REPO / "capturestore" / "cli" / "commands.py"
LIBRARY = ("capturestore", "extractors", "metrics", "nki_fp8", "reports")
CLI = "capturestore.cli"
# The HTML forms of a result the handler got (reports' job, issue 19 §2: ``--format html`` of diff
# and history): formatting, so they do not count as the handler's library call.
PRESENTATION = {"reports.render_diff", "reports.history_html"}
# handler -> the library functions it still calls beyond one (issue 19 §2); remove an entry when fixed
KNOWN_DEBT: dict[str, set[str]] = {
    "cmd_gc": {"capturestore.store.open_store_path", "capturestore.store.require_writable"},
    "cmd_rebuild_catalog": {"capturestore.store.open_store_path", "capturestore.store.require_writable"},
}


def _is_library(module: str) -> bool:
    return module.split(".")[0] in LIBRARY and not (module == CLI or module.startswith(CLI + "."))


def _bindings(body) -> dict[str, tuple[str, bool]]:
    """name -> (what it is bound to, whether that is a module) for the library imports among ``body``
    (a module's or a function's statements, nested blocks included)."""
    out = {}
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_library(node.module):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                is_mod = (REPO / Path(*full.split("."))).with_suffix(".py").exists() or \
                    (REPO / Path(*full.split(".")) / "__init__.py").exists()
                out[a.asname or a.name] = (full, is_mod)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if _is_library(a.name):
                    out[a.asname or a.name.split(".")[0]] = (a.asname and a.name or a.name.split(".")[0], True)
    return out


def library_calls(source: str) -> dict[str, set[str]]:
    """{handler name: the library functions it calls, directly or through the module's helpers}."""
    tree = ast.parse(source)
    top = [s for s in tree.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
    module_names = _bindings(top)
    funcs = {f.name: f for f in tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def calls(name: str, seen: set[str]) -> set[str]:
        if name in seen:
            return set()
        seen.add(name)
        f = funcs[name]
        names = {**module_names, **_bindings(f.body)}
        found = set()
        for node in ast.walk(f):  # PRESENTATION is taken out by thin_violations
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            if isinstance(fn, ast.Name):
                if fn.id in names and not names[fn.id][1]:
                    found.add(names[fn.id][0])
                elif fn.id in funcs and fn.id not in names:
                    found |= calls(fn.id, seen)
            elif isinstance(fn, ast.Attribute):  # pipeline.run, capturestore.pipeline.run
                parts = []
                while isinstance(fn, ast.Attribute):
                    parts.insert(0, fn.attr)
                    fn = fn.value
                if isinstance(fn, ast.Name) and fn.id in names and names[fn.id][1]:
                    found.add(".".join([names[fn.id][0], *parts]))
        return found

    return {n: calls(n, set()) for n in funcs if n.startswith("cmd_")}


def test_the_scan_counts_a_handler_calling_two_library_functions():
    planted = (
        "from capturestore.store import open_store_path as open_store, require_writable\n"
        "from capturestore.cli.output import write_result\n"
        "def _check(store):\n    require_writable(store, 'x')\n"
        "def cmd_two(args):\n    store = open_store(args.store)\n    _check(store)\n    store.gc()\n"
        "    write_result(store.runs(), 'table', None)\n    return 0\n"
        "def cmd_one(args):\n    from capturestore import pipeline\n    from capturestore.diff import BC_MARGIN\n"
        "    r = pipeline.run(args.model, margin=BC_MARGIN)\n    print(r.summary())\n    return 0\n"
        "def cmd_module(args):\n    import capturestore.pipeline\n    from reports import render_comparison\n"
        "    return capturestore.pipeline.run(render_comparison(args))\n"
        "def cmd_html(args):\n    from capturestore.diff import diff\n    from reports import render_diff\n"
        "    return render_diff(args.store, diff(args.store))\n"
    )
    found = library_calls(planted)
    assert found["cmd_two"] == {"capturestore.store.open_store_path", "capturestore.store.require_writable"}
    assert found["cmd_one"] == {"capturestore.pipeline.run"}
    assert found["cmd_module"] == {"capturestore.pipeline.run", "reports.render_comparison"}
    assert found["cmd_html"] == {"capturestore.diff.diff", "reports.render_diff"}  # render_diff: PRESENTATION
    assert thin_violations(found, {}) == {"cmd_two": sorted(found["cmd_two"]), "cmd_module": sorted(found["cmd_module"])}
    assert thin_violations(found, {"cmd_two": set(found["cmd_two"])}) == {"cmd_module": sorted(found["cmd_module"])}


def thin_violations(found: dict[str, set[str]], debt: dict[str, set[str]]) -> dict[str, list[str]]:
    """Handlers calling other than exactly one library function, beyond what ``debt`` allows them."""
    bad = {}
    for name, fns in found.items():
        fns = fns - PRESENTATION
        if len(fns) != 1 and not fns <= debt.get(name, set()):  # more than the debt allows
            bad[name] = sorted(fns)
    return bad


def test_every_command_calls_one_library_function():
    found = library_calls(COMMANDS.read_text())
    assert "cmd_run" in found and "cmd_compare" in found, sorted(found)  # the scan sees the handlers
    bad = thin_violations(found, KNOWN_DEBT)
    assert not bad, ("handlers calling other than one library function (put the work into one library function "
                     f"of the command's name that returns a typed result): {bad}")
    changed = {n: sorted(found.get(n, ())) for n, allowed in KNOWN_DEBT.items()
               if (found.get(n, set()) - PRESENTATION) != allowed}
    assert not changed, f"fewer library calls than KNOWN_DEBT allows, so shrink or remove its entries: {changed}"
