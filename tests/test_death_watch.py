"""A test run that dies without a word names the test it died in, and why (``tests/death_watch.py``).

Ray's driver (the pytest process) ends with status 1, no traceback, no summary and no ``atexit``
handler when its node's raylet is gone; the watch ``conftest.py`` starts beside pytest says which
test was running and what the Ray session's logs say.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading

import death_watch
import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _stand_in(script: str) -> subprocess.Popen:
    """A process in pytest's place: writes the watch's lines on its stdout, then ends as ``script`` says."""
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)


def test_a_process_that_ends_without_done_is_reported_with_its_test_and_the_session_logs(tmp_path):
    logs = tmp_path / "session_x" / "logs"
    logs.mkdir(parents=True)
    (logs / "raylet.out").write_text(
        "[I] (raylet) started\n[C] (raylet) node_manager.cc:519: GCS consider this node to be dead.\n"
    )
    (logs / "python-core-driver-01_7.log").write_text(
        "[W] connection.cc:216: The connection to the plasma store is failed. Terminate the process.\n"
    )
    proc = _stand_in(
        "import os\n"
        "os.write(1, b'test tests/test_a.py::test_one\\n')\n"
        f"os.write(1, b'session {tmp_path / 'session_x'}\\ntest tests/test_a.py::test_two\\n')\n"
        "os._exit(1)\n"
    )
    out = io.StringIO()
    assert proc.stdout is not None
    assert death_watch.watch(proc.pid, proc.stdout, out) is False
    proc.wait()
    text = out.getvalue()
    assert f"pytest process (pid {proc.pid}) ended without finishing" in text
    assert "during tests/test_a.py::test_two." in text
    assert "raylet.out: [C] (raylet) node_manager.cc:519: GCS consider this node to be dead." in text
    assert "The connection to the plasma store is failed. Terminate the process." in text
    assert "started" not in text  # only the lines that say why


def _watch_in_time(proc: subprocess.Popen, out: io.StringIO) -> bool:
    """``watch`` of ``proc``, which must return within 30 s although a fork of it holds the pipe."""
    result: list[bool] = []
    assert proc.stdout is not None
    t = threading.Thread(target=lambda: result.append(death_watch.watch(proc.pid, proc.stdout, out)), daemon=True)
    t.start()
    t.join(timeout=30)
    assert result, "the watch waited for the fork that holds the pipe, not for the process"
    return result[0]


def test_a_run_that_says_done_ends_the_watch_quietly_and_a_fork_cannot_hide_an_end(tmp_path):
    # Each stand-in forks a child that holds the pipe's write end past the stand-in's own end.
    fork = (
        "import os, time\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    time.sleep(600); os._exit(0)\n"
        f"open({str(tmp_path / 'fork.pid')!r}, 'w').write(str(child))\n"
    )
    for script, finished in (
        (fork + "os.write(1, b'test tests/test_a.py::test_one\\ndone\\n'); os._exit(0)\n", True),
        (fork + "os.write(1, b'test tests/test_a.py::test_one\\n'); os._exit(1)\n", False),
    ):
        proc = _stand_in(script)
        out = io.StringIO()
        try:
            assert _watch_in_time(proc, out) is finished
        finally:
            proc.wait()
            os.kill(int((tmp_path / "fork.pid").read_text()), signal.SIGKILL)
        if finished:
            assert out.getvalue() == ""
        else:
            assert "during tests/test_a.py::test_one." in out.getvalue()


@pytest.mark.skipif(
    os.environ.get("CF_RAY_TESTS_KILL_OWN_RAYLET") != "1",
    reason="run by test_a_pytest_run_whose_raylet_dies_says_which_test_and_why in a pytest of its own",
)
def test_the_raylet_of_this_driver_dies():
    import time

    import psutil
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="WARNING")
    (raylet,) = [p for p in psutil.Process().children(recursive=True) if p.name() == "raylet"]
    raylet.kill()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the driver's next use of the object store ends this process
        ray.get(ray.put(b"x"), timeout=5)
        time.sleep(0.5)


@pytest.mark.slow
def test_a_pytest_run_whose_raylet_dies_says_which_test_and_why(tmp_path):
    """The whole chain, real: a pytest whose test's raylet is SIGKILLed ends with status 1 and no
    summary (Ray's doing), and the watch names that test and the driver's last words."""
    env = dict(os.environ, CF_RAY_TESTS_KILL_OWN_RAYLET="1")
    env.pop("CF_RAY_TESTS_DEATH_WATCH", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"{TESTS_DIR}/test_death_watch.py::test_the_raylet_of_this_driver_dies",
        ],
        cwd=os.path.dirname(TESTS_DIR),
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert not re.search(r"\d+ (passed|failed)", out), out  # no summary: the process was ended
    assert "during tests/test_death_watch.py::test_the_raylet_of_this_driver_dies." in out, out
    assert "Terminate the process" in out or "Raylet is terminated" in out, out
