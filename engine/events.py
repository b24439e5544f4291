"""Named points of a run (a step's middle, a validation, each stage of a checkpoint save) where code outside the
training path may act: the tests' fault injection (engine/faults.py) installs itself here. Nothing is installed
by default, and then every call is a no-op."""

from __future__ import annotations

from typing import Any, Callable, Optional

PointHook = Callable[[int, str], None]
"""``hook(step, point)``: the run has reached ``point`` in step ``step`` (or in the save of step ``step``)."""
WriterHook = Callable[..., Any]
"""``hook(folder, step, **kwargs)``: the DCP storage writer of the save of ``step``, in place of FileSystemWriter."""

_point_hook: Optional[PointHook] = None
_writer_hook: Optional[WriterHook] = None


def install(point_hook: Optional[PointHook], writer_hook: Optional[WriterHook] = None) -> None:
    """Call ``point_hook`` at every named point, and make every checkpoint's writer with ``writer_hook`` (None:
    nothing, DCP's writer)."""
    global _point_hook, _writer_hook
    _point_hook, _writer_hook = point_hook, writer_hook


def point(step: int, name: str) -> None:
    """The run has reached the point ``name`` in step ``step``."""
    if _point_hook is not None:
        _point_hook(step, name)


def writer_hook() -> Optional[WriterHook]:
    """What makes a checkpoint's DCP writer, when something is installed; None: DCP's FileSystemWriter."""
    return _writer_hook
