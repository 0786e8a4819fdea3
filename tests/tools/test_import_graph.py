"""No import cycle between openmla's modules (issue 21): the module-level imports of mla/, quant/,
kernels/ and tools/, read statically (imports inside functions run later and do not count; a
package importing its own submodules is not a cycle)."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPS = ("mla", "quant", "kernels", "tools")


def _modules() -> dict:
    mods = {}
    for top in TOPS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            if "__pycache__" in dirpath:
                continue
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                    mods["openmla." + rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return mods


def _module_level_imports(tree):
    """Import nodes outside function bodies."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict:
    mods = _modules()
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        pkg = m if path.endswith("__init__.py") else m.rsplit(".", 1)[0]
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in _module_level_imports(tree):
            if isinstance(node, ast.ImportFrom):
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                target = (base + ("." + node.module if node.module else "")) if node.level else (node.module or "")
                for alias in node.names:
                    for cand in (f"{target}.{alias.name}", target):
                        if cand in mods:
                            edges[m].add(cand)
                            break
            else:
                edges[m].update(a.name for a in node.names if a.name in mods)
    return edges


def find_cycles(edges: dict) -> list:
    state, cycles = {}, []

    def visit(u, path):
        state[u] = "open"
        path.append(u)
        for v in sorted(edges[u]):
            if v.startswith(u + "."):  # a package importing its own submodule
                continue
            if state.get(v) == "open":
                cycles.append(path[path.index(v):] + [v])
            elif v not in state:
                visit(v, path)
        path.pop()
        state[u] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    return cycles


def test_no_import_cycle():
    edges = import_graph()
    assert len(edges) > 50 and "openmla.quant.mla_formats" in edges["openmla.quant.formats"]
    cycles = find_cycles(edges)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"p": {"p.x"}, "p.x": {"p"}}) == []  # package <-> its submodule
