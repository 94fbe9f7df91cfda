"""The soak's checkpoint storage: local disk through a pyarrow filesystem that fails, stalls or holds a
write on purpose, as the soak's driver says in files of a control directory.

Given to the run as ``CheckpointConfig(storage_filesystem=pyarrow.fs.PyFileSystem(SoakStorage(dir)))``,
it is pickled into every process that touches the checkpoints (the holders' writers, the controller's
commits, the workers' restores); each unpickles its own handler, so the driver speaks to all of them
through the one file :data:`RULE` in the control directory, and they answer in files there:

* ``error``: until ``until`` (unix time), every checkpoint write raises ``OSError`` whose message names
  the fault (``soak fault <id>``): the soak finds that name in what the run reports.
* ``hang``: until ``until``, every checkpoint write blocks first (storage that stops answering).
* ``gate``: the first write matching ``match`` claims the rule, writes ``at/<fault>.json`` (its pid,
  path and time) and blocks while ``gate.<fault>`` exists, at most ``hold_s``: the driver kills a
  process while that write is in flight (mid-persist, mid-commit), then removes the gate.

Every write the rules touched is a line of :data:`EVENTS`. cf_ray sees a filesystem other than
``LocalFileSystem`` here, so it writes as it does to an object store (no temporary name and rename,
no ``O_DIRECT``). No torch and no cf_ray imports: the holders and the controller import this module.
"""

from __future__ import annotations

import json
import os
import re
import time

from benchmarks.local_disk import LocalDiskHandler

#: The rule the driver sets (JSON: ``fault``, ``mode``, ``until``, ``match``, ``hold_s``).
RULE = "storage_rule.json"
#: What the rules did, a JSON line per write (appended with ``O_APPEND``: whole lines from any process).
EVENTS = "storage_events.jsonl"
#: Checkpoint files: a section's data or index file, or a manifest, of a step or the final model.
CHECKPOINT_FILE = r"checkpoints/(step|final)_(\d+)/"
#: A hang ends by itself after this long, so that a soak that dies never leaves a writer stuck.
MAX_BLOCK_S = 300.0


def step_of(path: str) -> int | None:
    m = re.search(CHECKPOINT_FILE, path)
    return int(m.group(2)) if m else None


def write_rule(control: str, rule: dict) -> None:
    """Set the rule (atomically: a reader sees the old one or the new one)."""
    tmp = os.path.join(control, f".{RULE}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(rule, f)
    os.replace(tmp, os.path.join(control, RULE))


def clear_rule(control: str) -> None:
    try:
        os.unlink(os.path.join(control, RULE))
    except FileNotFoundError:
        pass


def read_events(control: str) -> list[dict]:
    try:
        with open(os.path.join(control, EVENTS)) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def _append(control: str, rec: dict) -> None:
    fd = os.open(os.path.join(control, EVENTS), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())
    finally:
        os.close(fd)


class SoakStorage(LocalDiskHandler):
    """Local disk; checkpoint writes obey the rule in ``control`` (module doc)."""

    def __init__(self, control: str):
        super().__init__()
        self.control = control

    def __reduce__(self):
        return (SoakStorage, (self.control,))

    def _rule(self) -> dict | None:
        try:
            with open(os.path.join(self.control, RULE)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _check(self, path: str) -> None:
        if step_of(path) is None:
            return
        rule = self._rule()
        if not rule or not re.search(rule.get("match") or CHECKPOINT_FILE, path):
            return
        fault, mode, now = rule["fault"], rule["mode"], time.time()
        rec = {"fault": fault, "mode": mode, "path": path, "step": step_of(path), "pid": os.getpid(), "t0": now}
        if mode == "error":
            if now < rule["until"]:
                _append(self.control, dict(rec, outcome="refused"))
                raise OSError(f"soak fault {fault}: injected storage error writing {path}")
        elif mode == "hang":
            if now < rule["until"]:
                while time.time() < min(rule["until"], now + MAX_BLOCK_S) and self._rule() == rule:
                    time.sleep(0.05)
                _append(self.control, dict(rec, outcome="blocked", t1=time.time(), blocked_s=time.time() - now))
        elif mode == "gate":
            self._gate(rule, rec)

    def _gate(self, rule: dict, rec: dict) -> None:
        fault = rule["fault"]
        try:  # the first matching write claims the gate, in whichever process it runs
            os.rename(os.path.join(self.control, RULE), os.path.join(self.control, f"{RULE}.taken.{os.getpid()}"))
        except FileNotFoundError:
            return
        gate = os.path.join(self.control, f"gate.{fault}")
        open(gate, "w").close()
        at = os.path.join(self.control, "at")
        os.makedirs(at, exist_ok=True)
        tmp = os.path.join(at, f".{fault}.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(dict(rec, point="write"), f)
        os.replace(tmp, os.path.join(at, f"{fault}.json"))
        deadline = time.time() + float(rule.get("hold_s", 30.0))
        while os.path.exists(gate) and time.time() < deadline:
            time.sleep(0.01)
        _append(self.control, dict(rec, outcome="held", t1=time.time(), blocked_s=time.time() - rec["t0"]))

    def get_type_name(self):
        return "cf-ray-soak"


__all__ = ["EVENTS", "RULE", "SoakStorage", "clear_rule", "read_events", "step_of", "write_rule"]
