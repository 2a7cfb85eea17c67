"""
The package's shape, read from the source with ast, so that a change that breaks it fails here and
not in a reviewer's head:
- imports: at the top of their file (a heavy library the docstring names as "Imported only when
  needed" excepted), no underscore names across modules, no cycles, only what each module's
  "May import: ..." line allows, the stages never reaching up to the modules that compose them;
- the folders: each stage folder of nanochat/data keeps to the "May import: ..." line of its
  __init__.py (lower floors only, and nanochat.common), nothing in nanochat/data imports the top of
  nanochat/, and the top holds only nanochat's three files, common.py and the fronts that the
  README and docs/ run or import from;
- the main path: at most 6 modules from the public loader to a yielded batch (7 with streaming),
  each named in docs/ARCHITECTURE.md's walk;
- habits: a README of at most 16 KB, docstrings that open with their job in one line, module
  docstrings of at most 15 lines, lines of at most 100 columns, at most 6 positional parameters for
  internal functions, one integer validator, no name imported only to be re-exported, no project
  history in the README, docs/ or the code, and markdown tables that render whole (no row cut off
  from its header).

Run: python -m pytest tests/test_architecture.py -q
"""

import ast
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "nanochat")
# every module of ours, dotted below nanochat: "dataloader", "data.loader.order", ...
MODULES = sorted(os.path.relpath(os.path.join(folder, name), PACKAGE)[:-3].replace(os.sep, ".")
                 for folder, _, names in os.walk(PACKAGE) for name in names
                 if name.endswith(".py") and name != "__init__.py")

# The main path, from tokenizing_distributed_data_loader_with_state_bos_bestfit to a yielded batch,
# in the order a reader walks it: the public loader and its checks, the builder, the walk, tokens to
# rows, the pure packer, the threads that run ahead
BY_LEAF = {module.rsplit(".", 1)[-1]: module for module in MODULES}  # "order": "data.loader.order"
MAIN_PATH = [BY_LEAF[leaf]
             for leaf in ("dataloader", "build", "order", "rows", "packing", "prefetch")]
STREAMING = [BY_LEAF["cache"]]  # what stream=True adds to the path
# what the path calls without a reader having to follow it: the integer check, file listing, the
# shuffled order, the state's format and its checks, the worker process that carries the same
# batches across and the processes that tokenize there, the pretokenized reader, streaming's
# helpers, the figures for a log
ASIDE = {BY_LEAF[leaf] for leaf in (
    "checks", "dataset", "datasets", "limits", "shuffle", "state", "state_checks",
    "worker", "tokenize_procs", "token_reader", "token_shards", "common", "files", "layout",
    "catalog", "kept", "ledger", "cache_status", "budget", "figures")}


def parse(module: str) -> ast.Module:
    with open(os.path.join(PACKAGE, *module.split(".")) + ".py", encoding="utf-8") as f:
        return ast.parse(f.read())


def read(relative: str) -> str:
    with open(os.path.join(REPO_ROOT, relative), encoding="utf-8") as f:
        return f.read()


def nanochat_imports(tree: ast.Module) -> dict[str, list[str]]:
    """nanochat module -> the names imported from it (["*module*"] for the module itself)."""
    found: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "nanochat":
            for alias in node.names:
                found.setdefault(alias.name, []).append("*module*")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nanochat."):
            package = node.module.split(".", 1)[1]
            for alias in node.names:  # from nanochat.data.fetch import download: a module
                if f"{package}.{alias.name}" in MODULES:
                    found.setdefault(f"{package}.{alias.name}", []).append("*module*")
                else:
                    found.setdefault(package, []).append(alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nanochat."):
                    found.setdefault(alias.name.split(".", 1)[1], []).append("*module*")
    return found


def names_imported_from_us(tree: ast.Module) -> set[str]:
    """The names a module binds by `from nanochat.x import name`."""
    return {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("nanochat.") for alias in node.names}


def may_import(doc: str) -> set[str] | None:
    """The project names, dotted below nanochat ("data.base", "common"), that a docstring's
    "May import: ..." paragraph allows; None when it has none. "never nanochat.x" names what it may
    not import."""
    match = re.search(r"^May import:(.*?)(?:\n\n|\Z)", doc, re.M | re.S)
    if not match:
        return None
    return set(re.findall(r"nanochat\.([\w.]*\w)", re.split(r"\bnever\b", match.group(1))[0]))


def allows(allowed: set[str], other: str) -> bool:
    """Whether a module or folder in `allowed` covers the module `other`."""
    return any(other == a or other.startswith(a + ".") for a in allowed)


# The fence: nanochat/data, a folder per stage; its __init__.py lists them, lowest floor first
DATA = os.path.join(PACKAGE, "data")
FOLDERS = sorted(name for name in os.listdir(DATA)
                 if os.path.isfile(os.path.join(DATA, name, "__init__.py")))
DATA_MODULES = [module for module in MODULES if module.startswith("data.")]
TOP = [module for module in MODULES if "." not in module]  # dataloader, common, pretokenize, ...
NANOCHATS = ["dataloader", "dataset", "tokenizer"]  # nanochat's three files, ours in a checkout


def folder_doc(folder: str) -> str:
    with open(os.path.join(DATA, folder, "__init__.py"), encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def folder_rule(folder: str) -> set[str]:
    """What a module of nanochat/data/<folder> may import: its own folder, the folders its
    __init__.py names, and nanochat.common."""
    return {f"data.{folder}", "common"} | (may_import(folder_doc(folder)) or set())


def folder_of(module: str) -> str | None:
    """"data.loader.order" -> "loader"; None for a module at the top of nanochat/."""
    return module.split(".")[1] if module.startswith("data.") else None


def test_the_package_has_the_modules_this_test_reads():
    assert {"state_checks", "elastic", "resume", "token_reader", "token_shards", "pretokenize",
            "mixture", "order", "rows", "packing", "state", "prefetch", "cache"} <= set(BY_LEAF)


# our modules that may be imported late: the store transports, where a store's address is met (they
# bring fsspec and a store's client, which a loader reading http or local files never needs), and
# the streaming cache's, for stream=True (they bring the downloader, which a loader over shards on
# disk never needs)
LATE_OURS = {"nanochat.data.fetch.stores", "nanochat.data.fetch.store_transport",
             "nanochat.data.streaming.budget", "nanochat.data.streaming.cache",
             "nanochat.data.streaming.catalog"}


@pytest.mark.parametrize("module", MODULES)
def test_every_import_is_at_the_top(module):
    tree = parse(module)
    match = re.search(r"^Imported only when needed:(.*?)(?:\n\n|\Z)", ast.get_docstring(tree) or "",
                      re.M | re.S)
    late_ok = set(re.findall(r"([\w.]+) \(", match.group(1))) if match else set()
    top = {id(node) for node in tree.body}
    hidden = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
            names = ([node.module] if isinstance(node, ast.ImportFrom)
                     else [alias.name for alias in node.names])
            if not all(name in late_ok and (not name.startswith("nanochat") or name in LATE_OURS)
                       for name in names):
                hidden.append(f"{module}.py:{node.lineno} {names}")
    assert not hidden, f"imports inside a function, class or branch: {hidden}"


@pytest.mark.parametrize("module", MODULES)
def test_no_underscore_names_across_modules(module):
    tree = parse(module)
    private = [f"nanochat.{source}.{name}" for source, names in nanochat_imports(tree).items()
               for name in names
               if name.startswith("_")]
    assert not private, f"{module}.py imports private names: {private}"
    # a module imported whole (from nanochat import x / import nanochat.x as x) is not reached into
    aliases = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "nanochat":
            aliases |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            aliases |= {alias.asname for alias in node.names
                        if alias.name.startswith("nanochat.") and alias.asname}
    reached = [f"{module}.py:{node.lineno} {ast.unparse(node)}" for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr.startswith("_")
               and not node.attr.startswith("__")
               and ((isinstance(node.value, ast.Name) and node.value.id in aliases)  # x._name
                    or ast.unparse(node.value).startswith("nanochat."))]  # nanochat.x._name
    assert not reached, f"private names reached through a module: {reached}"


def test_imports_flow_one_way():
    graph = {module: set(nanochat_imports(parse(module))) - {module} for module in MODULES}
    assert not graph["common"], "common.py is the ground floor: it imports no other nanochat module"
    unknown = {f"{module} -> {other}" for module, others in graph.items() for other in others
               if other not in graph}
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
    allowed = may_import(ast.get_docstring(tree) or "")
    if allowed is None:  # a module of nanochat/data without a line of its own: its folder's rule
        assert folder_of(module), f"{module}.py: its docstring has no 'May import: ...' paragraph"
        allowed = folder_rule(folder_of(module))
    used = {other for other in set(nanochat_imports(tree)) - {module} if not allows(allowed, other)}
    assert not used, f"{module}.py imports {sorted(used)}, which its docstring does not allow"


def test_the_loaders_never_reach_up():
    """The stage modules never import the modules that compose them, and the resume state knows
    nothing of mixtures (the layering the docstrings state, checked once more as a whole)."""
    graph = {module: set(nanochat_imports(parse(module))) for module in MODULES}
    tops = {BY_LEAF[leaf] for leaf in ("dataloader", "mixture", "mixture_state", "curriculum",
                                       "pretokenize", "resume")}
    for module in map(BY_LEAF.get, ("order", "token_reader", "rows", "packing", "state",
                                    "state_checks", "elastic", "prefetch", "token_shards",
                                    "build", "worker", "files", "checks")):
        assert not graph[module] & tops, f"{module}.py imports {sorted(graph[module] & tops)}"
    mixtures = {BY_LEAF[leaf] for leaf in ("mixture", "mixture_state", "curriculum")}
    # none knows of mixtures
    for module in map(BY_LEAF.get, ("state", "state_checks", "elastic", "dataloader")):
        found = sorted(graph[module] & mixtures)
        assert not found, f"{module}.py imports {found}"


# -----------------------------------------------------------------------------
# The folders: one per stage, lowest floor first, fenced from the top of nanochat/

def floors() -> list[str]:
    """The stage folders in the order nanochat/data/__init__.py lists them, lowest floor first."""
    with open(os.path.join(DATA, "__init__.py"), encoding="utf-8") as f:
        return re.findall(r"^    (\w+)/ ", ast.get_docstring(ast.parse(f.read())) or "", re.M)


def test_the_fence_lists_each_folder_once_lowest_floor_first():
    order = floors()
    assert sorted(order) == FOLDERS and len(set(order)) == len(order), (
        f"nanochat/data/__init__.py lists the folders {order}; there are {FOLDERS}")
    loose = sorted(name for name in os.listdir(DATA)
                   if name.endswith(".py") and name != "__init__.py")
    assert not loose, f"modules loose in nanochat/data (each goes in a stage's folder): {loose}"


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_folder_says_what_it_does_and_names_only_lower_floors(folder):
    doc, path = folder_doc(folder), f"nanochat/data/{folder}/__init__.py"
    assert 0 < len(doc.splitlines()) <= 8, f"{path}: say in a few lines what the stage does"
    named = may_import(doc)
    assert named is not None, f"{path}: its docstring has no 'May import: ...' paragraph"
    order = floors()
    assert folder in order, f"nanochat/data/__init__.py does not list {folder}/"
    lower = {f"data.{other}" for other in order[:order.index(folder)]}
    higher = sorted(named - lower - {"common"})
    assert not higher, (f"{path} allows {higher}: a folder imports only the floors below it, "
                        f"{sorted(lower)}, and nanochat.common")


@pytest.mark.parametrize("module", DATA_MODULES)
def test_each_module_keeps_to_its_folders_rule(module):
    """A module of nanochat/data/<folder> imports, and its own "May import" line names, only its
    folder, the folders its __init__.py names, and nanochat.common (the top of nanochat/ has a test
    of its own, below)."""
    tree, folder = parse(module), folder_of(module)
    named = may_import(ast.get_docstring(tree) or "") or set()
    rule = folder_rule(folder)
    outside = sorted(other for other in set(nanochat_imports(tree)) | named
                     if (other == "data" or other.startswith("data.")) and not allows(rule, other))
    assert not outside, (f"{module}.py imports or allows {outside}; nanochat/data/{folder}/"
                         f"__init__.py allows {sorted(rule)}")


def test_nothing_in_the_fence_imports_the_top_of_nanochat():
    """nanochat's three files and the fronts import the fence, never the other way: a nanochat
    checkout holds only nanochat's three files and data/ of ours (its common.py is nanochat's)."""
    tops = set(TOP) - {"common"}
    found = []
    for module in DATA_MODULES:
        tree = parse(module)
        named = may_import(ast.get_docstring(tree) or "") or set()
        found += [f"{module}.py imports nanochat.{other}"
                  for other in sorted(nanochat_imports(tree)) if other.split(".")[0] in tops]
        found += [f"{module}.py allows nanochat.{other}" for other in sorted(named)
                  if other.split(".")[0] in tops]
    assert not found, f"the fence reaches up to the top of nanochat/: {found}"


def documented_fronts() -> set[str]:
    """The modules at the top of nanochat/ that README.md and docs/ run (python -m nanochat.X) or
    import from (from nanochat.X import ...)."""
    pages = ["README.md"] + [os.path.join("docs", name)
                             for name in sorted(os.listdir(os.path.join(REPO_ROOT, "docs")))
                             if name.endswith(".md")]
    pattern = r"(?:python -m |from |import )nanochat\.([a-z_]+)\b(?!\.)"  # (not nanochat.X)
    return {name for page in pages for name in re.findall(pattern, read(page))}


def test_the_top_of_nanochat_holds_nanochats_files_common_and_the_fronts():
    fronts = documented_fronts()
    assert {"dataloader", "pretokenize", "shard_cache"} <= fronts  # (the pattern finds them)
    gone = sorted(fronts - set(TOP))
    assert not gone, f"README.md or docs/ run or import {gone}, not at the top of nanochat/"
    allowed = ({f"{name}.py" for name in {*NANOCHATS, "common", *fronts}}
               | {"__init__.py", "data", "__pycache__"})
    extra = sorted(set(os.listdir(PACKAGE)) - allowed)
    assert not extra, (f"nanochat/ holds {extra}: its top holds nanochat's three files, common.py "
                       "and the fronts the README or docs/ run or import from; a stage's module "
                       "goes in a folder of nanochat/data")


def test_nanochats_files_need_nothing_but_the_drop_in():
    """A nanochat checkout gets nanochat's three files and data/ of ours (the README's one cp): what
    they import lies there, or in nanochat's own common.py, never in a front."""
    ours = {*NANOCHATS, "common", "data"}
    found = [f"{module}.py imports nanochat.{other}" for module in NANOCHATS
             for other in sorted(nanochat_imports(parse(module)))
             if other.split(".")[0] not in ours]
    assert not found, f"nanochat's files import what the drop-in does not copy: {found}"


def test_importing_the_loader_loads_its_path_and_no_other_stage():
    """`import nanochat.dataloader`, in a fresh interpreter, loads the main path and what it needs,
    but no pretokenizing, mixtures, repackaging, nor the streaming cache with its downloader (they
    load at a stream=True call) or the store transports and fsspec (where a store's address is
    met)."""
    code = "import sys, nanochat.dataloader; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120, check=True).stdout.split()
    assert {"nanochat.data.loader.build", "nanochat.data.loader.order", "nanochat.data.loader.rows",
            "nanochat.data.base.packing", "nanochat.data.loader.worker"} <= set(loaded)
    unwanted = [name for name in loaded
                if name.startswith(("nanochat.data.processing", "nanochat.data.mixtures",
                                    "nanochat.data.streaming", "fsspec"))
                or name in {"nanochat.pretokenize", "nanochat.mixture",
                            "nanochat.data.fetch.repackage", "nanochat.data.fetch.stores",
                            "nanochat.data.fetch.store_transport", "nanochat.data.fetch.download",
                            "nanochat.data.fetch.http_transport"}]
    assert not unwanted, f"import nanochat.dataloader loads {unwanted}"


def test_the_readme_shows_the_one_copy_the_drop_in_check_makes():
    tree = ast.parse(read(os.path.join("scripts", "nanochat_dropin.py")))
    copied = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                  and [ast.unparse(target) for target in node.targets] == ["DROP_IN"])
    assert sorted(copied) == sorted([f"{name}.py" for name in NANOCHATS] + ["data"])
    line = "cp -r " + " ".join(f"nanochat/{name}" for name in copied) + " NANOCHAT/nanochat/"
    assert line in read("README.md"), f"README.md does not show the drop-in's copy: {line}"


def test_the_main_path_is_a_few_rooms_named_in_the_walk():
    assert len(MAIN_PATH) <= 6 and len(MAIN_PATH + STREAMING) <= 7
    for module in MAIN_PATH:
        others = (set(nanochat_imports(parse(module))) - set(MAIN_PATH + STREAMING) - ASIDE
                  - {module})
        assert not others, (f"{module}.py takes the main path through {sorted(others)}: a new "
                            "room on the path, or a helper to list in ASIDE")
    text = read(os.path.join("docs", "ARCHITECTURE.md"))
    assert "## The main path" in text, "docs/ARCHITECTURE.md has no '## The main path' section"
    walk = text[text.index("## The main path"):]
    unnamed = [module for module in MAIN_PATH + STREAMING
               if f"`{module.rsplit('.', 1)[-1]}.py`" not in walk]
    assert not unnamed, f"docs/ARCHITECTURE.md's walk of the main path does not name {unnamed}"


def readme_names() -> set[tuple[str, str]]:
    """(module, name) for every `from nanochat.x import a, b` and every `nanochat.x.NAME` in the
    README."""
    with open(os.path.join(os.path.dirname(PACKAGE), "README.md"), encoding="utf-8") as f:
        text = f.read()
    names = set()
    pattern = r"^\s*from nanochat\.(\w+) import (\([^)]*\)|[^\n]*)"
    for module, imported in re.findall(pattern, text, re.M):
        imported = re.sub(r"#[^\n]*", "", imported).strip("()")  # comments out, parentheses off
        for piece in imported.split(","):  # "name" or "name as alias"
            if piece.split():
                names.add((module, piece.split()[0]))
    names |= set(re.findall(r"`nanochat\.(\w+)\.([A-Za-z_]\w*)`", text))
    return names


def test_the_public_names_stay_where_the_readme_shows_them():
    names = readme_names()
    assert ("resume", "merge_states") in names
    assert ("dataloader", "tokenizing_distributed_data_loader_with_state_bos_bestfit") in names
    missing = []
    for module, name in sorted(names):
        imported = __import__(f"nanochat.{module}", fromlist=[name])
        if not hasattr(imported, name):
            missing.append(f"nanochat.{module}.{name}")
    assert not missing, f"the README shows names that are not there: {missing}"
    # shown where they are defined, never at a module that only imports them
    elsewhere = [f"nanochat.{module}.{name}" for module, name in sorted(names)
                 if name in names_imported_from_us(parse(module))]
    assert not elsewhere, f"the README shows these names where they are only imported: {elsewhere}"


@pytest.mark.parametrize("module", MODULES)
def test_no_name_is_imported_only_to_be_shown_here(module):
    """A name imported from another module of ours is used here, not kept for the docs."""
    tree = parse(module)
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    unused = sorted(names_imported_from_us(tree) - used)
    assert not unused, f"{module}.py imports {unused} from our modules without using them"


# -----------------------------------------------------------------------------
# Habits a reader relies on

SOURCES = sorted(os.path.relpath(os.path.join(folder, name), REPO_ROOT)
                 for top in ("nanochat", "scripts", "tests")
                 for folder, _, names in os.walk(os.path.join(REPO_ROOT, top))
                 for name in names if name.endswith(".py"))
# words about the project's past, and the names of modules, classes and files that are gone
HISTORY = re.compile(r"(?i:\bseeds'|\bthe seeds\b|\bseed 00\d|before that change|\bpreviously\b|"
                     r"\bold (logger|module|name|place)|before the move|\bused to be\b)|"
                     r"\b(Tracker|ShardDocs|RowGroupIndex|start_stream|stream_config)\b|"
                     r"nanochat[./](readers|stream|tokens|device)\b|needs-\*|fetched\.json")
# public functions whose positional parameters are a documented contract
PUBLIC_SIGNATURES: set[str] = set()


def test_the_readme_is_at_most_16_kb():
    size = len(read("README.md").encode())
    assert size <= 16 * 1024, f"README.md is {size:,} bytes: move the depth to a page in docs/"


def _cells(row: str) -> int:
    """The cells of a markdown table row: its unescaped pipes, less one (GitHub splits a row at
    every unescaped pipe, inside backticks too)."""
    return len(re.findall(r"(?<!\\)\|", row.strip())) - 1


@pytest.mark.parametrize("path", ["README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(REPO_ROOT, "docs"))
    if name.endswith(".md")))
def test_markdown_tables_render_whole(path):
    """Each run of table rows starts with a header and its `| --- |` line, and every row has the
    header's cells: a row cut off from its table (a paragraph between) renders as stray text."""
    broken, block, fenced = [], [], False
    for n, line in enumerate(read(path).splitlines() + [""], 1):
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("|"):
            block.append((n, line))
            continue
        if block:
            header = _cells(block[0][1])
            if len(block) < 2 or not re.fullmatch(r"\|( *:?-{3,}:? *\|)+", block[1][1].strip()):
                broken.append(f"{path}:{block[0][0]}: rows without a header and its | --- | line")
            broken += [f"{path}:{k}: {_cells(row)} cells, the header has {header}"
                       for k, row in block if _cells(row) != header]
            block = []
    assert not broken, f"tables that do not render as one table: {broken}"


@pytest.mark.parametrize("module", MODULES)
def test_module_docstrings_are_at_most_15_lines(module):
    lines = (ast.get_docstring(parse(module)) or "").splitlines()
    assert len(lines) <= 15, f"{module}.py's docstring has {len(lines)} lines: design goes to docs/"


@pytest.mark.parametrize("path", [path for path in SOURCES if path.startswith("nanochat")])
def test_each_docstring_opens_with_its_job_in_one_line(path):
    lines = (ast.get_docstring(ast.parse(read(path))) or "").splitlines()
    first = lines[0] if lines else ""
    assert first, f"{path} has no docstring: say what it does"
    assert len(first) <= 100 and first.endswith((".", "!", "?")), (
        f"{path}'s docstring opens with {first!r}: say its job in one sentence of one line (at "
        "most 100 columns), then the rest")


@pytest.mark.parametrize("path", SOURCES)
def test_lines_are_at_most_100_columns(path):
    long = [f"{path}:{n}" for n, line in enumerate(read(path).splitlines(), 1) if len(line) > 100]
    assert not long, f"lines over 100 columns: {long[:10]} ({len(long)} in all)"


@pytest.mark.parametrize("module", MODULES)
def test_internal_functions_take_at_most_6_positional_parameters(module):
    wide = []
    for node in ast.walk(parse(module)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name.endswith("_bos_bestfit") or node.name.endswith("_data_loader_with_state") \
                or node.name in PUBLIC_SIGNATURES:
            continue  # nanochat's loader signatures, and the documented ones
        names = [a.arg for a in node.args.posonlyargs + node.args.args
                 if a.arg not in ("self", "cls")]
        if len(names) > 6:
            wide.append(f"{module}.py:{node.lineno} {node.name}({', '.join(names)})")
    assert not wide, f"more than 6 positional parameters (pass a record, or keyword-only): {wide}"


def test_one_integer_validator():
    """Integer checks go through nanochat.data.base.checks (is_int, check_int): no module writes
    its own."""
    own = re.compile(r"isinstance\([^)]*\bbool\b")
    paths = [os.path.join("nanochat", *module.split(".")) + ".py" for module in MODULES
             if module != BY_LEAF["checks"]]
    found = [f"{path}:{n}" for path in paths for n, line in enumerate(read(path).splitlines(), 1)
             if own.search(line) and "int" in line and "float" not in line]  # numbers may be floats
    assert not found, f"hand-written integer checks (use nanochat.data.base.checks): {found}"


@pytest.mark.parametrize("path", [p for p in SOURCES if not p.startswith("nanochat")])
def test_scripts_and_tests_import_names_that_exist(path):
    """A script or test that imports a name our modules no longer have fails here, not at run time
    (a benchmark is run by hand; a test may import inside a function)."""
    missing = []
    for node in ast.walk(ast.parse(read(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nanochat"):
            module = __import__(node.module, fromlist=["*"])
            missing += [f"{node.module}.{alias.name}" for alias in node.names
                        if not hasattr(module, alias.name)
                        and not os.path.exists(os.path.join(REPO_ROOT, *node.module.split("."),
                                                            alias.name + ".py"))]
        elif isinstance(node, ast.Import):
            missing += [alias.name for alias in node.names if alias.name.startswith("nanochat.")
                        and not os.path.exists(os.path.join(REPO_ROOT, *alias.name.split("."))
                                               + ".py")]
    assert not missing, f"{path} imports what is not there: {missing}"


def test_no_project_history_in_the_readme_docs_or_code():
    pages = [os.path.join("docs", name) for name in os.listdir(os.path.join(REPO_ROOT, "docs"))]
    this = os.path.join("tests", "test_architecture.py")  # (it spells out the words it looks for)
    found = [f"{path}:{n}: {line.strip()[:80]}" for path in ["README.md"] + pages + SOURCES
             if path != this
             for n, line in enumerate(read(path).splitlines(), 1) if HISTORY.search(line)]
    assert not found, f"project history a reader cannot look up: {found[:10]}"
