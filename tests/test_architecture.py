"""
The package's structure (issue 14), read from the source with ast, so that a change that breaks it
fails here rather than in a reviewer's head:
- every import is at the top of its file (none inside a function, a class or a branch), but for a
  heavy third-party library that the docstring names as "Imported only when needed" (the tokenizer
  loads torch and rustbpe only in the functions that use them: tests/test_tokenizer.py keeps its import
  light); a nanochat module is never imported late;
- no module imports another's underscore names, or reaches into one through an attribute;
- the imports between nanochat's modules form no cycle, and common.py imports none of them;
- each module's docstring says what it may import ("May import: ..."), and it imports no other
  nanochat module than those;
- dataloader.py composes stages and implements none: it defines no class, and stays short.

Run: python -m pytest tests/test_architecture.py -q
"""

import ast
import os
import re

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nanochat")
MODULES = sorted(name[:-3] for name in os.listdir(PACKAGE) if name.endswith(".py") and name != "__init__.py")


def parse(module: str) -> ast.Module:
    with open(os.path.join(PACKAGE, module + ".py"), encoding="utf-8") as f:
        return ast.parse(f.read())


def nanochat_imports(tree: ast.Module) -> dict[str, list[str]]:
    """nanochat module -> the names imported from it (["*module*"] for the module itself), at any depth."""
    found: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "nanochat":
            for alias in node.names:
                found.setdefault(alias.name, []).append("*module*")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nanochat."):
            found.setdefault(node.module.split(".")[1], []).extend(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nanochat."):
                    found.setdefault(alias.name.split(".")[1], []).append("*module*")
    return found


def test_the_package_has_the_modules_this_test_reads():
    assert {"dataloader", "readers", "stream", "tokens", "packing", "rows", "state", "state_checks", "elastic",
            "resume", "prefetch", "device", "token_shards", "pretokenize", "mixture"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_every_import_is_at_the_top(module):
    tree = parse(module)
    match = re.search(r"^Imported only when needed:(.*?)(?:\n\n|\Z)", ast.get_docstring(tree) or "", re.M | re.S)
    late_ok = set(re.findall(r"([\w.]+) \(", match.group(1))) if match else set()
    top = {id(node) for node in tree.body}
    hidden = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
            names = [node.module] if isinstance(node, ast.ImportFrom) else [alias.name for alias in node.names]
            if not all(name and not name.startswith("nanochat") and name in late_ok for name in names):
                hidden.append(f"{module}.py:{node.lineno} {names}")
    assert not hidden, f"imports inside a function, class or branch: {hidden}"


@pytest.mark.parametrize("module", MODULES)
def test_no_underscore_names_across_modules(module):
    tree = parse(module)
    private = [f"nanochat.{source}.{name}" for source, names in nanochat_imports(tree).items() for name in names
               if name.startswith("_")]
    assert not private, f"{module}.py imports private names: {private}"
    # a module imported whole (from nanochat import x / import nanochat.x as x) must not be reached into
    aliases = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "nanochat":
            aliases |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            aliases |= {alias.asname for alias in node.names if alias.name.startswith("nanochat.") and alias.asname}
    reached = [f"{module}.py:{node.lineno} {ast.unparse(node)}" for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
               and ((isinstance(node.value, ast.Name) and node.value.id in aliases)  # x._name
                    or ast.unparse(node.value).startswith("nanochat."))]  # nanochat.x._name
    assert not reached, f"private names reached through a module: {reached}"


def test_imports_flow_one_way():
    graph = {module: set(nanochat_imports(parse(module))) - {module} for module in MODULES}
    assert not graph["common"], "common.py is the ground floor: it imports no other nanochat module"
    unknown = {f"{module} -> {other}" for module, others in graph.items() for other in others if other not in graph}
    assert not unknown, f"imports of modules that do not exist: {sorted(unknown)}"
    # depth-first search; a module met again while it is on the path closes a cycle
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "on path"
        for other in sorted(graph[module]):
            if state.get(other) == "on path":
                cycle = path[path.index(other):] + [other]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if other not in state:
                visit(other, path + [other])
        state[module] = "done"

    for module in MODULES:
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("module", MODULES)
def test_each_module_says_what_it_may_import_and_keeps_to_it(module):
    tree = parse(module)
    doc = ast.get_docstring(tree) or ""
    match = re.search(r"^May import:(.*?)(?:\n\n|\Z)", doc, re.M | re.S)
    assert match, f"{module}.py: its docstring has no 'May import: ...' paragraph"
    allowed = set(re.findall(r"nanochat\.(\w+)", re.split(r"\bnever\b", match.group(1))[0]))  # "never x": not x
    used = set(nanochat_imports(tree)) - {module}
    assert used <= allowed, f"{module}.py imports {sorted(used - allowed)}, which its docstring does not allow"


def test_the_loaders_never_reach_up():
    """The stage modules never import the modules that compose them, and the resume state knows
    nothing of mixtures (the layering the docstrings state, checked once more as a whole)."""
    graph = {module: set(nanochat_imports(parse(module))) for module in MODULES}
    tops = {"dataloader", "mixture", "mixture_state", "curriculum", "pretokenize", "resume"}
    for module in ("readers", "stream", "tokens", "rows", "packing", "state", "state_checks", "elastic", "prefetch",
                   "device", "token_shards", "options", "files"):
        assert not graph[module] & tops, f"{module}.py imports {sorted(graph[module] & tops)}"
    mixtures = {"mixture", "mixture_state", "curriculum"}
    for module in ("state", "state_checks", "elastic"):  # the resume state knows nothing of mixtures
        assert not graph[module] & mixtures, f"{module}.py imports {sorted(graph[module] & mixtures)}"
    assert "dataloader" not in graph["mixture"] | graph["mixture_state"] | graph["curriculum"]


def test_dataloader_composes_and_stays_short():
    tree = parse("dataloader")
    classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    assert not classes, f"dataloader.py composes the stages; these classes belong in a stage module: {classes}"
    with open(os.path.join(PACKAGE, "dataloader.py"), encoding="utf-8") as f:
        lines = sum(1 for _ in f)
    assert lines < 300, f"dataloader.py has {lines} lines: move what it implements into the stage modules"


def readme_names() -> set[tuple[str, str]]:
    """(module, name) for every `from nanochat.x import a, b` and every `nanochat.x.NAME` in the README."""
    with open(os.path.join(os.path.dirname(PACKAGE), "README.md"), encoding="utf-8") as f:
        text = f.read()
    names = set()
    for module, imported in re.findall(r"^\s*from nanochat\.(\w+) import (\([^)]*\)|[^\n]*)", text, re.M):
        imported = re.sub(r"#[^\n]*", "", imported).strip("()")  # comments out, parentheses off
        for piece in imported.split(","):  # "name" or "name as alias"
            if piece.split():
                names.add((module, piece.split()[0]))
    names |= set(re.findall(r"`nanochat\.(\w+)\.([A-Za-z_]\w*)`", text))
    return names


def test_the_public_names_stay_where_the_readme_shows_them():
    names = readme_names()
    assert ("resume", "merge_states") in names and ("dataloader", "tokenizing_distributed_data_loader_with_state_bos_bestfit") in names
    missing = []
    for module, name in sorted(names):
        imported = __import__(f"nanochat.{module}", fromlist=[name])
        if not hasattr(imported, name):
            missing.append(f"nanochat.{module}.{name}")
    assert not missing, f"the README shows names that are not there: {missing}"
    import nanochat.dataloader
    import nanochat.pretokenize
    import nanochat.token_shards
    assert nanochat.pretokenize.TokenShard is nanochat.token_shards.TokenShard  # the README's older place for it
    assert hasattr(nanochat.dataloader, "EXIT_TIMEOUT")  # the README showed it here before the move
