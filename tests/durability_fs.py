"""A storage that misbehaves while a flag file exists: it hangs (never returns) or fails every
write of a checkpoint's files. Used as ``storage_filesystem`` through ``pyarrow.fs.PyFileSystem``;
importable by Ray's actor processes (tests/ is on their PYTHONPATH) without importing torch."""

from __future__ import annotations

import os
import re
import time

from faulty_fs import FaultyHandler

#: A hang ends by itself after this long, so that a test that fails never leaves a writer stuck.
HANG_LIMIT_S = 120.0


class FlagHandler(FaultyHandler):
    """Local disk; while ``flag`` exists, writing a checkpoint's section files (never a manifest)
    ``hang``s until the flag is gone, or ``fail``s with an ``OSError`` (``fail_once``: the first such
    write fails and takes the flag away)."""

    def __init__(self, flag: str, mode: str):
        super().__init__(fail=r"(?!)")
        if mode not in ("hang", "fail", "fail_once"):
            raise ValueError(mode)
        self.flag, self.mode = flag, mode

    def __reduce__(self):
        return (FlagHandler, (self.flag, self.mode))

    def get_type_name(self):
        return f"flag-{self.mode}"

    def equals(self, other):
        return isinstance(other, FlagHandler) and (other.flag, other.mode) == (self.flag, self.mode)

    def _check(self, path: str) -> None:
        if not re.search(r"checkpoints/step_\d+/g\d+\.", path):
            return
        if self.mode in ("fail", "fail_once"):
            if os.path.exists(self.flag):
                if self.mode == "fail_once":
                    os.remove(self.flag)
                raise OSError(f"injected fault: storage refuses to write {path}")
            return
        t0 = time.time()
        while os.path.exists(self.flag) and time.time() - t0 < HANG_LIMIT_S:
            time.sleep(0.05)
