"""What a process forked while a DALI pipeline is alive must never do with it.

A forked process (a torch ``DataLoader`` worker, ``multiprocessing``, Dask)
inherits a copy of every live :class:`~dali_pipes.DALILoader`'s pipeline, but
none of the threads behind it: DALI's executor threads and the observer thread
of its Python worker pool stay in the parent. Two clean-ups DALI would run in
the child then go wrong:

- ``Pipeline.__del__`` (or DALI's ``atexit`` hook) calls the C++
  ``Pipeline::Shutdown`` and destructor, which wait for executor threads that
  do not exist in the child: the child hangs for ever (seen with a torch
  ``DataLoader(num_workers=2)`` after a loader that was dropped but not yet
  garbage collected, whose GC then ran in the workers).
- the worker pool's finalizer closes its observer by writing to a pipe that the
  *parent's* observer thread reads, which would stop the parent's pool.

So every pipeline a loader builds is :func:`track`\\ ed, and a fork handler
disowns the tracked pipelines in the child: their C++ objects are kept for the
life of the child (never destroyed there, so nothing waits), and their pools
are marked closed (so nothing is written to the parent's pipes). The parent's
pipelines are untouched. A loader is never usable in a process forked from the
one that made it; make a new one there.

The garbage collector is paused from just before the fork until the child has
disowned them: Python runs ``threading``'s own fork handler, and any registered
before ours, first, and a collection they set off could otherwise free a loader
held only by a reference cycle there, before it is disowned (seen: one run in a
few hung, under load, in the pipeline's destructor called from
``threading._after_fork``).
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import threading
import weakref
from typing import Any

#: The DALI pipelines built by loaders of this process that are still alive.
_TRACKED: weakref.WeakSet = weakref.WeakSet()
#: In a forked child: the inherited DALI objects that must never be destroyed there.
_DISOWNED: list[Any] = []
_lock = threading.Lock()
#: Forks under way in this process (threads may fork at once), and whether the collector runs after them.
_pauses = 0
_collect_after = False
_pause_lock = threading.Lock()


def track(pipe: Any) -> None:
    """Have a process forked from this one disown ``pipe`` (a DALI ``Pipeline``), never shut it down.

    Tracked until it is freed, even after its loader is closed: a pipeline that
    outlives its loader (held by a call stuck on a dead worker) must not be shut
    down in a child either.
    """
    with _lock:
        _TRACKED.add(pipe)


def _pause_collector() -> None:
    """Before a fork: no garbage collection until the child has disowned what it inherits.

    Counted, because two threads may fork at once: the collector runs again when
    the last of them is done, and only if it ran before the first.
    """
    global _pauses, _collect_after
    with _pause_lock:
        if _pauses == 0:
            _collect_after = gc.isenabled()
            gc.disable()
        _pauses += 1


def _resume_collector() -> None:
    """After a fork, in the parent (a failed fork included)."""
    global _pauses
    with _pause_lock:
        _pauses -= 1
        if _pauses == 0 and _collect_after:
            gc.enable()


def _disown_after_fork() -> None:
    """In a forked child: make every inherited tracked pipeline inert (see the module docstring)."""
    global _lock, _pause_lock, _pauses
    _lock = threading.Lock()  # another thread of the parent may have held these at the fork
    _pause_lock = threading.Lock()
    try:
        for pipe in list(_TRACKED):
            disown(pipe)
        _TRACKED.clear()
    finally:
        _pauses = 0  # the parent's other forks under way are not this process's
        if _collect_after:
            gc.enable()


def disown(pipe: Any) -> None:
    """Make ``pipe``, inherited through fork, inert in this process: no shutdown, no message to the parent.

    Uses DALI's private ``Pipeline._pipe`` (the C++ pipeline, which ``_shutdown``
    skips when it is ``None``) and ``Pipeline._py_pool.pool._observer`` (which
    the pool's ``close`` skips when it is ``None``), DALI 1.x-2.x.
    """
    backend = getattr(pipe, "_pipe", None)
    if backend is not None:
        _DISOWNED.append(backend)  # its destructor would wait for the parent's threads
        pipe._pipe = None
    procs = getattr(getattr(pipe, "_py_pool", None), "pool", None)
    if procs is not None and getattr(procs, "_observer", None) is not None:
        _DISOWNED.append(procs._observer)
        procs._observer = None  # closing it would write to the parent's observer pipe


os.register_at_fork(before=_pause_collector, after_in_parent=_resume_collector, after_in_child=_disown_after_fork)


def import_in_thread(*modules: str) -> None:
    """Import ``modules`` (those not imported yet) in a short-lived thread of their own.

    Some first imports leave a reference cycle through the frames that were on
    the stack (``torch.fx``, imported with ``torch.distributed``, keeps a frame
    that refers to itself). Imported from inside ``DALILoader.__init__``, that
    cycle would hold the loader until the garbage collector runs, with its
    threads and worker processes. A thread's stack holds nothing of the caller's.
    """
    missing = [name for name in modules if name not in sys.modules]
    if not missing:
        return
    errors: list[BaseException] = []

    def load() -> None:
        try:
            for name in missing:
                importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=load, name="dali-pipes-import")
    thread.start()
    thread.join()
    if errors:
        raise errors.pop()
