"""The package's layout: no import cycles, the subpackages import one way only (:data:`LAYERS`), the core never imports
the entry points or the research tools, the module map (docs/architecture.md) and README's options table match the
code, README stays a quick guide and the docs' links resolve. Static checks: well under a second."""

import argparse
import ast
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "triforce"
README = (ROOT / "README.md").read_text(encoding="utf-8")
#: the module map ("Where things are") lives in docs/architecture.md
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
#: README.md is a quick guide (issue 48): the rest is in docs/
README_MAX_LINES = 220
#: the package's layers, bottom first: a module imports only modules of its own layer or of a layer below it
#: (a module belongs to the longest prefix named here; src/triforce/__init__.py's docstring shows the same order)
LAYERS = (
    ("triforce._version", "triforce.defaults", "triforce.errors"),
    ("triforce.text",),
    ("triforce.kernels",),
    ("triforce.kv",),
    ("triforce.model",),
    ("triforce.formats",),
    ("triforce.speculation",),
    ("triforce.plan",),
    ("triforce.engine",),
    ("triforce.api",),
    ("triforce",),
    ("triforce.serve", "triforce.lab"),
    ("triforce.cli", "triforce.__main__", "triforce.serve.__main__"),  # the entry points
)
#: import edges allowed to close a cycle, each with its reason
ALLOWED_EDGES: set[tuple[str, str]] = set()
ENTRY_PACKAGES = ("triforce.cli", "triforce.serve", "triforce.lab")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name: str) -> set[str]:
    """Modules of this package that ``name`` imports anywhere (functions included; not under ``TYPE_CHECKING``,
    which never runs), with the packages above an imported module that ``name`` is not inside."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    skip = {id(n) for t in ast.walk(tree) if _type_checking(t) for n in ast.walk(t)}
    base = name.split(".") if _is_package(name) else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([mod] if mod else []))
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            if t in MODULES and t != name and not name.startswith(t + "."):  # its own packages are already running
                found.add(t)
                parts = t.split(".")
                for i in range(2, len(parts)):  # the packages above it run first (not the root, nor our own)
                    parent = ".".join(parts[:i])
                    if name != parent and not name.startswith(parent + "."):
                        found.add(parent)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle found by depth-first search from each module (one per back edge)."""
    out, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if (m, n) in ALLOWED_EDGES:
                continue
            if state.get(n) == 1:
                out.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return out


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_cycle_check_sees_a_cycle_and_lazy_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert "triforce.lab.bench" in GRAPH["triforce.cli.bench"]  # an import inside a function counts


def test_the_core_never_imports_the_entry_points_or_the_lab():
    core = [m for m in MODULES if not m.startswith(ENTRY_PACKAGES) and m != "triforce.__main__"]
    bad = {m: sorted(n for n in GRAPH[m] if n.startswith(ENTRY_PACKAGES)) for m in core}
    assert {m: v for m, v in bad.items() if v} == {}
    # one way: cli -> serve, cli -> lab; the server and the lab never import the command line
    for m in MODULES:
        if m.startswith(("triforce.serve", "triforce.lab")) and m != "triforce.serve.__main__":
            assert not [n for n in GRAPH[m] if n.startswith("triforce.cli")], m
        if m.startswith("triforce.lab"):
            assert not [n for n in GRAPH[m] if n.startswith("triforce.serve")], m


def _layer(name: str) -> int:
    """The index in :data:`LAYERS` of the longest prefix of ``name`` listed there."""
    best, index = "", None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
                best, index = prefix, i
    assert index is not None, f"{name} is in no layer of LAYERS"
    return index


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import edge that goes from a layer to a layer above it."""
    return sorted(f"{m} -> {n}" for m, targets in graph.items() for n in targets if _layer(n) > _layer(m))


def test_subpackages_import_one_way():
    """Every module is in a layer, and none imports a module of a layer above its own (functions included)."""
    assert _upward_imports(GRAPH) == []
    assert set(_layer(m) for m in MODULES) == set(range(len(LAYERS)))  # every layer holds a module


def test_the_layer_check_sees_an_upward_import():
    graph = {"triforce.kernels.cpu": {"triforce.kv.caches"}, "triforce.kv.caches": {"triforce.kernels.cpu"}}
    assert _upward_imports(graph) == ["triforce.kernels.cpu -> triforce.kv.caches"]


def test_every_subpackage_says_what_it_is():
    """Each subpackage's ``__init__.py`` is a docstring that names its idea (and imports nothing: no side effects,
    no cycles through a package's re-exports)."""
    for m, p in MODULES.items():
        if p.name == "__init__.py" and m.count(".") == 1 and m.split(".")[1] in {"kernels", "kv", "model", "formats",
                                                                             "speculation", "text"}:
            tree = ast.parse(p.read_text(encoding="utf-8"))
            assert ast.get_docstring(tree), m
            assert [type(n).__name__ for n in tree.body] == ["Expr"], m


def test_nothing_outside_the_engine_touches_its_private_fields():
    pattern = re.compile(r"\b(engine|eng)\._[a-z]|\._(lower_model|full|full_tokens|capacity|lookahead|fit)\b")
    hits = []
    for folder in ("src", "bench", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name in ("engine.py", "test_layout.py"):
                continue
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert hits == []


def test_module_map_lists_every_module():
    """Every module of src/ is named in docs/architecture.md's "Where things are" table (a subpackage's
    ``__init__.py`` by its folder; ``__main__.py`` files, the ``python -m`` entry points, need not be), and every path
    the table names exists."""
    section = ARCHITECTURE.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    listed = set()
    for row in re.findall(r"^\| (.+) \|$", section, re.MULTILINE):
        folder = ""
        for path in re.findall(r"`([^`]+)`", row):
            if path.startswith("src/"):
                folder = path.rstrip("/") if path.endswith("/") else path.rsplit("/", 1)[0]
                listed.add(path.rstrip("/"))
            elif path.endswith(".py") and folder:
                listed.add(f"{folder}/{path}")
    missing = []
    for m, p in MODULES.items():
        rel = p.relative_to(ROOT).as_posix()
        if p.name == "__main__.py" or m == "triforce":
            continue
        if p.name == "__init__.py":  # a subpackage: its folder is listed
            rel = rel.rsplit("/", 1)[0]
        if rel not in listed:
            missing.append(rel)
    assert missing == []
    assert sorted(p for p in listed if not (ROOT / p).exists()) == []  # and names nothing that is not there


def test_readme_is_a_quick_guide():
    """README.md stays a quick guide: at most README_MAX_LINES lines; the details live in docs/."""
    n = len(README.splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines, at most {README_MAX_LINES}: move details to docs/"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not ``-`` or ``_``), spaces as ``-``."""
    text = re.sub(r"`|\*\*", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    """The anchors of a Markdown file's headings (headings inside code fences are not headings)."""
    out, counts, fenced = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            slug = _slug(m.group(1))
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_files_and_headings_that_exist(doc):
    text, bad = doc.read_text(encoding="utf-8"), []
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text(encoding="utf-8")):
            bad.append(f"{target}: no such heading in {dest.relative_to(ROOT)}")
    assert bad == []


def test_dated_sections_only_in_the_history():
    """Current docs are by topic; the dated record (headings with a date) is docs/history.md alone."""
    dated = [f"{doc.relative_to(ROOT)}: {line}" for doc in DOCS if doc.name != "history.md"
             for line in re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.DOTALL).splitlines()
             if re.match(r"#{1,6} .*\b20\d\d-\d\d-\d\d\b", line)]
    assert dated == []


def _parser_options() -> dict[str, argparse.Action]:
    from triforce.cli import build_parser

    out = {}
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("generate", "serve"):
        for action in sub.choices[command]._actions:
            for flag in action.option_strings:
                out.setdefault(flag, action)
    return out


def test_readme_options_table_matches_the_parser():
    """Every option in README's table exists, and its default (when it has a value) is the one written there."""
    options = _parser_options()
    rows = re.findall(r"^\| (`--[^|]+) \| (.+) \|$", README, re.MULTILINE)
    assert len(rows) > 20
    seen = set()
    for flags_cell, meaning in rows:
        for flag in re.findall(r"`(--[a-z0-9-]+)", flags_cell):
            assert flag in options, f"README lists {flag}, which `triforce generate/serve` does not take"
            seen.add(flag)
            value = options[flag].default
            if value in (None, False, []) or isinstance(value, bool):
                continue
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            assert re.search(rf"(?<![\w.]){re.escape(shown)}(?![\w.])", meaning), \
                f"README: {flag} should show its default {shown}: {meaning}"
    generate = {f for f, a in options.items() if f.startswith("--") and f not in ("--help",)}
    server_only = {"--host", "--port", "--queue-size", "--max-batch", "--prefix-cache-gib", "--request-timeout",
                   "--log-level", "--api-key"}
    assert generate - server_only - seen == set(), "options missing from README's table"


@pytest.mark.parametrize("command", ["bench", "analyze"])
def test_lab_option_names_match_the_lab(command):
    if command == "bench":
        from triforce.cli.bench import METHOD_NAMES
        from triforce.lab.bench import METHODS

        assert tuple(METHODS) == METHOD_NAMES
    else:
        from triforce.cli.analyze import ANALYSES
        from triforce.lab.analyze import ANALYSES as LAB

        assert ANALYSES == LAB


def test_shared_defaults_come_from_one_table():
    from triforce.defaults import DEFAULTS, LIBRARY_MODE, SERVE_DEFAULTS
    from triforce.serve import ServerDefaults
    from triforce.speculation.auto import choose_hierarchy
    from triforce.speculation.hierarchy import SpeculationConfig
    from triforce.speculation.sampling import SamplingParams

    spec, options = SpeculationConfig(), _parser_options()
    assert spec.mode == LIBRARY_MODE and options["--mode"].default == DEFAULTS["mode"]
    for name in SpeculationConfig.option_names():
        if name in DEFAULTS and name != "mode":
            assert getattr(spec, name) == DEFAULTS[name], name
    sampling, server = SamplingParams(), ServerDefaults()
    for name in ("temperature", "top_p", "top_k"):
        flag = "--" + name.replace("_", "-")
        assert getattr(sampling, name) == getattr(server, name) == DEFAULTS[name] == options[flag].default
    assert server.max_tokens == DEFAULTS["max_new_tokens"] and server.queue_size == SERVE_DEFAULTS["queue_size"]
    kw = inspect.signature(choose_hierarchy).parameters
    for name, key in (("gamma1", "gamma1"), ("gamma2", "gamma2"), ("chunk_size", "chunk_size"),
                      ("max_budget", "budget")):
        assert kw[name].default == DEFAULTS[key], name
    for flag, action in options.items():
        dest = action.dest
        if dest in DEFAULTS and action.default is not None and not isinstance(action.default, list):
            assert action.default == DEFAULTS[dest] or dest in SERVE_DEFAULTS, flag


BENCH = ROOT / "bench"
#: bench/'s scripts: every .py and .sh outside bench/results
BENCH_SCRIPTS = sorted(p for p in BENCH.rglob("*") if p.suffix in (".py", ".sh") and "results" not in p.parts
                       and "__pycache__" not in p.parts)


def _names_a_commit(obj, depth: int = 0) -> bool:
    """Whether a result (a dict) holds a non-empty string under a key with "commit" in its name, at most two levels
    down (``commit_added``, ``machine.git_commit``, ``provenance.git_commit``)."""
    if not isinstance(obj, dict):
        return False
    if any("commit" in k and isinstance(v, str) and v for k, v in obj.items()):
        return True
    return depth < 2 and any(_names_a_commit(v, depth + 1) for v in obj.values())


def test_every_result_json_names_its_commit():
    """bench/README.md, "Results and the commit that made them": every JSON under bench/results, and every line of a
    .jsonl, names the commit of the code it measured (or the commit that added it)."""
    import json

    missing = []
    for path in sorted((BENCH / "results").rglob("*.json*")):
        if path.suffix not in (".json", ".jsonl"):
            continue
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines() if path.suffix == ".jsonl" else [text]
        objs = [json.loads(x) for x in lines if x.strip()]
        if not all(_names_a_commit(o) for o in objs):
            missing.append(path.relative_to(ROOT).as_posix())
    assert missing == []


def test_bench_readme_names_every_script():
    """bench/README.md is the index of bench/: every script is in it by its path."""
    index = (BENCH / "README.md").read_text(encoding="utf-8")
    assert BENCH_SCRIPTS
    assert [p.relative_to(ROOT).as_posix() for p in BENCH_SCRIPTS
            if p.relative_to(BENCH).as_posix() not in index] == []


def test_docs_name_bench_scripts_that_exist():
    """A bench script named by path in README.md, docs/ or bench/README.md exists there (scripts live in groups:
    bench/e2e/, bench/kernels/, ...); ``COMMIT:bench/...`` (``git show``) names a path at another commit."""
    bad = []
    for doc in [*DOCS, BENCH / "README.md"]:
        for path in re.findall(r"(?<![\w./:-])bench/[\w./-]+?\.(?:py|sh)\b", doc.read_text(encoding="utf-8")):
            if not (ROOT / path).exists():
                bad.append(f"{doc.relative_to(ROOT)}: {path}")
    assert bad == []
