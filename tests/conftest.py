"""Shared fixtures: one local Ray cluster per test session, a real S3 server on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


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
    on PYTHONPATH so workers can import test helpers, and short timings.
    """
    import ray

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("CF_RAY_CONTROLLER_LINGER_S", "5")
    os.environ.setdefault("CF_RAY_REAPER_INTERVAL_S", "1")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
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


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest's hook signature
    def order(item) -> int:
        name = os.path.basename(str(item.fspath))
        return _RUN_LAST.index(name) + 1 if name in _RUN_LAST else 0

    items.sort(key=order)  # stable: the order within each group is kept
