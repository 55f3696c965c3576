"""The package's dependency rules, read from the source (nothing is imported or run):

- the production loaders (graph_runtime/loading/) never import the toy models (graph_runtime/tiny.py): tiny builds on
  loading, never the reverse, so a real checkpoint's load cannot depend on test scaffolding;
- the runtime (graph_runtime/, comfy_interop included: it speaks ComfyUI's data formats) imports no ComfyUI module,
  so it runs where ComfyUI is absent (the CLI, the benchmarks, CPU tests).
"""

import ast
from pathlib import Path

# Top-level modules that exist only inside a ComfyUI process.
COMFYUI_MODULES = ("comfy", "comfy_api", "comfy_execution", "comfy_extras", "folder_paths", "server", "nodes",
                   "execution", "latent_preview", "node_helpers")

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "graph_runtime"


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it (function-level imports included), as an absolute dotted name."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    if path.name == "__init__.py":
        package = ".".join(path.relative_to(ROOT).parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
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


def test_comfy_interop_is_split_by_concern_and_reexports_every_name():
    """Each concern module's public names are importable from the package, as they were from the single module."""
    import importlib

    import graph_runtime.comfy_interop as interop

    for concern in ("latents", "conditioning", "pixels", "previews", "files"):
        module = importlib.import_module(f"graph_runtime.comfy_interop.{concern}")
        public = [n for n, v in vars(module).items() if not n.startswith("_") and getattr(v, "__module__", None)
                  == module.__name__]
        assert public, concern
        for name in public:
            assert getattr(interop, name) is getattr(module, name), f"{concern}.{name} is not re-exported"
