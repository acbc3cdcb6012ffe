"""An engine's own Python source, run without installing the engine: files read out of its wheel, one definition
or a whole file executed, the modules it imports resolved from a sandbox of stand-ins."""

from __future__ import annotations

import ast
import contextlib
import sys
import types
import zipfile
from pathlib import Path


class Wheel:
    """Python source files read from an engine's wheel (nothing is installed or extracted to disk)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.zip = zipfile.ZipFile(self.path)
        self.names = set(self.zip.namelist())
        self.version = self.path.name.split("-")[1]

    def source(self, relpath: str) -> str:
        if relpath not in self.names:
            raise SystemExit(
                f"error: {self.path.name} has no {relpath}; this script reads that engine file "
                "(a different engine version may have moved it)"
            )
        return self.zip.read(relpath).decode("utf-8")


def find_wheel(folder: Path, name: str, explicit: Path | None) -> Path:
    if explicit is not None:
        if not explicit.is_file():
            raise SystemExit(f"error: --{name}-wheel {str(explicit)!r} is not a file")
        return explicit
    found = sorted(folder.glob(f"{name}-*.whl"))
    if not found:
        raise SystemExit(
            f"error: no {name}-*.whl in {str(folder)!r}; run `pip download --no-deps {name}` there "
            f"or pass --{name}-wheel"
        )
    return found[-1]


def definition(text: str, qualname: str, origin: str, namespace: dict):
    """Execute one top-level function/class or one method (`Class.method`) of an engine file in `namespace`.

    Compiled from the file's own syntax tree, so tracebacks point at the engine file's real line numbers."""
    cls_name, _, name = qualname.rpartition(".")
    body = ast.parse(text).body
    if cls_name:
        classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == cls_name]
        if not classes:
            raise SystemExit(f"error: {origin} has no class {cls_name}")
        body = classes[0].body
    nodes = [n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name]
    if not nodes:
        raise SystemExit(f"error: {origin} defines no {qualname}; this script runs that engine function")
    exec(compile(ast.Module(body=[nodes[0]], type_ignores=[]), origin, "exec"), namespace)  # noqa: S102 the point
    return namespace[name]


class Sandbox:
    """The modules one engine's code imports: its own files executed as modules, stand-ins for the rest.

    They are visible in sys.modules only inside `active()`, so nothing else sees them."""

    def __init__(self, label: str):
        self.label = label
        self.modules: dict[str, types.ModuleType] = {}
        self.stand_ins: list[tuple[str, str, str]] = []  # (module, names, why)
        self.executed: list[str] = []

    def _module(self, name: str) -> types.ModuleType:
        if name not in self.modules:
            module = types.ModuleType(name)
            module.__path__ = []  # every module may be a package: `from a.b import c` needs a.b's parents
            module.__package__ = name
            self.modules[name] = module
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(self._module(parent), child, module)
        return self.modules[name]

    def stub(self, name: str, why: str, **attrs):
        module = self._module(name)
        for key, value in attrs.items():
            setattr(module, key, value)
        self.stand_ins.append((name, ", ".join(sorted(attrs)), why))

    def own(self, module: str, attr: str, value, origin: str):
        """A stand-in module's attribute that is the engine's own definition (see `definition`)."""
        setattr(self._module(module), attr, value)
        self.executed.append(f"{origin}: {attr}")

    def run(self, name: str, text: str, origin: str) -> types.ModuleType:
        module = self._module(name)
        module.__file__ = origin
        module.__package__ = name.rpartition(".")[0]
        with self.active():
            exec(compile(text, origin, "exec"), module.__dict__)  # noqa: S102 running the engine's file is the point
        self.executed.append(origin)
        return module

    @contextlib.contextmanager
    def active(self):
        saved = {name: sys.modules.get(name) for name in self.modules}
        sys.modules.update(self.modules)
        try:
            yield self
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
