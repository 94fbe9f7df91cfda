"""cf_ray's background at idle CPU priority (issue 25, ``cf_ray/_engine/priority.py``): in process,
with the kernel's real scheduler. What gets lowered in a run (the controller's actor, the holder's
writer) is asserted where they run: test_control_plane.py and test_node.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from cf_ray._engine import priority

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


def _env() -> dict:
    """A subprocess's environment that imports this cf_ray."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def _in_thread(fn):
    """``fn()`` on a new thread (the policies set here must not reach pytest's own), its result."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(60)
    return out[0]


def test_background_work_runs_at_idle_priority_and_work_with_a_deadline_goes_back():
    def run():
        prio = priority.ThreadPriority("a test thread")
        seen = [os.sched_getscheduler(0)]
        prio.set_for(False)
        seen.append(os.sched_getscheduler(0))
        prio.set_for(True)
        seen.append(os.sched_getscheduler(0))
        prio.set_for(False)
        seen.append(os.sched_getscheduler(0))
        return seen

    if os.geteuid() != 0:
        pytest.skip("leaving SCHED_IDLE needs CAP_SYS_NICE; the refusal is tested below")
    assert _in_thread(run) == [os.SCHED_OTHER, os.SCHED_IDLE, os.SCHED_OTHER, os.SCHED_IDLE]


def test_a_refused_return_to_normal_priority_is_said_once_and_the_work_goes_on():
    """Without CAP_SYS_NICE (a container's default) the kernel refuses to leave SCHED_IDLE: the
    preemption checkpoint is written at idle priority, and the log says so once, naming the fix."""
    code = textwrap.dedent(
        """
        import logging, os, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
        from cf_ray._engine import priority
        if os.geteuid() == 0:
            os.setgid(65534); os.setuid(65534)  # nobody: no capability left (imports done as root)
        prio = priority.ThreadPriority("the holder's writer")
        prio.background()
        print([os.sched_getscheduler(0) for _ in (prio.urgent(), prio.urgent(), prio.urgent())])
        """
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    assert got.returncode == 0, got.stderr
    lines = got.stdout.strip().splitlines()
    assert lines[-1] == str([os.SCHED_IDLE] * 3), got.stdout
    said = [x for x in lines if "could not leave idle CPU priority" in x]
    assert len(said) == 1 and "CF_RAY_IDLE_PRIORITY=0" in said[0], got.stdout


def test_lowering_the_process_reaches_every_thread_and_the_threads_made_after(tmp_path):
    """The controller's actor lowers its process at its start: Ray's threads made before it, and
    every thread made after it (they inherit the policy of the thread that makes them)."""
    code = textwrap.dedent(
        """
        import os, threading
        ev = threading.Event()
        before = threading.Thread(target=ev.wait); before.start()
        from cf_ray._engine import priority
        n = priority.lower_process()
        policies = []
        after = threading.Thread(target=lambda: policies.append(os.sched_getscheduler(0))); after.start(); after.join()
        tasks = os.listdir("/proc/self/task")
        policies += [os.sched_getscheduler(int(t)) for t in tasks]
        ev.set(); before.join()
        print(n, len(tasks), sorted(set(policies)))
        """
    )
    env = _env()
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert got.returncode == 0, got.stderr
    n, tasks, policies = got.stdout.split(" ", 2)
    assert int(n) == int(tasks) >= 2 and policies.strip() == str([os.SCHED_IDLE]), got.stdout
    off = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "CF_RAY_IDLE_PRIORITY": "0"},
    )
    assert off.stdout.split(" ", 2)[0] == "0" and str([os.SCHED_OTHER]) in off.stdout, off.stdout


def test_a_bad_setting_says_what_to_change(monkeypatch):
    monkeypatch.setenv("CF_RAY_IDLE_PRIORITY", "yes")
    with pytest.raises(ValueError, match=r"CF_RAY_IDLE_PRIORITY='yes' is not a number"):
        priority.enabled()


def test_an_idle_thread_yields_its_core_and_its_wait_is_counted_apart():
    """A thread at idle priority and a busy process of normal priority on one core: the process gets
    the core, the thread almost nothing, and what the thread waited is what ``cpu_wait_s`` reports
    (the writer leaves it out of ``persist_s``)."""
    cpu = min(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        time.sleep(0.5)  # the competitor is running

        def spin():
            os.sched_setaffinity(0, {cpu})
            priority.ThreadPriority("a test thread").background()
            w0, c0, t0 = priority.cpu_wait_s(), time.thread_time(), time.monotonic()
            while time.monotonic() - t0 < 1.5:
                pass
            return priority.cpu_wait_s() - w0, time.thread_time() - c0

        waited, ran = _in_thread(spin)
    finally:
        busy.kill()
        busy.wait()
    assert ran < 0.3, (waited, ran)  # the busy process had the core
    assert waited > 1.0, (waited, ran)  # and the thread's wait for it is counted
