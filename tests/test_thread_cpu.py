"""The per-thread CPU sampler of the benchmarks (``benchmarks/thread_cpu.py``), on this process."""

import ctypes
import threading

from benchmarks import thread_cpu


def _named(name: bytes, body) -> threading.Thread:
    def run():
        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME: the thread's kernel name
        body()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_the_sampler_charges_each_threads_cpu_to_its_name_only_while_the_process_it_waits_for_runs():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    busy = _named(b"cf-test-busy", spin)
    idle = _named(b"cf-test-idle", lambda: stop.wait())
    try:
        used, counted = thread_cpu.sample(2.0, interval_s=0.5, wanted=lambda cmd: "python" in cmd or "pytest" in cmd)
        none, not_counted = thread_cpu.sample(1.0, interval_s=0.5, while_present="no-such-process-cf-test")
    finally:
        stop.set()
        busy.join(5)
        idle.join(5)
    by_name = {name: v for (_, name), v in used.items()}
    assert counted >= 1.5
    assert by_name.get("cf-test-busy", 0.0) > 300.0, by_name  # a spinning thread: most of a core
    assert by_name.get("cf-test-idle", 0.0) < 50.0, by_name
    assert none == {} and not_counted == 0.0
    table = thread_cpu.render(used, counted)
    assert "| cf-test-busy |" in table and "ms per second" in table


def test_a_ray_workers_role_is_its_class_whatever_method_runs():
    assert thread_cpu.role_of("ray::RayTrainWorker.train_fn") == "ray::RayTrainWorker"
    assert thread_cpu.role_of("ray::Holder") == "ray::Holder"
    assert thread_cpu.role_of("/x/site-packages/ray/core/src/ray/raylet/raylet --a=b") == "raylet"
