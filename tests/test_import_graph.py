"""The packages' modules (flash_dmattn, benchmarks) import each other in one direction: no
import circles.

Every import counts, at module top or inside a function (a circle closed by a lazy import still
ties the two modules together), except those under ``if TYPE_CHECKING:``. Importing a
submodule imports its parent packages first, so an edge to ``a.b.c`` is also one to ``a.b``
(unless the importer lives inside ``a.b`` already).
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules(package: str):
    """``{dotted name: (path, is_package)}`` of every module under ``package``."""
    mods = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def _type_checking_nodes(tree):
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) \
                == "TYPE_CHECKING":
            for stmt in node.body:
                skip.update(id(n) for n in ast.walk(stmt))
    return skip


def _imports(name, path, is_pkg, mods):
    """The package modules that ``name`` imports."""
    def known(dotted):  # the longest prefix that is one of the package's modules
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    here = name if is_pkg else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets.update(known(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                targets.add(full if full in mods else known(source))
    targets.discard(None)
    targets.discard(name)
    own_parents = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
    for target in list(targets):
        parent = target
        while "." in parent:
            parent = parent.rpartition(".")[0]
            if parent in mods and parent not in own_parents and parent != name:
                targets.add(parent)
    return targets


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _graph(package):
    mods = _modules(package)
    return {name: _imports(name, path, is_pkg, mods) for name, (path, is_pkg) in mods.items()}


def test_the_cycle_finder_sees_lazy_and_parent_package_imports():
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": set(), "q": {"q.x"}, "q.x": {"q"}}
    assert _cycles(graph) == [["q", "q.x"]]


def _assert_no_cycles(package, some_module):
    graph = _graph(package)
    assert some_module in graph  # the walk found the package
    cycles = _cycles(graph)
    detail = "\n".join(
        " <-> ".join(c) + "\n" + "\n".join(f"    {a} -> {b}" for a in c for b in sorted(graph[a])
                                            if b in c)
        for c in cycles)
    assert not cycles, f"import cycles:\n{detail}"


def test_flash_dmattn_has_no_import_cycles():
    _assert_no_cycles("flash_dmattn", "flash_dmattn.planning.tiles")


def test_benchmarks_have_no_import_cycles():
    _assert_no_cycles("benchmarks", "benchmarks.measure")


def test_the_planner_imports_no_backend():
    graph = _graph("flash_dmattn")
    bad = {(a, b) for a, deps in graph.items() if a.startswith("flash_dmattn.planning")
           for b in deps if b.startswith("flash_dmattn.backends")}
    assert not bad, sorted(bad)


def test_the_cuda_backend_imports_the_planner_not_the_triton_backend():
    graph = _graph("flash_dmattn")
    bad = {(a, b) for a, deps in graph.items() if a.startswith("flash_dmattn.backends.cuda")
           for b in deps if b.startswith("flash_dmattn.backends.triton")}
    assert not bad, sorted(bad)
