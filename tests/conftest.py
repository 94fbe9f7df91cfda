"""Shared fixtures: one local Ray cluster per test session, a real S3 server on loopback."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "promise: a NIGHTLY-listed real run that proves a promise of the README, the benchmark jobs left out "
        "(`make test-promises`)",
    )
    _start_death_watch(config)
    # Bytecode of cf_ray, the benchmarks and the tests for every Ray process the suite starts
    # (benchmarks/bytecode.py: without it each compiled ~100 modules again where
    # PYTHONDONTWRITEBYTECODE is set).
    sys.path.insert(0, os.path.dirname(TESTS_DIR))
    try:
        from benchmarks.bytecode import precompile
    finally:
        sys.path.pop(0)
    precompile()


_EXIT_STATUS: list[int] = []

#: The pipe to ``death_watch.py`` (a line per test, the Ray session, ``done`` at the end) and its process.
_WATCH: list = []


def _start_death_watch(config) -> None:
    """Start ``tests/death_watch.py`` beside pytest, on pytest's real stdout and stderr: if this
    process ends without finishing (Ray's driver ends with status 1 and no traceback when its raylet
    is gone), the watch prints which test was running and what the Ray session's logs say.
    ``CF_RAY_TESTS_DEATH_WATCH=0`` leaves it out."""
    if os.environ.get("CF_RAY_TESTS_DEATH_WATCH") == "0":
        return
    r, w = os.pipe()
    capman = config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
        proc = subprocess.Popen(
            [sys.executable, os.path.join(TESTS_DIR, "death_watch.py"), str(os.getpid())],
            stdin=r,
            start_new_session=True,  # a signal to pytest's process group does not end the watch
        )
    os.close(r)
    _WATCH[:] = [w, proc]  # the Popen kept: it runs past this process, by design


def _tell_watch(line: str) -> None:
    if not _WATCH:
        return
    try:
        os.write(_WATCH[0], (line + "\n").encode())
    except OSError:  # the watch is gone: nothing more to tell it
        _WATCH.clear()


def _tell_watch_ray_session() -> None:
    worker = sys.modules.get("ray._private.worker")
    node = getattr(worker, "_global_node", None) if worker is not None else None
    if node is not None:
        _tell_watch(f"session {node.get_session_dir_path()}")


def pytest_runtest_logstart(nodeid, location):  # noqa: ARG001 - pytest's hook signature
    _tell_watch(f"test {nodeid}")
    _tell_watch_ray_session()


def pytest_runtest_call(item):  # noqa: ARG001 - pytest's hook signature
    _tell_watch_ray_session()  # the test's fixtures may have started (another) Ray


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001 - pytest's hook signature
    _EXIT_STATUS[:] = [int(exitstatus)]


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):  # noqa: ARG001 - pytest's hook signature
    """End the test process with the session's exit status once pytest is done with everything (the
    summary printed, its files written), skipping the interpreter's teardown: native libraries'
    finalizers have crashed it after every test passed (a segmentation fault in one clean-clone CI
    run, ``terminate called after throwing an instance of 'std::bad_alloc'`` in a local run; pyarrow's
    S3 finalization at exit is a known cause, apache/arrow#38352), turning a green suite red.
    ``CF_RAY_TESTS_FULL_EXIT=1`` keeps the normal teardown (to look for such a crash)."""
    _tell_watch("done")
    if not _EXIT_STATUS or os.environ.get("CF_RAY_TESTS_FULL_EXIT") == "1":
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ray():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")


@pytest.fixture(scope="session")
def _ray_session():
    """Environment for every local Ray cluster the tests start, and a shutdown at the end.

    Set here, it reaches the cluster's processes (they inherit it at start): the tests' directory
    and the repository's root on PYTHONPATH so workers can import test helpers and the soak's probes
    (``benchmarks/``), and short timings.
    """
    import ray
    from ray._private import auto_init_hook

    # Every test starts the Ray it uses itself (ray_cluster, the benchmark's own, a multi-node
    # Cluster): no call of a thread a test left behind (a Checkpointer's poll, a holder part in
    # process) may start a local Ray of its own after a test shut the shared one down, which would
    # then run beside the next test's cluster (or make the benchmark's ray.init fail).
    auto_init_hook.enable_auto_connect = False
    paths = (TESTS_DIR, os.environ.get("PYTHONPATH"), os.path.dirname(TESTS_DIR))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    os.environ.setdefault("CF_RAY_CONTROLLER_LINGER_S", "5")
    os.environ.setdefault("CF_RAY_REAPER_INTERVAL_S", "1")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # The GCS marks a node dead after 5 health checks unanswered within 10 s each: on a machine
    # starved by parallel work a raylet stalled that long is told it is dead and exits, and the
    # driver (this process) ends with it, without a word (tests/death_watch.py then says why). 60 s
    # each tolerates the stall; a node a test removes refuses the checks at once and is still found
    # dead in seconds.
    os.environ.setdefault("RAY_health_check_timeout_ms", "60000")
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_cluster(_ray_session):
    """A local 2-CPU Ray cluster shared by the tests that need one (``address="local"``: never a
    cluster that something else started on this machine). Started again if a test shut it down
    (the benchmark's smoke test starts its own)."""
    import ray

    if not ray.is_initialized():
        _start_ray()
    yield ray


@pytest.fixture
def controller(tmp_path):
    """Builds controllers in process, without Ray (``tests/controller_harness.py``): the actor's own
    class on local storage under ``tmp_path`` (or the ``root`` given), holders and cluster facts as
    stand-ins. Their maintenance threads stop at the end of the test."""
    import controller_harness

    made = []

    def make(root=None, key: str = "test", **kw):
        ctl = controller_harness.make_controller(tmp_path if root is None else root, key, **kw)
        made.append(ctl)
        return ctl

    yield make
    for ctl in made:
        ctl._maintenance.stop()


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 endpoint (moto's server mode) on 127.0.0.1, for the whole session."""
    pytest.importorskip("moto")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError("moto server did not start")
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        os.environ.setdefault(k, v)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def s3_bucket(s3_endpoint, request):
    """(pyarrow S3FileSystem, bucket name): a fresh bucket on the loopback S3 server."""
    import boto3
    import pyarrow.fs as pafs

    name = "b" + str(abs(hash(request.node.nodeid)) % 10**10) + str(int(time.time() * 1000) % 10**6)
    boto3.client(
        "s3",
        endpoint_url=f"http://{s3_endpoint}",
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket=name)
    fs = pafs.S3FileSystem(
        endpoint_override=s3_endpoint,
        scheme="http",
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
        allow_bucket_creation=False,
    )
    return fs, name


@pytest.fixture(scope="session")
def reference(_ray_session, tmp_path_factory):
    """The uninterrupted run of ``test_engine_e2e.SMALL`` (2 workers, the demo's loop) that the fault
    tests of several modules compare with, bitwise: run once per session, on the shared cluster."""
    import ray
    import test_engine_e2e as e2e

    from cf_ray import demo

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    root = tmp_path_factory.mktemp("reference")
    demo.run("reference", str(root), e2e.SMALL)
    out = root / "out" / "reference"
    e2e.assert_exactly_once(e2e.lineage(out), e2e.SMALL["samples"], e2e.SMALL["epochs"])
    return out


#: Modules that shut the shared local cluster down for clusters of their own: run last, so that the
#: shared cluster is started once (starting it again after them cost ~25 s of suite time).
_RUN_LAST = ("test_bench.py", "test_multinode.py", "test_soak.py")


#: The long end-to-end runs that ``make test`` leaves to ``make test-all`` (the nightly run), beside the
#: tests marked ``nightly`` where they are written (the benchmark jobs). The default suite keeps one
#: real run of each promise (a SIGKILL restored bitwise from memory and from S3, a node lost and
#: restored from a peer's copy (each exactly once against the reference), FSDP2, the DDP example and the
#: runnable guide blocks, a dead driver's actors reaped) and the in-process tests of everything below; each of these
#: asserts a behaviour that one of those, or an in-process test, also covers at a smaller scale.
NIGHTLY = {
    # fault matrix under TorchTrainer; in process: test_trust, test_durability, test_control_plane, test_lifetime
    "test_faults_e2e.py::*",
    "test_engine_e2e.py::test_a_worker_killed_mid_copy_resumes_from_the_previous_snapshot_in_memory_bitwise",
    "test_engine_e2e.py::test_damaged_newest_checkpoints_are_skipped_on_restore",  # test_restore, test_storage
    "test_engine_e2e.py::test_failed_persist_never_fails_training",  # test_durability
    "test_engine_e2e.py::test_keep_last_and_milestones_while_training",  # test_controller
    "test_engine_e2e.py::test_registered_with_ray_and_a_new_run_resumes_from_one_of_them",
    "test_engine_e2e.py::test_resume_from_the_result_checkpoint_continues_bitwise_and_a_bad_one_raises_before_training",
    "test_engine_e2e.py::test_upload_tier_serves_the_restore_when_the_primary_is_lost",
    "test_restore.py::test_a_restore_error_on_one_rank_fails_every_rank_within_seconds",
    # several nodes on one machine: the default suite keeps a node loss restored from a peer's copy
    "test_multinode.py::test_a_drain_that_fits_a_peer_copy_but_not_storage_restores_from_the_peer",
    "test_multinode.py::test_a_drain_too_short_for_any_tier_leaves_the_previous_checkpoint_the_latest",
    "test_multinode.py::test_elastic_two_one_two_with_real_num_workers_range",
    # restored step 5 from storage in 2 whole suites of 4 before the peer reported its own copies and
    # the test waited for them; nightly: make test has no room for its ~100 s (issue 28's note)
    "test_multinode.py::test_node_loss_restores_from_a_peer_copy_bitwise[1]",
    "test_multinode.py::test_node_loss_restores_from_a_peer_copy_bitwise[2]",
    "test_multinode.py::test_node_loss_restores_from_a_peer_copy_bitwise[4]",
    "test_multinode.py::test_node_loss_while_a_copy_is_in_flight_never_restores_that_step",
    "test_multinode.py::test_replicas_go_to_another_pool_never_to_a_draining_node",
    "test_spot.py::test_deadline_too_short_for_the_persist_keeps_the_previous_checkpoint",  # test_controller (JIT)
    "test_spot.py::test_two_one_two_workers_within_an_epoch_exactly_once_and_same_weights[fsdp2]",  # test_restore (elastic)
    "test_docs.py::test_example_spot_training_runs",
    "test_docs.py::test_example_train_fsdp_runs_and_resumes_resharded",  # test_fsdp2 scenarios
    "test_fsdp2.py::test_sharded_worker_sigkilled_resumes_bitwise[fsdp1-memory]",
    # frameworks and data sources under TorchTrainer; in process: test_integrations, tests/data/
    "test_integrations_e2e.py::*",
    "test_e2e_data.py::test_ray_data_shards_exactly_once_across_a_failure",
    # every default SIGKILL run above checks exactly-once against the reference's lineage
    "test_e2e_data.py::test_exactly_once_per_epoch_across_injected_failures",
    "test_ray_elastic.py::test_ray_data_two_one_two_workers_mid_epoch_reads_every_row_once",
    "test_stateful_dataloader.py::test_stateful_dataloader_exactly_once_after_a_sigkill",
    "test_data_examples.py::test_data_sources_example_ray_data_runs",
    # the policy and the controller at scale; in process: test_policy, test_control_plane[blocks]
    "test_adaptive_e2e.py::*",
    "test_control_plane.py::test_the_controller_stays_flat_through_10000_commits[tracemalloc]",
    "test_soak.py::test_the_soak_runs_a_schedule_on_a_multinode_cluster_and_every_check_holds",
    "test_bench.py::test_bench_fsdp2_job",  # a benchmark job; test_bench_smoke stays
    # the user's-loop benchmark, eight TorchTrainer fits (~100 s): run by make test-promises (CI), as
    # make test came to 15 minutes; test_bench_smoke stays in make test
    "test_bench.py::test_bench_user_loop",
    "test_control_plane.py::test_the_controller_stays_flat_through_10000_commits[blocks]",  # 10,000 commits
    # minutes each on 2 cores; in the default suite: test_report (metrics in an actor), test_spot
    # (SIGTERM in the main thread), test_notebooks (the committed notebook is the generated one, and
    # its section 4 run in a kernel: the interrupted fit resumes mid-run)
    "test_notebooks.py::test_the_notebook_runs_and_gives_the_committed_outputs",
    "test_goodput.py::test_goodput_is_exported_to_rays_metrics_endpoint",
    "test_spot.py::test_sigterm_notice_checkpoint_durable_then_resume_loses_at_most_one_step",
}


#: NIGHTLY entries that are benchmark jobs, not the proof of a promise: ``make test-promises`` (marker
#: ``promise``: the rest of NIGHTLY) leaves them, and the jobs marked ``nightly`` in their files, to
#: ``make test-all``.
_BENCHMARK_JOBS = {"test_bench.py::test_bench_fsdp2_job"}


def _nightly(item) -> bool:
    name = os.path.basename(str(item.fspath))
    return f"{name}::*" in NIGHTLY or f"{name}::{item.name}" in NIGHTLY


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest's hook signature
    known = {f"{os.path.basename(str(i.fspath))}::{i.name}" for i in items} | {
        f"{os.path.basename(str(i.fspath))}::*" for i in items
    }
    if len(items) > 600:  # the whole suite was collected: a name that no longer exists is a mistake
        stale = sorted(NIGHTLY - known)
        assert not stale, f"tests/conftest.py NIGHTLY names tests that do not exist: {stale}"
    for item in items:
        if _nightly(item):
            item.add_marker(pytest.mark.nightly)
            if f"{os.path.basename(str(item.fspath))}::{item.name}" not in _BENCHMARK_JOBS:
                item.add_marker(pytest.mark.promise)

    def order(item) -> int:
        name = os.path.basename(str(item.fspath))
        return _RUN_LAST.index(name) + 1 if name in _RUN_LAST else 0

    items.sort(key=order)  # stable: the order within each group is kept
