"""The layers memfit keeps (docs/architecture.md): read every module's imports, function-level
ones included (``TYPE_CHECKING`` blocks aside), and fail on an import circle or on a module that
imports a higher layer. ``KNOWN`` would list violations left from before (none are left);
the test fails on any new one, and on a listed one that is gone, so that the list only shrinks."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "memfit"

# lowest first; a module may import its own layer's modules and the layers below
LAYERS = [
    # records, formats and names: no torch model needed
    ["memfit.errors", "memfit.budget", "memfit.jsonio", "memfit.console", "memfit.devices", "memfit.policy",
     "memfit.trainstep", "memfit.formats", "memfit.measure.malloc", "memfit.planning"],
    # the measuring floor (the training step, meters, timing), cutting a model into units, the
    # private PyTorch symbols memfit uses (torch_private.py), and the optimizer, which needs
    # neither torch nor a model
    ["memfit.measure", "memfit.units", "memfit.planning.", "memfit.torch_private"],
    # applying options to a model: what the profiler measures with and what apply() installs
    ["memfit.runtime"],
    # measuring a model's options
    ["memfit.profiler"],
    # what runs whole steps of a scheduled model: validate, compiled planning, ranks, pipeline stages
    ["memfit.steps"],
    # scenarios (and the user factories they import), tables and pictures
    ["memfit.scenarios", "memfit.factories", "memfit.zoo", "memfit.report", "memfit.plots", "memfit.lengths"],
    # the command line (the package memfit.cli: parser, commands, model flags) and the package's
    # front door: memfit.fit and its cache, the trainers' callbacks; memfit.hf is here because it
    # is both the HF scenarios' models (which scenarios load by name, not by import) and the home
    # of memfit.hf.MemfitCallback
    ["memfit.cli", "memfit.integrations", "memfit.fitting", "memfit.cache", "memfit.hf", "memfit"],
]

# (importer, imported): violations left from before; remove an entry when its import goes
KNOWN: set[tuple[str, str]] = set()


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    best, rank = -1, -1
    for k, prefixes in enumerate(LAYERS):
        for p in prefixes:
            hit = module == p.rstrip(".") if not p.endswith(".") else module.startswith(p)
            hit = hit or (not p.endswith(".") and module.startswith(p + "."))
            if hit and len(p) > best:
                best, rank = len(p), k
    assert rank >= 0, f"{module} has no layer in tests/test_layers.py"
    return rank


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        guarded = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
        skip = {id(n) for node in guarded for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                while t not in modules and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in modules and t != module and t != "memfit":
                    edges[module].add(t)
    return edges


def _violations() -> tuple[set[tuple[str, str]], list[list[str]]]:
    modules = {_name(p): p for p in ROOT.rglob("*.py")}
    edges = _imports(modules)
    upward = {(a, b) for a, bs in edges.items() for b in bs if _layer(b) > _layer(a)}
    # circles: strongly connected components of more than one module (Tarjan)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    in_circles = {(a, b) for c in circles for a in c for b in edges[a] if b in c}
    return upward | in_circles, circles


def test_no_new_upward_import_or_circle():
    found, circles = _violations()
    new = found - KNOWN
    assert not new, f"imports against the layers or in a circle: {sorted(new)} (circles: {circles})"
    gone = KNOWN - found
    assert not gone, f"these known violations are gone; remove them from KNOWN: {sorted(gone)}"


def test_private_torch_symbols_are_imported_in_one_module():
    """``torch_private.py`` is the one module that reaches into PyTorch's private names; every
    other module asks it (grep for the private paths memfit has used)."""
    private = ("torch.utils._python_dispatch", "torch.utils._pytree", "torch._subclasses", "torch.testing._internal",
               "_checkpoint_without_reentrant_generator", "batchnorm._BatchNorm", "._schema", "torch._C._autograd",
               "torch._dynamo.", "torch._C._Exclude", "._destroy(")
    for path in ROOT.rglob("*.py"):
        if path.name == "torch_private.py":
            continue
        code = "\n".join(line for line in path.read_text().splitlines()
                         if not line.lstrip().startswith("#") and "``" not in line and not line.strip().startswith('"'))
        assert not [p for p in private if p in code], (path, [p for p in private if p in code])


def test_the_policy_grammar_is_spelled_in_one_module():
    """Only memfit/policy.py writes a policy's kind into a string (docstrings aside): everything
    else builds and reads policies through its types."""
    kinds = ("child:", "nested:", "segment:", "selective:")
    for path in ROOT.rglob("*.py"):
        if path.name == "policy.py":
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        spelled = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                   and id(n) not in docs and any(k in n.value for k in kinds)]
        assert not spelled, (path, spelled)


# where text becomes policies: the files' loaders, the command line, and memfit.predict (whose
# users may spell a policy as a schedule file does); everything inside carries policy values
POLICY_BORDERS = ("memfit.formats.", "memfit.cli.", "memfit.planning.peak")  # and the front door's export


def test_policies_are_parsed_only_at_the_borders():
    parsers = {"parse", "read", "as_policies"}
    for path in ROOT.rglob("*.py"):
        module = _name(path)
        if module in ("memfit.policy", "memfit") or module.startswith(POLICY_BORDERS):  # memfit: re-exports parse
            continue
        tree = ast.parse(path.read_text())
        used = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "memfit.policy"
                for a in n.names if a.name in parsers]
        used += [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in parsers
                 and isinstance(n.value, ast.Name) and n.value.id == "policy"]
        assert not used, (module, used)
