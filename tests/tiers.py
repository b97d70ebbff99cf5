"""The suite's two tiers: tests that run in this process, and tests that start programs.

A test is ``external`` when it can start a child process — Envoy, valkey-server, the
sidecar as a process, llama-server, or any other program. ``make check`` runs the rest
(``-m 'not external'``); ``make test`` runs both.

Nobody keeps a list. At collection every test is classified from the code it can reach:
the names its function, its fixtures and its parameters refer to, followed through the
repository's own functions and classes, until one of them is a way to start a process
(``subprocess``, ``asyncio.create_subprocess_exec``, ``os.fork`` ...). ``Stack``,
``Replicas``, ``ValkeyServer``, ``SidecarProcess`` and ``LlamaFleet`` are external
because their methods call ``subprocess.Popen``, so a new test that uses any of them
(or a fixture or helper that does) is external without being told.

Reading code can miss a way in (a callable handed over at run time). So the classifier
is also enforced: a test classified in-process that starts a child process anyway fails
on the spot, naming the program, instead of slowing the fast tier or failing there for
want of a server. Mark such a test ``@pytest.mark.external`` by hand; mark so too an
in-process test that waits seconds of real time by design (a timeout it exercises), which
would hold one of the inner loop's few workers for nothing.
"""

from __future__ import annotations

import asyncio
import builtins
import dis
import functools
import importlib
import inspect
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

import pytest

MARK = "external"
# Marks that mean "needs a server" on their own, whatever the code says.
IMPLIES_EXTERNAL = ("e2e", "soak", "llama")
_REPO_PACKAGES = frozenset({"sidecar", "devtools", "tests", "bench", "conftest"})

# The ways a Python process starts another program.
_SPAWNERS: frozenset[Any] = frozenset(
    f for f in (
        subprocess.Popen, subprocess.run, subprocess.call, subprocess.check_call,
        subprocess.check_output, subprocess.getoutput, subprocess.getstatusoutput,
        asyncio.create_subprocess_exec, asyncio.create_subprocess_shell,
        os.system, os.popen, getattr(os, "posix_spawn", None),
        getattr(os, "posix_spawnp", None), getattr(os, "fork", None),
        getattr(os, "forkpty", None), os.execv, os.execve, os.execvp, os.execvpe,
    ) if f is not None)


# Directories whose Python files are "ours" (followed): the repository, and pytest's
# rootdir (set at configure); anything installed (site-packages) is not.
roots: list[Path] = [Path(__file__).resolve().parents[1]]


@functools.cache
def _module_in_roots(name: str) -> bool:
    file = getattr(sys.modules.get(name), "__file__", None)
    if not file:
        return False
    path = Path(file).resolve()
    return "site-packages" not in path.parts and any(path.is_relative_to(r) for r in roots)


def _in_repo(obj: Any) -> bool:
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str):
        return False
    # envoy/*.py are loaded by path as smg_envoy_<name> (devtools.stack.load_renderer)
    return (module.split(".")[0] in _REPO_PACKAGES or module.startswith("smg_envoy_")
            or _module_in_roots(module))


def _is_spawner(obj: Any) -> bool:
    try:
        return obj in _SPAWNERS
    except TypeError:  # unhashable
        return False


class Classifier:
    """Whether a function can start a process, memoised per code object and class."""

    def __init__(self) -> None:
        self._code: dict[CodeType, bool] = {}
        self._classes: dict[type, bool] = {}
        self.why: dict[CodeType | type, str] = {}

    def spawns(self, obj: Any) -> bool:
        """True when calling ``obj`` (a function, class, bound method, partial, or an
        instance of a repository class) can start a child process."""
        if _is_spawner(obj):
            return True
        if isinstance(obj, functools.partial):
            return self.spawns(obj.func) or any(self.spawns(a) for a in obj.args)
        if isinstance(obj, (staticmethod, classmethod)):
            return self.spawns(obj.__func__)
        if isinstance(obj, property):
            return any(self.spawns(f) for f in (obj.fget, obj.fset, obj.fdel) if f)
        if inspect.ismethod(obj):
            return self.spawns(obj.__func__)
        if isinstance(obj, type):
            return _in_repo(obj) and self._class_spawns(obj)
        if inspect.isfunction(obj):
            obj = inspect.unwrap(obj)
            inner = getattr(getattr(obj, "hypothesis", None), "inner_test", None)
            if inner is not None:  # a Hypothesis @given test: the test inside
                return self.spawns(inner)
            if not _in_repo(obj):
                return False
            return self._code_spawns(obj.__code__, obj.__globals__)
        if _in_repo(type(obj)) and not isinstance(obj, ModuleType):
            return self._class_spawns(type(obj))
        return False

    def _class_spawns(self, cls: type) -> bool:
        if cls in self._classes:
            return self._classes[cls]
        self._classes[cls] = False  # a cycle back here adds nothing
        result = False
        for klass in cls.__mro__:
            if klass is object or not _in_repo(klass):
                continue
            for member in vars(klass).values():
                if self.spawns(member):
                    result = True
                    break
            if result:
                break
        self._classes[cls] = result
        return result

    def _code_spawns(self, code: CodeType, globs: dict[str, Any]) -> bool:
        if code in self._code:
            return self._code[code]
        self._code[code] = False  # recursion: assume no until shown otherwise
        result = self._names_spawn(code, globs) or any(
            self._code_spawns(c, globs) for c in code.co_consts if isinstance(c, CodeType))
        self._code[code] = result
        return result

    def _names_spawn(self, code: CodeType, globs: dict[str, Any]) -> bool:
        # co_names holds the globals a function loads and the attributes it reads,
        # unqualified: `subprocess.run` is "subprocess" and "run". Resolve each name as
        # a global; for each module among them (and each module the function imports
        # itself), try the names as its attributes.
        names = code.co_names
        modules = _imported_modules(code)
        for name in names:
            obj = globs.get(name, getattr(builtins, name, None))
            if obj is None:
                continue
            if isinstance(obj, ModuleType):
                modules.append(obj)
            elif self.spawns(obj):
                return True
        for module in modules:
            for name in names:
                with warnings.catch_warnings():  # numpy's deprecated aliases warn on access
                    warnings.simplefilter("ignore")
                    attr = getattr(module, name, None)
                if attr is not None and not isinstance(attr, ModuleType) and (
                        _is_spawner(attr) or (_in_repo(attr) and self.spawns(attr))):
                    return True
        return False


_IMPORT_NAME = dis.opmap["IMPORT_NAME"]


def _imported_modules(code: CodeType) -> list[ModuleType]:
    """The modules a function imports in its body (``import x.y``, ``from x import y``),
    imported now if need be."""
    found: list[ModuleType] = []
    # Most functions import nothing: skip decoding them (dis is most of collection's
    # classifying time). Every unit of co_code is an (opcode, arg) byte pair.
    if _IMPORT_NAME not in code.co_code[::2]:
        return found
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME" and ins.argval:
            try:
                found.append(importlib.import_module(ins.argval))
            except Exception:  # a module that cannot import here starts nothing here
                continue
    return found


_CLASSIFIER = Classifier()


def _fixture_functions(item: pytest.Item) -> list[Callable[..., Any]]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    funcs = []
    for name in item.fixturenames:  # type: ignore[attr-defined]
        for fixturedef in info.name2fixturedefs.get(name, ()):
            funcs.append(fixturedef.func)
    return funcs


def is_external(item: pytest.Item) -> bool:
    if any(item.get_closest_marker(m) is not None for m in (MARK, *IMPLIES_EXTERNAL)):
        return True
    candidates: list[Any] = [getattr(item, "function", None), *_fixture_functions(item)]
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        candidates += list(callspec.params.values())
    return any(c is not None and _CLASSIFIER.spawns(c) for c in candidates)


def classify(config: pytest.Config, items: Sequence[pytest.Item]) -> None:
    """Mark every external test ``external`` (pytest_collection_modifyitems)."""
    roots.append(config.rootpath.resolve())
    _module_in_roots.cache_clear()
    for item in items:
        if item.get_closest_marker(MARK) is None and is_external(item):
            item.add_marker(MARK)


# ---------------------------------------------------------------- enforcement

_current: pytest.Item | None = None
_original_init = subprocess.Popen.__init__


def program_of(args: Any) -> str:
    """The program a Popen starts, as a short name: past devtools.proc's launcher,
    ``python -m sidecar`` as ``sidecar``."""
    argv = [str(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
    if "--" in argv and any(a.endswith("proc.py") for a in argv[:4]):
        argv = argv[argv.index("--") + 1:]
    if not argv:
        return "?"
    if len(argv) >= 3 and argv[1] == "-m":
        return argv[2]
    return os.path.basename(argv[0])


def _guarded_init(self: subprocess.Popen[Any], args: Any, *a: Any, **kw: Any) -> None:
    item = _current
    if item is not None and item.get_closest_marker(MARK) is None:
        message = (f"{item.nodeid} starts a child process ({program_of(args)}) but was "
                   f"classified in-process (the fast tier, make check): mark it "
                   f"@pytest.mark.{MARK}, and see tests/tiers.py for why it was missed")
        item.stash[_violation] = message
        pytest.fail(message, pytrace=False)
    _original_init(self, args, *a, **kw)
    for hook in popen_hooks:
        hook(self, args, kw)


_violation = pytest.StashKey[str]()
# Called after every Popen started while a test runs (tests/logtails.py records logs).
popen_hooks: list[Callable[[subprocess.Popen[Any], Any, dict[str, Any]], None]] = []


def install() -> None:
    subprocess.Popen.__init__ = _guarded_init  # type: ignore[method-assign]


def uninstall() -> None:
    subprocess.Popen.__init__ = _original_init  # type: ignore[method-assign]


def set_current(item: pytest.Item | None) -> None:
    global _current
    _current = item


def violation(item: pytest.Item) -> str | None:
    return item.stash.get(_violation, None)
