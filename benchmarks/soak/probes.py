"""Probes the soak installs in every Ray worker process of its job, from outside cf_ray's code: Ray's
``runtime_env={"worker_process_setup_hook": "benchmarks.soak.probes.install"}`` runs :func:`install`
when a process starts. cf_ray's production code knows nothing of them and reads none of their settings.

A probe does nothing unless the soak's driver *arms* it (a file ``arm/<probe>.json`` in the control
directory that ``SOAK_CONTROL_DIR`` names); the first process that reaches the probe's point claims
the arm (an atomic rename), writes ``at/<fault>.json`` (its pid, what it was doing) and:

* ``mid_copy`` (the snapshot thread's copy into a holder's slot, ``worker/snapshot/copy_engine.py``'s
  ``_copy_checksummed``): at the first copy of a section with tensors to copy (of rank ``rank`` if
  the arm names one, at step ``step`` if it names one, else at the first step from ``min_step`` on)
  it copies the first of those tensors into the slot itself, so the slot is part filled and not
  sealed, and holds there until the driver SIGKILLs the process (at most :data:`HOLD_S`); an arm
  with ``"kill": true`` SIGKILLs its own process there instead (tests/test_engine_e2e.py's fault,
  installed by a wrapper of demo's training loop: no driver to kill it).
* ``restore`` (``Checkpointer.restore``): holds inside the restore's first ``load_state_dict`` (the
  bytes read and checked, nothing loaded yet) until the driver SIGKILLs the process; ``at/<fault>.done.json``
  says when a restore ended without loading anything (a fresh start). An arm with ``"after": true``
  holds right after the restore returned instead (the rank's spare process for the next attempt is
  being made then).
* ``stream_flip`` (the direct transfer's reader, ``wire.fetch_into`` or ``stream.fetch``): flips one
  bit of the bytes as they arrive, before any of cf_ray's checks sees them (a bit flipped on the wire),
  and goes on.

:func:`arm` arms a probe and :func:`fired` reads where it fired. The end-to-end tests install the
probes from a wrapper of demo's training loop instead (tests/trust_faults.py's ``soak_probes_loop``),
which sets ``SOAK_CONTROL_DIR`` from the run's ``env`` first.
The modules are patched right after their first import (an import hook), so that a process that
never imports them (a holder never imports torch) pays nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import time
from typing import Any

#: The variable that names the control directory (read here only).
CONTROL_ENV = "SOAK_CONTROL_DIR"
#: Longest a probe holds a process for the driver to kill it.
HOLD_S = 20.0
#: The variable that sets, in the soak's workers, the seconds after a rank's restore before its first
#: spare is asked for (``link/ray_train_spare.py``'s ``FIRST_DELAY_S``; unset: cf_ray's own). A soak
#: run trains for seconds: with cf_ray's delay none of its attempts would make a spare, and the
#: spare faults and the end-of-run check of spares need them made, some of them as the run ends.
SPARE_DELAY_ENV = "SOAK_SPARE_DELAY_S"


def _control() -> str | None:
    return os.environ.get(CONTROL_ENV) or None


def _write(path: str, rec: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f, default=str)
    os.replace(tmp, path)


def arm(control: str, probe: str, spec: dict) -> None:
    """Arm ``probe`` (``mid_copy``, ``restore``, ``stream_flip``) in control directory ``control``;
    ``spec["fault"]`` names the ``at/<fault>.json`` it writes where it fires."""
    d = os.path.join(control, "arm")
    os.makedirs(d, exist_ok=True)
    _write(os.path.join(d, f"{probe}.json"), spec)


def fired(control: str, fault: str, suffix: str = "") -> dict | None:
    """What the probe armed for ``fault`` wrote where it fired (its pid, rank, step, point), or ``None``."""
    try:
        with open(os.path.join(control, "at", f"{fault}{suffix}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _claim(probe: str) -> dict | None:
    """The arm of ``probe`` if this process takes it (at most one process does), else ``None``."""
    control = _control()
    if control is None:
        return None
    arm = os.path.join(control, "arm", f"{probe}.json")
    if not os.path.exists(arm):
        return None
    try:
        with open(arm) as f:
            spec = json.load(f)
    except (OSError, ValueError):
        return None
    return spec


def _take(probe: str) -> bool:
    control = _control()
    assert control is not None
    arm = os.path.join(control, "arm", f"{probe}.json")
    try:
        os.rename(arm, f"{arm}.taken.{os.getpid()}")
        return True
    except FileNotFoundError:
        return False


def _at(spec: dict, rec: dict, suffix: str = "") -> None:
    control = _control()
    assert control is not None
    os.makedirs(os.path.join(control, "at"), exist_ok=True)
    _write(os.path.join(control, "at", f"{spec['fault']}{suffix}.json"), dict(rec, pid=os.getpid(), time=time.time()))


def _hold() -> None:
    """Wait to be killed (SIGKILL from the driver); give up after :data:`HOLD_S`."""
    deadline = time.time() + HOLD_S
    while time.time() < deadline:
        time.sleep(0.01)


def _fire(spec: dict) -> None:
    """SIGKILL this process (an arm with ``"kill": true``), else hold for the driver to kill it."""
    if spec.get("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    _hold()


def _rank() -> int | None:
    """This process's Ray Train rank (``None`` outside Ray Train)."""
    try:
        import ray.train

        return ray.train.get_context().get_world_rank()
    except Exception:  # noqa: BLE001 - outside Ray Train: no rank
        return None


def _frame_value(name: str, attr: str, depth: int = 6) -> Any:
    """``<local name>.<attr>`` of the nearest caller frame that has the local (best effort)."""
    f = sys._getframe(2)
    for _ in range(depth):
        if f is None:
            return None
        if name in f.f_locals:
            return getattr(f.f_locals[name], attr, None)
        f = f.f_back
    return None


# -- mid-copy -------------------------------------------------------------------------------------
def _patch_snapshot(module) -> str:
    orig = getattr(module, "_copy_checksummed", None)
    if orig is None:
        return "no _copy_checksummed: mid-copy probe not installed"

    @functools.wraps(orig)
    def copy(arena, pieces, *args, **kw):
        spec = _claim("mid_copy") if pieces else None
        if spec is not None:
            rank, step = _rank(), _frame_value("job", "step")
            ok_rank = spec.get("rank") is None or rank is None or rank == spec["rank"]
            if "step" in spec:
                ok_step = step == spec["step"]
            else:
                ok_step = step is None or step >= spec.get("min_step", 0)
            if ok_rank and ok_step and _take("mid_copy"):
                orig(arena, pieces[:1])  # the first tensor lands in the slot (CRCs of this pass unused)
                point = "after the first tensor of the deferred copy landed"
                _at(spec, {"rank": rank, "step": step, "arena_bytes": getattr(arena, "nbytes", None), "point": point})
                _fire(spec)
        return orig(arena, pieces, *args, **kw)

    module._copy_checksummed = copy
    return "mid_copy"


# -- mid-restore ----------------------------------------------------------------------------------
def _patch_checkpointer(module) -> str:
    cls = getattr(module, "Checkpointer", None)
    if cls is None or not hasattr(cls, "restore"):
        return "no Checkpointer.restore: restore probe not installed"
    orig = cls.restore

    @functools.wraps(orig)
    def restore(self, *args, **kw):
        spec = _claim("restore")
        if spec is None:
            return orig(self, *args, **kw)
        rank = _rank()
        if spec.get("rank") is not None and rank is not None and rank != spec["rank"]:
            return orig(self, *args, **kw)
        if not _take("restore"):
            return orig(self, *args, **kw)
        if spec.get("after"):  # held right after the restore returned: its spare process being made
            resume = orig(self, *args, **kw)
            at = {"rank": rank, "point": "right after the restore returned", "step": getattr(resume, "step", None)}
            _at(spec, dict(at, source=getattr(resume, "source", None), generation=getattr(resume, "generation", None)))
            _hold()
            return resume
        import torch

        originals = {c: c.load_state_dict for c in (torch.nn.Module, torch.optim.Optimizer)}

        def holding(cls_):
            def load_state_dict(obj, *a, **k):
                _at(spec, {"rank": rank, "point": f"in the restore, before {type(obj).__name__}.load_state_dict"})
                _hold()
                return originals[cls_](obj, *a, **k)

            return load_state_dict

        for c in originals:
            c.load_state_dict = holding(c)
        try:
            resume = orig(self, *args, **kw)
        finally:
            for c, f in originals.items():
                c.load_state_dict = f
        _at(
            spec,
            {"rank": rank, "source": getattr(resume, "source", None), "step": getattr(resume, "step", None)},
            ".done",
        )
        return resume

    cls.restore = restore
    return "restore"


# -- a bit flipped in the direct transfer ---------------------------------------------------------
def _flip(buf, where: float) -> int:
    mv = memoryview(buf).cast("B") if memoryview(buf).format != "B" else memoryview(buf)
    off = min(mv.nbytes - 1, int(where * mv.nbytes))
    mv[off] ^= 0x08
    return off


def _patch_wire(module) -> str:
    orig = getattr(module, "fetch_into", None)
    if orig is None:
        return "no fetch_into"

    @functools.wraps(orig)
    def fetch_into(desc, dest, *args, landed=None, **kw):
        spec = _claim("stream_flip")
        if spec is None or not _take("stream_flip"):
            return orig(desc, dest, *args, landed=landed, **kw)
        nbytes = memoryview(dest).nbytes
        target = min(max(nbytes - 1, 0), int(spec.get("where", 0.5) * nbytes))
        done: dict = {}

        def landed2(got: int) -> None:
            if not done and got > target:
                done["offset"] = _flip(dest, target / max(nbytes, 1))
                _at(spec, {"point": "as the bytes landed", "nbytes": nbytes, "offset": done["offset"], **_desc(desc)})
            if landed is not None:
                landed(got)

        try:
            orig(desc, dest, *args, landed=landed2, **kw)
        except BaseException as e:
            if done:  # the bytes were flipped, then the transfer ended in an error: which one says
                # whether a check caught the flip or the transfer broke first (its node died)
                at = {"point": "as the bytes landed", "nbytes": nbytes, "offset": done["offset"], **_desc(desc)}
                _at(spec, dict(at, then_failed=f"{type(e).__name__}: {e}"[:300]))
            raise
        if not done and nbytes:
            done["offset"] = _flip(dest, target / nbytes)
            _at(spec, {"point": "after the transfer, before any check", "nbytes": nbytes, **done, **_desc(desc)})
        return None

    module.fetch_into = fetch_into
    return "stream_flip(fetch_into)"


def _patch_stream(module) -> str:
    orig = getattr(module, "fetch", None)
    if orig is None:  # the reader is wire.fetch_into (patched above)
        return "no stream.fetch"

    @functools.wraps(orig)
    def fetch(desc, *args, **kw):
        buf = orig(desc, *args, **kw)
        spec = _claim("stream_flip")
        if spec is not None and len(buf) and _take("stream_flip"):
            off = _flip(buf, spec.get("where", 0.5))
            _at(
                spec,
                {
                    "point": "as the transfer returned, before any check",
                    "nbytes": len(buf),
                    "offset": off,
                    **_desc(desc),
                },
            )
        return buf

    module.fetch = fetch
    return "stream_flip(fetch)"


def _patch_spare(module) -> str:
    delay = os.environ.get(SPARE_DELAY_ENV)
    if not delay:
        return "spare delay: cf_ray's"
    module.FIRST_DELAY_S = float(delay)
    return f"spare delay: {float(delay):g} s"


def _desc(desc) -> dict:
    return {k: getattr(desc, k, None) for k in ("host", "port", "nbytes")}


PATCHES = {
    "cf_ray._engine.worker.snapshot.copy_engine": _patch_snapshot,
    "cf_ray.checkpointer": _patch_checkpointer,
    "cf_ray._engine.memory.wire": _patch_wire,
    "cf_ray._engine.node.stream": _patch_stream,
    "cf_ray._engine.worker.link.ray_train_spare": _patch_spare,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name: str):
        self.inner, self.name = inner, name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _apply(self.name, module)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches the modules of :data:`PATCHES` right after their first import."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, fullname)
        return spec


def _apply(name: str, module) -> None:
    try:
        what = PATCHES[name](module)
    except Exception as e:  # noqa: BLE001 - a probe that fails to install must not break the process
        what = f"failed: {e!r}"
    control = _control()
    if control:
        fd = os.open(os.path.join(control, "probes.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps({"pid": os.getpid(), "module": name, "probe": what}) + "\n").encode())
        finally:
            os.close(fd)


def install() -> None:
    """Ray's ``worker_process_setup_hook``: the probes, in a process of the soak's job (or of a test's
    run, called from its training loop); once per process, nothing while ``SOAK_CONTROL_DIR`` is unset."""
    if _control() is None or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
    for name in PATCHES:
        if name in sys.modules:
            _apply(name, sys.modules[name])


__all__ = ["CONTROL_ENV", "HOLD_S", "SPARE_DELAY_ENV", "arm", "fired", "install"]
