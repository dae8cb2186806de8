"""Imports of modules that coverage does not measure run without its tracer.

On Python 3.11 coverage.py traces through ``sys.settrace``: its tracer is
called on every function call in the process, measured file or not. Importing
torch, transformers and tensordict runs hundreds of thousands of calls, so in a
measured process the import of the stack a trainer worker needs took 45% longer
(10.5 s of CPU without coverage, 14-16 s with it, on the 2-core CI machine);
every Ray worker, rank and test file process pays it again.

:func:`install` puts a finder first on ``sys.meta_path`` that leaves finding to
the others and only wraps the loader it gets: while a module that the running
measurement would not trace executes its body, the current thread's tracer is
stopped; a measured module imported from inside such a body is traced again
while its own body runs. What is measured does not change, with one exception:
a measured function that an unmeasured module's body *calls* (a hook registered
earlier, say) is not seen while that body runs.

Only the thread doing the import is affected; other threads keep tracing. With
no coverage tracer on the thread (coverage off, or coverage's ``sysmon`` core
on Python 3.12+, which has no such cost) the finder does nothing.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["install", "installed", "uninstall"]

_paused = threading.local()  # .tracer: the tracer this thread's outermost quiet import stopped


def _coverage_tracer() -> Any:
    """The coverage tracer (CTracer or PyTracer) of this thread, or None."""
    tracer = sys.gettrace()
    if hasattr(tracer, "should_trace") and hasattr(tracer, "stop") and hasattr(tracer, "start"):
        return tracer
    return None


class _Loader:
    """A loader that runs the real one's ``exec_module`` with tracing switched as needed.

    Only the import system sees it: the module gets the real loader before its
    body runs, so ``module.__loader__`` and ``__spec__.loader`` are as usual.
    """

    def __init__(self, loader: Any, measured: bool) -> None:
        self._loader = loader
        self._measured = measured

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        paused = getattr(_paused, "tracer", None)
        if self._measured and paused is not None:  # a measured module inside a quiet import
            with _tracing(paused, on=True):
                self._loader.exec_module(module)
        elif not self._measured and paused is None and (tracer := _coverage_tracer()):
            with _tracing(tracer, on=False):
                self._loader.exec_module(module)
        else:
            self._loader.exec_module(module)


@contextlib.contextmanager
def _tracing(tracer: Any, on: bool) -> Iterator[None]:
    """This thread's ``tracer`` switched on (or off) meanwhile; ``_paused`` says which is paused."""
    (tracer.start if on else tracer.stop)()
    _paused.tracer = None if on else tracer
    try:
        yield
    finally:
        (tracer.stop if on else tracer.start)()
        _paused.tracer = tracer if on else None


class _ModuleFrame:
    """What coverage's file check reads of a frame: its globals."""

    def __init__(self, f_globals: dict[str, Any]) -> None:
        self.f_globals = f_globals


class UntracedImports:
    """The meta path finder of :func:`install` (it finds nothing itself)."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        tracer = _coverage_tracer() or getattr(_paused, "tracer", None)
        if tracer is None:
            return None
        spec = None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        if spec is None or not spec.has_location or not hasattr(spec.loader, "exec_module"):
            return spec
        # coverage decides by the file and the module's name (``source_pkgs``), which it
        # reads from the frame's globals: the module's frame does not exist yet.
        module_globals = {"__name__": spec.name, "__file__": spec.origin, "__spec__": spec}
        disposition = tracer.should_trace(spec.origin, _ModuleFrame(module_globals))
        spec.loader = _Loader(spec.loader, bool(getattr(disposition, "trace", True)))
        return spec

    def invalidate_caches(self) -> None:
        """Nothing cached here (the import system calls this on every finder)."""


def installed() -> bool:
    """Whether :func:`install` put its finder on ``sys.meta_path``."""
    return any(isinstance(finder, UntracedImports) for finder in sys.meta_path)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once; it acts only while coverage traces)."""
    if not installed():
        sys.meta_path.insert(0, UntracedImports())


def uninstall() -> None:
    """Take the finder off ``sys.meta_path``."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, UntracedImports)]
