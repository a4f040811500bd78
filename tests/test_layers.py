"""The folders are layers, and a dependency never points up one: the pure engine's parts
(model, pack, speculative decoding, policy, engine) under the Ray/Serve layer
(deployments: actors, then the replica, router and app), under the benchmarks and ops tools,
under the command line and the scripts. Inside the model layer, reading a checkpoint sits
under the weight formats, which sit under running a step. Checked on every import
statement, including the ones inside functions (a lazy import is still a dependency);
imports under `if TYPE_CHECKING:` are type hints only and count for the direction but not
for cycles."""

from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec", "deployments", "specdec_bench", "specdec_tools", "specdec_cli", "scripts")

# (module prefix, rank): the longest prefix names a module's layer. A module may import
# its own layer and any layer of a lower rank; layers of one rank are siblings and may not
# import each other.
LAYERS = [
    ("specdec", 0),               # specdec.errors, specdec.ports, specdec.progress
    ("specdec.model", 1),
    ("specdec.model.checkpoint", 1.1),  # config, GGUF and safetensors readers, the file's blocks
    ("specdec.model.formats", 1.2),     # weight formats, their linears and kernels
    ("specdec.model.step", 1.3),        # decoder, batch, KV slots, static step, sampling
    ("specdec.pack", 2),          # model references, the offline pack, tokenizers
    ("specdec.spec_decode", 3),   # rejection, proposers, overlap, the wire
    ("specdec.policy", 4),        # when to speculate and with which k
    ("specdec.engine", 5),        # continuous batching, the engine's spec, assembly
    ("deployments.actors", 6),    # Ray actors: shards, groups, target, draft
    ("deployments", 7),           # Serve: the engine replica, the router, the app
    ("specdec_bench", 8),
    ("specdec_tools", 8),
    ("specdec_cli", 9),
    ("scripts", 10),              # one-off checks, e.g. on a GPU machine
]


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = p
    return out


def _layer(module: str) -> tuple[str, int]:
    best = max((p for p in LAYERS if module == p[0] or module.startswith(p[0] + ".")),
               key=lambda p: len(p[0]))
    return best


class _Imports(ast.NodeVisitor):
    """Every imported module, and whether it sits under `if TYPE_CHECKING:`."""

    def __init__(self) -> None:
        self.found: list[tuple[str, int, bool]] = []
        self._typing = 0

    def visit_If(self, node: ast.If) -> None:
        typing_only = isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        self._typing += typing_only
        for child in node.body:
            self.visit(child)
        self._typing -= typing_only
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [(a.name, node.lineno, bool(self._typing)) for a in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.level == 0:
            self.found += [(f"{node.module}.{a.name}", node.lineno, bool(self._typing))
                           for a in node.names]
            self.found.append((node.module, node.lineno, bool(self._typing)))


def _graph():
    modules = _modules()
    edges: dict[str, list[tuple[str, int, bool]]] = collections.defaultdict(list)
    for name, path in modules.items():
        visitor = _Imports()
        visitor.visit(ast.parse(path.read_text()))
        for target, line, typing_only in visitor.found:
            if target.split(".")[0] not in PACKAGES:
                continue
            while target not in modules and "." in target:  # a name inside a module
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                edges[name].append((target, line, typing_only))
    return modules, edges


def test_no_import_points_up_a_layer():
    modules, edges = _graph()
    wrong = []
    for src, targets in edges.items():
        src_layer = _layer(src)
        for dst, line, _ in targets:
            dst_layer = _layer(dst)
            if dst_layer != src_layer and dst_layer[1] >= src_layer[1]:
                wrong.append(f"{modules[src].relative_to(ROOT)}:{line} imports {dst} "
                             f"(layer {dst_layer[0]} is not below {src_layer[0]})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    modules, edges = _graph()
    graph = {m: sorted({d for d, _, typing_only in edges.get(m, []) if not typing_only})
             for m in modules}
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def strongly_connected(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongly_connected(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            strongly_connected(m)
    assert not cycles, f"import cycles: {cycles}"


def test_the_pure_engine_never_imports_ray():
    modules, _ = _graph()
    offenders = []
    for name, path in modules.items():
        if name != "specdec" and not name.startswith("specdec."):
            continue
        visitor = _Imports()
        visitor.visit(ast.parse(path.read_text()))
        offenders += [f"{path.relative_to(ROOT)}:{line}" for target, line, _ in visitor.found
                      if target == "ray" or target.startswith("ray.")]
    assert not offenders, offenders


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The checker itself can fail: a model-layer module importing the engine is caught."""
    fake = tmp_path / "specdec" / "model"
    fake.mkdir(parents=True)
    (tmp_path / "specdec" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "bad.py").write_text("def f():\n    from specdec.engine.engine import Engine\n")
    engine = tmp_path / "specdec" / "engine"
    engine.mkdir()
    (engine / "__init__.py").write_text("")
    (engine / "engine.py").write_text("from specdec.model import bad\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    modules, edges = _graph()
    assert ("specdec.engine.engine", 2, False) in edges["specdec.model.bad"]
    try:
        test_no_import_points_up_a_layer()
    except AssertionError as exc:
        assert "specdec/model/bad.py:2 imports specdec.engine.engine" in str(exc)
    else:
        raise AssertionError("an upward import went unnoticed")
    try:
        test_no_import_cycles()
    except AssertionError as exc:
        assert "specdec.engine.engine" in str(exc) and "specdec.model.bad" in str(exc)
    else:
        raise AssertionError("an import cycle went unnoticed")


def test_installed_packages_carry_the_projects_names():
    """`pip install` puts each listed package at the top of site-packages: a generic name
    (`cli`, `tools`, `benchmarks`) would collide with anyone else's. The design card's two
    (`specdec`, `deployments`) and `specdec_*` only, and every package in the checkout is
    installed (the `specdec` command imports the CLI, the CLI imports the benchmarks)."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["packages"]["find"]["include"]
    listed = {pattern.removesuffix("*") for pattern in include}
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert listed == on_disk, (listed, on_disk)
    for name in listed:
        assert name in ("specdec", "deployments") or name.startswith("specdec_"), name
