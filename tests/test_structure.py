"""The package's dependency rules, read from the source (nothing is imported or run):

- the production loaders (graph_runtime/loading/) never import the toy models (graph_runtime/tiny.py): tiny builds on
  loading, never the reverse, so a real checkpoint's load cannot depend on test scaffolding;
- the runtime (graph_runtime/, comfy_interop included: it speaks ComfyUI's data formats) imports no ComfyUI module,
  so it runs where ComfyUI is absent (the CLI, the benchmarks, CPU tests);
- the benchmarks (bench/) are the repository's lab, not part of what is installed: graph_runtime/, nodes/ and the
  pack's entry point never import them, and the package list the build reads from pyproject.toml leaves them out;
- nodes/ stays ComfyUI glue: it defines no function or class under a name a runtime module defines too (a second
  copy of a runtime function drifts from the first), repeats no runtime function's body, and words no byte sizes
  itself (2**20 / 2**30 arithmetic: sizes are worded by graph_runtime/report.py and memory.gib);
- nodes/ holds nodes, and the glue only ComfyUI needs sits in one subpackage beside them: every module directly in
  nodes/ defines a node of the pack's node list (nodes/extension.py), and every module of nodes/comfyui/ imports
  ComfyUI itself, so logic that needs no ComfyUI lives in graph_runtime/ rather than settling there;
- graph_runtime/ and nodes/ have no import cycle, and no module keeps state in `sys.modules` or on another object.
"""

import ast
from pathlib import Path

# Top-level modules that exist only inside a ComfyUI process.
COMFYUI_MODULES = ("comfy", "comfy_api", "comfy_execution", "comfy_extras", "folder_paths", "server", "nodes",
                   "execution", "latent_preview", "node_helpers")

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "graph_runtime"
NODES = ROOT / "nodes"
GLUE = NODES / "comfyui"


def package_of(path: Path) -> str:
    """The package the module at `path` is in (for a package's __init__.py: that package)."""
    if path.name == "__init__.py":
        return ".".join(path.relative_to(ROOT).parts[:-1])
    return ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])


def absolute_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module a `from ... import` statement in `package` imports from."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[:len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(path: Path, package: str | None = None) -> set[str]:
    """Every module `path` imports, anywhere in it (function-level imports included), as an absolute dotted name.
    `package`: the package `path` is in (default: read off its place under the repository root)."""
    package = package_of(path) if package is None else package
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = absolute_module(node, package)
            found.add(module)
            # `from .. import tiny` names the module in the imported names.
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_imported_modules_resolves_relative_imports():
    """The helper itself: a relative import two levels up resolves to the absolute module it names."""
    modules = imported_modules(RUNTIME / "loading" / "processor.py")
    assert "graph_runtime.errors" in modules  # `from ..errors import CheckpointError`


def test_loading_imports_nothing_from_tiny():
    offenders = {}
    for path in sorted((RUNTIME / "loading").rglob("*.py")):
        hits = sorted(m for m in imported_modules(path) if m == "graph_runtime.tiny"
                      or m.startswith("graph_runtime.tiny."))
        if hits:
            offenders[str(path.relative_to(ROOT))] = hits
    assert offenders == {}, f"graph_runtime/loading imports the toy models: {offenders}"


def test_tiny_builds_its_processor_with_the_loaders():
    """The direction the rule leaves: tiny takes the processor construction from loading/processor.py."""
    assert "graph_runtime.loading.processor" in imported_modules(RUNTIME / "tiny.py")


def test_runtime_imports_no_comfyui_module():
    offenders = {}
    for path in sorted(RUNTIME.rglob("*.py")):
        hits = sorted(m for m in imported_modules(path) if m.split(".")[0] in COMFYUI_MODULES)
        if hits:
            offenders[str(path.relative_to(ROOT))] = hits
    assert offenders == {}, f"graph_runtime imports ComfyUI: {offenders}"


def benchmark_imports(path: Path, package: str | None = None) -> list[str]:
    """The modules of the benchmarks (`bench`, or the runtime's old `graph_runtime.bench`) that `path` imports."""
    return sorted(m for m in imported_modules(path, package) if m.lstrip(".").split(".")[0] == "bench"
                  or m == "graph_runtime.bench" or m.startswith("graph_runtime.bench."))


def test_benchmark_imports_are_seen_inside_functions_and_relative(tmp_path):
    """The helper itself: an absolute import inside a function and a relative one from nodes/ are both found, and a
    name that merely starts with "bench" is not."""
    source = tmp_path / "mod.py"
    source.write_text("import benchmark_tools\n\n\ndef f():\n    from bench.runner import main\n"
                      "    from ..bench import swap\n")
    # (`from X import name` also lists X.name: the name may be a module.)
    assert benchmark_imports(source, package="nodes") == ["bench", "bench.runner", "bench.runner.main", "bench.swap"]


def test_runtime_and_nodes_never_import_the_benchmarks():
    """Any import of the benchmarks from the installed runtime, the ComfyUI glue or the pack's entry point; and no
    benchmark package left inside the runtime."""
    sources = [*RUNTIME.rglob("*.py"), *NODES.rglob("*.py"), ROOT / "__init__.py"]
    offenders = {str(path.relative_to(ROOT)): benchmark_imports(path) for path in sorted(sources)}
    offenders = {path: hits for path, hits in offenders.items() if hits}
    assert offenders == {}, f"the installed code imports the benchmarks: {offenders}"
    assert not (RUNTIME / "bench").exists()


def test_the_build_installs_the_runtime_and_not_the_benchmarks():
    """The package list as setuptools expands it from pyproject.toml (what a wheel holds): the runtime and its
    subpackages, no `bench` and no `tests`."""
    from setuptools.config.pyprojecttoml import read_configuration

    packages = read_configuration(ROOT / "pyproject.toml", expand=True)["tool"]["setuptools"]["packages"]
    assert "graph_runtime" in packages and "graph_runtime.decode" in packages
    assert [p for p in packages if p.split(".")[0] != "graph_runtime" or "bench" in p.split(".")] == []


def test_comfy_interop_is_split_by_concern_and_reexports_every_name():
    """Each concern module's public names are importable from the package, as they were from the single module."""
    import importlib

    import graph_runtime.comfy_interop as interop

    for concern in ("latents", "conditioning", "pixels", "previews", "files", "saved_images"):
        module = importlib.import_module(f"graph_runtime.comfy_interop.{concern}")
        public = [n for n, v in vars(module).items() if not n.startswith("_") and getattr(v, "__module__", None)
                  == module.__name__]
        assert public, concern
        for name in public:
            assert getattr(interop, name) is getattr(module, name), f"{concern}.{name} is not re-exported"


def module_level_definitions(folder: Path) -> dict[str, list[str]]:
    """Name -> the files under `folder` that define a function or class of that name at module level."""
    found: dict[str, list[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    return found


def test_nodes_define_nothing_the_runtime_defines():
    nodes, runtime = module_level_definitions(NODES), module_level_definitions(RUNTIME)
    assert nodes and runtime
    both = {name: nodes[name] + runtime[name] for name in sorted(set(nodes) & set(runtime))}
    assert both == {}, f"defined in nodes/ and in graph_runtime/: {both}"


class _Shape(ast.NodeTransformer):
    """Forgets names, attributes and constants, so two functions written alike with other names compare equal."""

    def visit_Name(self, node):
        return ast.copy_location(ast.Name(id="_", ctx=node.ctx), node)

    def visit_Attribute(self, node):
        node = self.generic_visit(node)
        node.attr = "_"
        return node

    def visit_Constant(self, node):
        return ast.copy_location(ast.Constant(value=0), node)

    def visit_arg(self, node):
        node.arg, node.annotation = "_", None
        return node


def function_shapes(folder: Path, min_statements: int = 3) -> dict[str, str]:
    """The shape of every function body under `folder` with at least `min_statements` statements (docstring left
    out) -> where it is."""
    shapes = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) is not None else node.body
                if len(body) >= min_statements:
                    shape = ast.dump(_Shape().visit(ast.Module(body=body, type_ignores=[])))
                    shapes.setdefault(shape, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    return shapes


def test_function_shapes_match_a_renamed_copy():
    """The helper itself: a copy with other names and values has the shape of the original."""
    original = ast.parse("def f(a):\n    b = a * 2\n    c = g(b)\n    return c.x\n").body[0]
    renamed = ast.parse("def h(z):\n    y = z * 3\n    w = k(y)\n    return w.q\n").body[0]
    other = ast.parse("def h(z):\n    y = z * 3\n    w = k(y, 1)\n    return w.q\n").body[0]
    shape = [ast.dump(_Shape().visit(ast.Module(body=f.body, type_ignores=[]))) for f in (original, renamed, other)]
    assert shape[0] == shape[1] != shape[2]


def test_nodes_repeat_no_runtime_function_body():
    runtime = function_shapes(RUNTIME)
    repeated = {where: runtime[shape] for shape, where in function_shapes(NODES).items() if shape in runtime}
    assert repeated == {}, f"nodes/ functions shaped like runtime ones: {repeated}"


def test_nodes_word_no_byte_sizes():
    def is_size_unit(node) -> bool:
        return (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and isinstance(node.left, ast.Constant)
                and node.left.value == 2 and isinstance(node.right, ast.Constant) and node.right.value in (20, 30))

    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in sorted(NODES.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(), str(path))) if is_size_unit(node)]
    assert found == [], f"byte sizes worded in nodes/ (use graph_runtime.report.mib / memory.gib): {found}"


def pack_modules() -> dict[str, Path]:
    """{dotted name: file} of every module in graph_runtime/ and nodes/."""
    files = [p for folder in (RUNTIME, NODES) for p in folder.rglob("*.py")]
    names = {}
    for path in files:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_edges(path: Path, modules) -> set[str]:
    """The modules of `modules` that the module at `path` depends on, by this rule:

    - `from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg` (a name its __init__
      defines or re-exports); `import pkg.mod` and `from pkg.mod import x` are edges to `pkg.mod`;
    - importing a submodule runs its package's __init__ first, but that is Python's doing, not a dependency: a
      module importing a sibling (`from . import sibling`) does not depend on its package. So a package __init__ that
      re-exports its submodules is an edge from the package down to each of them, and forms a cycle only when a
      submodule takes a name from the package's __init__ itself.
    """
    package = package_of(path)
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            module = absolute_module(node, package)
            for alias in node.names:
                if f"{module}.{alias.name}" in modules:
                    edges.add(f"{module}.{alias.name}")
                elif module in modules:
                    edges.add(module)
    return edges


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_import_cycles_are_found():
    """The checker itself: a two-module cycle and a package whose submodule takes a name from its __init__ are found;
    a sibling import under a re-exporting __init__ is not a cycle."""
    assert import_cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    modules = pack_modules()
    # nodes/sampler.py imports glue modules (`from .comfyui import events`): edges to them, not to their package.
    assert not {"nodes", "nodes.comfyui"} & import_edges(NODES / "sampler.py", modules)
    assert "nodes.comfyui.events" in import_edges(NODES / "sampler.py", modules)
    # kernels/fp8_quant.py takes `define_once` from the kernels package's __init__: an edge to the package.
    assert "graph_runtime.kernels" in import_edges(RUNTIME / "kernels" / "fp8_quant.py", modules)


def test_no_import_cycles_in_the_runtime_and_the_nodes():
    """graph_runtime/ and nodes/ form layers: no module imports (directly or through others, function-level imports
    included) a module that imports it back. A cycle makes the import order matter and the pieces inseparable."""
    modules = pack_modules()
    graph = {name: import_edges(path, modules) - {name} for name, path in modules.items()}
    assert import_cycles(graph) == []


def folder_of(module: str, path: Path) -> str:
    """The folder a module belongs to, as a reader sees the tree: its package (graph_runtime/decode/, nodes/comfyui/);
    a module directly in graph_runtime/ or nodes/ is a folder of its own, as is each package's __init__."""
    parent = module.rpartition(".")[0]
    if path.name == "__init__.py" or parent in ("graph_runtime", "nodes"):
        return module
    return parent


def test_no_import_cycles_between_folders():
    """The same rule one level up: no folder of graph_runtime/ or nodes/ imports (through any of its modules,
    function-level imports included) a folder that imports it back, so each folder sits on one layer and a change
    inside a lower one never has to look upward. Importing a submodule runs its package's __init__ first; with this
    rule that never drags a higher folder in."""
    modules = pack_modules()
    graph: dict[str, set[str]] = {folder_of(name, path): set() for name, path in modules.items()}
    for name, path in modules.items():
        here = folder_of(name, path)
        graph[here] |= {folder_of(m, modules[m]) for m in import_edges(path, modules)} - {here}
    assert import_cycles(graph) == []


def process_registries(path: Path) -> list[str]:
    """Lines of `path` that keep state outside the objects that own it: an entry written into `sys.modules`
    (`sys.modules[...] = ...`, `sys.modules.setdefault(...)`) or an attribute forced onto another object with
    `object.__setattr__` (how state gets stuck onto a third party's module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assign):
            targets = [t.value for t in node.targets if isinstance(t, ast.Subscript)]
            if any(ast.unparse(t) == "sys.modules" for t in targets):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("sys.modules.setdefault", "object.__setattr__", "sys.modules.update"):
                found.append(f"{path.name}:{node.lineno}: {name}")
    return found


def test_process_registries_are_found(tmp_path):
    """The checker itself finds each form."""
    source = tmp_path / "state.py"
    source.write_text("import sys\nsys.modules['x'] = 1\nsys.modules.setdefault('y', 2)\n"
                      "def f(m):\n    object.__setattr__(m, '_engine', 3)\n")
    assert len(process_registries(source)) == 3


def test_no_engine_registry_outside_the_model_objects():
    """The loaded model (graph_runtime/loaded.py) owns its engine, graphs, LoRA state and runs: no module of the
    runtime or the nodes keeps a registry in `sys.modules` or sticks state onto the transformer (or any other
    object) with `object.__setattr__`. The pack being importable under two names is solved once, in its root
    __init__.py, which is why that file is not checked here."""
    found = [line for folder in (RUNTIME, NODES) for path in sorted(folder.rglob("*.py"))
             for line in process_registries(path)]
    assert found == []


# -- nodes/: node modules, and ComfyUI glue beside them ------------------------------------------------------------


def node_list_classes() -> set[str]:
    """The class names in nodes/extension.py's NODE_LIST, read from the source: its names, and the names in each
    `*X_NODES` list it unpacks, as the node module defining that list spells them."""
    extension = ast.parse((NODES / "extension.py").read_text())
    node_list = next(n.value for n in extension.body if isinstance(n, ast.AnnAssign | ast.Assign)
                     and "NODE_LIST" in ast.unparse(n.target if isinstance(n, ast.AnnAssign) else n.targets[0]))
    lists = {}
    for path in NODES.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.List)
                    and ast.unparse(node.targets[0]).endswith("_NODES")):
                lists[ast.unparse(node.targets[0])] = {ast.unparse(e) for e in node.value.elts}
    names = set()
    for element in node_list.elts:
        names |= lists[ast.unparse(element.value)] if isinstance(element, ast.Starred) else {ast.unparse(element)}
    return names


def test_node_list_classes_reads_the_lists_it_unpacks():
    """The helper itself: a node named directly and one from an unpacked list are both found."""
    names = node_list_classes()
    assert {"KVGraphSampler", "KVGraphLoadTransformer", "KVGraphReleaseCaches"} <= names


def test_every_module_directly_in_nodes_defines_a_node():
    """A module directly in nodes/ is where a node lives: it defines (at module level) a class of the pack's node
    list. The package's __init__ and extension.py (the node list and ComfyUI's entry point itself) are the two
    exceptions; anything else belongs in nodes/comfyui/ (ComfyUI glue) or graph_runtime/ (logic)."""
    nodes = node_list_classes()
    without = []
    for path in sorted(NODES.glob("*.py")):
        if path.name in ("__init__.py", "extension.py"):
            continue
        defined = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}
        if not defined & nodes:
            without.append(path.name)
    assert without == [], f"modules directly in nodes/ that define no node: {without}"
    folders = sorted(p.name for p in NODES.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == ["comfyui"], f"nodes/ keeps its glue in nodes/comfyui/ only, found {folders}"


def comfyui_imports(path: Path) -> list[str]:
    """The ComfyUI modules `path` imports (absolute imports only, anywhere in it: inside the pack a relative import
    is the pack's own, whatever its name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append(node.module)
    return sorted(m for m in found if m.split(".")[0] in COMFYUI_MODULES)


def test_comfyui_imports_skips_the_packs_relative_imports(tmp_path):
    """The helper itself: `from ..nodes import x` (the pack's) is not ComfyUI's `nodes`; `import comfy.utils` and a
    function-level `from server import PromptServer` are."""
    source = tmp_path / "glue.py"
    source.write_text("import os\nimport comfy.utils\nfrom ..nodes import x\n\n\ndef f():\n"
                      "    from server import PromptServer\n")
    assert comfyui_imports(source) == ["comfy.utils", "server"]


def test_every_glue_module_imports_comfyui():
    """nodes/comfyui/ is the glue only ComfyUI needs: each of its modules imports ComfyUI (its model management,
    server, progress bar, model folders or node API). A module that needs none of it is logic, and belongs in
    graph_runtime/ (or in the one module that uses it)."""
    modules = sorted(p for p in GLUE.glob("*.py") if p.name != "__init__.py")
    assert modules
    without = [p.name for p in modules if not comfyui_imports(p)]
    assert without == [], f"nodes/comfyui/ modules that import no ComfyUI module: {without}"
