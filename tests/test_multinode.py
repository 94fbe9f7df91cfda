"""Several Ray nodes on this machine (issue #12): ``ray.cluster_utils.Cluster`` starts a head with no
CPUs and worker nodes of one CPU each (each its own raylet, object store and node id), so the two
ranks of a ``TorchTrainer`` run on two nodes, and a node can be drained and lost for real: a
drain with a deadline, a node lost with and without a copy of its snapshots on the other node, a
real elastic resize (``num_workers=(1, 2)``: 2 -> 1 -> 2), and a node lost while its copies are in
flight. A real drain whose deadline fits storage is run by the spot example
(``tests/test_docs.py::test_example_spot_training_runs``), on a cluster of the same shape. Each test
that removes a node adds one, so the next test has two worker nodes again.

The shared test cluster is shut down for this module (a driver talks to one cluster at a time) and
started again by the next test that asks for ``ray_cluster``.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time

import holder_hooks
import pytest
import test_engine_e2e as e2e
from test_faults_e2e import STEPS, _controllers_of, _newest_step

from cf_ray import demo

pytestmark = pytest.mark.slow

#: Each node's object store: small, three nodes share this machine's memory.
OBJECT_STORE_BYTES = 150 * 1024 * 1024


@pytest.fixture(scope="module")
def multinode(_ray_session, reference):
    """``(cluster, [node_a, node_b])``: a head with no CPUs and two 1-CPU worker nodes on loopback;
    this process is its driver. ``reference`` is taken first, on the shared cluster."""
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    mp = pytest.MonkeyPatch()
    # Loopback stays loopback (see test_lifetime.loopback_env): the processes the cluster starts read
    # the variable, this one read it at import.
    mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray Train polls the GCS for draining nodes every 5 s by default; 0.5 s lets the drain tests run
    # with deadlines of a few seconds. Ray Train propagates it from the driver (this process) to its
    # controller, where its PreemptionCallback reads it.
    mp.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")
    mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
            "node_ip_address": "127.0.0.1",
            "object_store_memory": OBJECT_STORE_BYTES,
        },
    )
    try:
        nodes = [
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=OBJECT_STORE_BYTES)
            for _ in range(2)
        ]
        cluster.wait_for_nodes()
        mp.setenv("RAY_ADDRESS", cluster.address)  # what the run's processes connect to, if they ask
        ray.init(address=cluster.address, logging_level="WARNING", _node_ip_address="127.0.0.1")
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
        mp.undo()


def _drain(address: str, node_id: str, deadline_s: int) -> None:
    """Ray's own drain path, as the autoscaler takes it for a preempted node: reason PREEMPTION and a
    deadline after which the node is force-killed (here: by the test)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "drain-node",
            "--address",
            address,
            "--node-id",
            node_id,
            "--reason",
            "DRAIN_NODE_REASON_PREEMPTION",
            "--reason-message",
            "spot instance reclaimed (test)",
            "--deadline-remaining-seconds",
            str(deadline_s),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )


def _drained_run(multinode, tmp_path, name: str, cfg: dict, *, deadline_s: int, ready, slow=None, stall=None) -> dict:
    """Train run ``name`` on nodes A and B; once ``ready()`` is true, drain B through Ray's drain path
    (reason preemption, ``deadline_s``), add a node C for the restarted group, and remove B at the
    deadline (the spot node is gone). Returns ``out`` (the demo's output directory), ``t_drain``,
    ``removed_at`` and ``manifests_at_removal`` (the committed step directories right after B went,
    when ``cfg`` names a storage path), once the run has finished. ``slow``: a file that exists until
    B is gone; ``stall``: one that exists from the drain until B is gone (``SlowAttemptHandler``'s)."""
    cluster, (_, node_b) = multinode
    fitted: dict = {}

    def train():
        try:
            fitted["result"] = demo.run(name, str(tmp_path), cfg)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            fitted["error"] = e

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    deadline = time.time() + 240
    while time.time() < deadline and not ready() and trainer.is_alive():
        time.sleep(0.05)
    assert ready(), fitted
    if stall is not None:
        stall.touch()
    t_drain = time.time()
    _drain(cluster.address, node_b.node_id, deadline_s)
    # Cluster operations belong to this (the main) thread; capacity for the restarted group.
    added = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=OBJECT_STORE_BYTES)
    multinode[1][1] = added  # the node a later test of this module takes away
    while time.time() < t_drain + deadline_s:
        time.sleep(0.05)
    removed_at = time.time()
    cluster.remove_node(node_b)  # the deadline: the spot node is gone
    root = cfg.get("storage_path")
    manifests = sorted(glob.glob(f"{root}/{name}/cf_ray/checkpoints/step_*/MANIFEST.json")) if root else []
    for flag in (slow, stall):
        if flag is not None:
            flag.unlink()
    trainer.join(300)
    assert not trainer.is_alive(), "the run did not finish after the drain"
    assert "error" not in fitted, fitted
    return {
        "out": tmp_path / "out" / name,
        "t_drain": t_drain,
        "removed_at": removed_at,
        "manifests_at_removal": [os.path.basename(os.path.dirname(m)) for m in manifests],
    }


def _committed_on(root) -> bool:
    return bool(glob.glob(f"{root}/checkpoints/step_*/MANIFEST.json"))


def _slow_first_attempt_cfg(tmp_path, replicas: int, stall=None) -> dict:
    """Storage that takes 3 s per data file of the first attempt until node B is gone (the file
    ``tmp_path/slow``, made here): the holder of rank 0 writes two sections (``shared`` and its
    own), so the slowest holder's measured persist time is 6 s, more than the 6 s drain deadline
    leaves once the notice has reached the workers and the checkpoint is staged (1.5-3 s later on
    this machine)."""
    import pyarrow.fs as pafs

    from faulty_fs import SlowAttemptHandler

    (tmp_path / "slow").touch()
    return dict(
        e2e.SMALL,
        keep_last=None,
        step_sleep=0.6,
        replicas=replicas,
        storage_path=str(tmp_path / "ckpts"),
        storage_filesystem=pafs.PyFileSystem(
            SlowAttemptHandler(1, 3.0, str(tmp_path / "slow"), None if stall is None else str(stall))
        ),
    )


def test_a_drain_too_short_for_any_tier_leaves_the_previous_checkpoint_the_latest(multinode, reference, tmp_path):
    """Storage at 3 s per section, replication off, and a 6 s drain deadline: the just-in-time
    checkpoint can be safe only on storage, which does not make it (the row: never safe, the
    deadline missed). Node B goes at the deadline, its holder in the middle of writing
    (storage stalls from the drain on, so whichever node B is, its sections are never finished):
    nothing of the checkpoint is visible — no manifest of its step, not listed by
    ``cf_ray.list_checkpoints``, the committed steps are the scheduled ones — and the restarted group
    resumes from the previous committed checkpoint on storage, replays, and ends bitwise equal to the
    uninterrupted run."""
    import cf_ray

    name = "tooshort"
    stall = tmp_path / "stall"  # storage stalls from the drain until the node is gone (never writes in time)
    cfg = _slow_first_attempt_cfg(tmp_path, replicas=0, stall=stall)
    root = tmp_path / "ckpts" / name / "cf_ray"
    run = _drained_run(
        multinode,
        tmp_path,
        name,
        cfg,
        deadline_s=6,
        ready=lambda: _committed_on(root),
        slow=tmp_path / "slow",
        stall=stall,
    )
    out = run["out"]
    res = e2e.result_of(out)
    (jit,) = [r for r in res["profile"] if r.get("kind") == "preempt"]
    assert jit["notice_source"] == "ray" and jit["generation"] == 1, jit
    assert jit["jit_needs_copy"] >= 1 and 0 < jit["jit_left_s"] <= 6, jit  # the drained node's sections
    assert not jit["committed"] and jit["made_deadline"] is False and jit.get("safe_tier") is None, jit
    jit_step = jit["step"]
    # Right after the node went: the committed steps are scheduled ones (every 5 steps), none of the JIT step.
    assert run["manifests_at_removal"] and f"step_{jit_step}" not in run["manifests_at_removal"]
    assert all(int(d.split("_")[1]) % 5 == 0 for d in run["manifests_at_removal"]), run
    first, second = e2e.resumes(out)[:2]
    assert first["source"] == "fresh"
    assert second["source"] == "storage" and second["step"] < jit_step and second["step"] % 5 == 0, (second, jit)
    # Nothing of the first attempt's JIT step was ever committed (a later attempt may checkpoint the
    # same step number: not of generation 1).
    listed = {c.step for c in cf_ray.list_checkpoints(str(root))}
    if jit_step in listed:
        from cf_ray._engine.format.commit import read_manifest
        from cf_ray._engine.format.layout import step_dir
        from cf_ray._engine.storage.fs import FsStorage

        assert read_manifest(FsStorage.from_uri(str(root)), step_dir(jit_step)).generation > 1
    assert e2e.lineage(out) == e2e.lineage(reference)
    assert demo.states_equal(reference / "final_state.pt", out / "final_state.pt")
    assert res["steps"] == STEPS


def test_a_drain_that_fits_a_peer_copy_but_not_storage_restores_from_the_peer(multinode, reference, tmp_path):
    """Storage at 3-6 s per holder (too slow for a 6 s drain deadline), peer copies at milliseconds:
    the just-in-time checkpoint is safe once the drained node's sections have a copy in node A's
    holder (before the deadline; storage goes on in the background, and cannot finish before the
    node goes), the row records the time to that copy, and the restarted group restores that
    checkpoint from the peer's memory: no step lost, every sample once, bitwise."""
    name = "peertier"
    cfg = _slow_first_attempt_cfg(tmp_path, replicas=1)
    root = tmp_path / "ckpts" / name / "cf_ray"
    run = _drained_run(
        multinode, tmp_path, name, cfg, deadline_s=6, ready=lambda: _committed_on(root), slow=tmp_path / "slow"
    )
    out = run["out"]
    res = e2e.result_of(out)
    (jit,) = [r for r in res["profile"] if r.get("kind") == "preempt"]
    assert jit["notice_source"] == "ray" and jit["jit_needs_copy"] >= 1, jit
    assert jit["safe_tier"] == "peer" and jit["made_deadline"] is True, jit
    assert jit["actual_peer_s"] <= jit["jit_left_s"] and jit["safe_unix"] <= jit["deadline_unix"], jit
    print(
        f"JIT: left {jit['jit_left_s']:.2f} s, safe in a peer's memory after {jit['actual_peer_s']:.3f} s "
        f"(storage: {jit.get('actual_storage_s')})"
    )
    jit_step = jit["step"]
    assert f"step_{jit_step}" not in run["manifests_at_removal"]  # storage did not make it before the node went
    first, second = e2e.resumes(out)[:2]
    assert first["source"] == "fresh"
    assert (second["source"], second["step"]) == ("memory", jit_step), (second, jit)  # the peer's copy
    rec = e2e.lineage(out)
    assert (0, jit_step) not in rec and (0, jit_step + 1) in rec  # no step lost (training held in step())
    assert rec == {k: v for k, v in e2e.lineage(reference).items() if k[1] != jit_step}
    assert demo.states_equal(reference / "final_state.pt", out / "final_state.pt")
    assert res["steps"] == STEPS


@pytest.mark.parametrize("every", [1, 2, 4])
def test_node_loss_restores_from_a_peer_copy_bitwise(multinode, reference, tmp_path, every):
    """The node of one rank is lost (removed without notice) mid-run, with ``replicas=1``: the
    restarted group restores the newest snapshot every section of which survives on the other node
    — the lost rank's sections from the peer's copies, the survivor's from its own holder — although
    the lost node's holder died with it; every sample once and the final state bitwise equal to the
    uninterrupted run (``replicas=0`` restores from storage: the drain too short for any tier, above,
    loses a node with replication off, bitwise).

    ``replica_every=1``: storage is slow for step 10 (15 s), so memory is newer than storage when the
    node goes after step 12: the newest snapshot (step 10 or later) from memory, streamed to the
    replacement node's rank. ``replica_every`` 2 and 4 (issue 28): only steps 10 and 20, or 20, are
    copied; storage stalls from step 15 on (step 15's write holds one slot of each section for 30 s),
    and the node goes after step 25 was taken: step 20 — the newest copied step — from memory,
    though step 25 was taken since (it used the spare slot: the survivor kept its own sections of 20)."""
    import pyarrow.fs as pafs

    from faulty_fs import SlowHandler

    cluster, (node_a, node_b) = multinode
    name = f"nodeloss{every}"
    out = tmp_path / "out" / name
    slow = SlowHandler(10, 11, 15.0) if every == 1 else SlowHandler(15, STEPS + 1, 30.0, generation=1)
    cfg = dict(
        e2e.SMALL,
        keep_last=None,
        step_sleep=0.3 if every == 1 else 1.0,  # 2, 4: the node goes between steps 25 and 26
        replicas=1,
        replica_every=every,
        storage_path=str(tmp_path / "ckpts"),
        storage_filesystem=pafs.PyFileSystem(slow),
    )
    fitted: dict = {}

    def train():
        try:
            fitted["result"] = demo.run(name, str(tmp_path), cfg)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            fitted["error"] = e

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    deadline = time.time() + 240

    def newest() -> int:
        return max(_newest_step(out, r) for r in (0, 1))

    def wait_for_step(step: int) -> None:
        while time.time() < deadline and newest() < step and trainer.is_alive():
            time.sleep(0.05)
        assert newest() >= step, fitted

    wait_for_step(1)  # both ranks placed, one on each node: capacity for the restarted group now
    new_node = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=OBJECT_STORE_BYTES)
    wait_for_step(12 if every == 1 else 25)
    if every == 1:
        # The copies are made in the background (milliseconds for this state, seconds on a loaded
        # machine): the node goes once a step from 10 on has a copy of every section of its holder's.
        _wait_copied(name, node_b.node_id, node_a.node_id, since=10, deadline=deadline)
    else:
        time.sleep(0.4)
    lost_at = newest()
    cluster.remove_node(node_b)  # a spot node reclaimed: its raylet, object store, worker and holder gone
    multinode[1][1] = new_node  # the node a later test of this module takes away
    trainer.join(400)
    assert not trainer.is_alive(), "the run did not finish after the node loss"
    assert "error" not in fitted, fitted
    first, second = e2e.resumes(out)[:2]
    assert first["source"] == "fresh"
    res = e2e.result_of(out)
    if every == 1:
        assert second["source"] == "memory" and second["step"] >= 10, second
    else:
        assert lost_at == 25, f"the node went after step {lost_at}, not between steps 25 and 26 (a loaded machine?)"
        assert (second["source"], second["step"]) == ("memory", 20), second
    # The rank on the replacement node streamed its sections straight from the holder of the
    # surviving node; the other read its node's slots in place.
    read = [e2e.resumes(out, r)[1]["read_bytes"] for r in range(2)]
    assert sum(r.get("direct", 0) for r in read) > 0 and set().union(*read) <= {"direct", "in_place"}, read
    rows = {r["step"]: r for r in res["profile"] if r.get("generation") == 1}
    row = rows[second["step"]]
    assert row.get("replica_bytes", 0) > 0 and row.get("replica_s") is not None, row
    if every > 1:
        assert not rows[25].get("replica_bytes"), rows[25]  # not copied
    assert e2e.lineage(out) == e2e.lineage(reference)
    assert demo.states_equal(reference / "final_state.pt", out / "final_state.pt")


def test_replicas_go_to_another_pool_never_to_a_draining_node(multinode, tmp_path):
    """Three labelled nodes, two pools (``pool=spot-a`` twice, ``pool=spot-b``): a holder on a
    spot-a node chooses only the spot-b node's holder for its copies (never its own pool, never a
    node without the label), a spot-b holder only spot-a ones; once the spot-b node is draining
    (Ray's drain path), no spot-a holder chooses it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cf_ray._engine.node.holder import HolderActor
    from cf_ray._engine.storage.fs import FsStorage

    cluster, _ = multinode
    pools = {"a1": "spot-a", "a2": "spot-a", "b1": "spot-b"}
    nodes = {
        k: cluster.add_node(
            num_cpus=0, node_ip_address="127.0.0.1", object_store_memory=OBJECT_STORE_BYTES, labels={"pool": v}
        )
        for k, v in pools.items()
    }
    cluster.wait_for_nodes()
    namespace, key = "cf_ray_pools_test", "pools"
    storage = FsStorage.from_uri(str(tmp_path / "run"))
    holders = {
        k: HolderActor.options(
            name=f"cf_ray.holder.{key}.{n.node_id}",
            namespace=namespace,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n.node_id, soft=False),
        ).remote(storage, "cf_ray.controller.none", namespace, None)
        for k, n in nodes.items()
    }

    def peers(k: str) -> set[str]:
        got = ray.get(holders[k].__ray_call__.remote(lambda self: self._peers(3, "pool", "rank_00000")), timeout=60)
        return {nid for nid, _ in got}

    try:
        assert peers("a1") == {nodes["b1"].node_id}
        assert peers("a2") == {nodes["b1"].node_id}
        assert peers("b1") == {nodes["a1"].node_id, nodes["a2"].node_id}
        # Automatic (-1): one copy when the cluster has several nodes.
        assert len(ray.get(holders["b1"].__ray_call__.remote(lambda self: self._peers(-1, "pool", "x")))) == 1
        _drain(cluster.address, nodes["b1"].node_id, 60)
        assert peers("a1") == set() and peers("a2") == set()  # the only other pool's node is draining
    finally:
        for h in holders.values():
            ray.kill(h, no_restart=True)
        for n in nodes.values():
            cluster.remove_node(n)


# -- a real elastic resize: ScalingConfig(num_workers=(1, 2)), 2 -> 1 -> 2 ----------------------------------


def elastic_loop(cfg: dict) -> None:
    """The loop of the elastic test: ``test_spot``'s model, data and records, with pacing the test
    drives. The first attempt (two workers) stops stepping after step ``hold_at`` and waits there to
    be killed (the test removes a node meanwhile); with one worker every step takes ``slow_step_s``,
    so the group is still training when Ray Train grows it again."""
    import ray.train
    import ray.train.torch
    import test_spot as spot

    import cf_ray
    from cf_ray.data import ResumableDistributedSampler

    torch = spot.torch
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    out = cfg["out"]
    dataset = spot.IdDataset()
    sampler = ResumableDistributedSampler(dataset, rank=rank, world_size=world, shuffle=True, seed=0, pad=False)
    loader = spot.make_loader(dataset, sampler)
    model = ray.train.torch.prepare_model(spot.build_model())
    opt = spot.build_optimizer(model)
    config = cf_ray.CheckpointConfig(
        policy=cf_ray.FixedInterval(every=cfg["every"]),
        # RunConfig's storage and name (CheckpointBeforeResize finds the run's controller by them).
        storage_path=cfg["storage"],
        run_name=cfg["run"],
        register_with_ray=False,
        replication=cf_ray.config.Replication(copies=1),
        preemption=cf_ray.PreemptionConfig(hold_extra_s=0.0),
    )
    ck = cf_ray.Checkpointer({"model": model, "optimizer": opt}, data={"sampler": sampler}, config=config)
    resume = ck.restore()
    gen = resume.generation
    if rank == 0:
        with open(f"{out}/resume_gen{gen}.json", "w") as f:
            json.dump(
                {
                    "generation": gen,
                    "world_size": world,
                    "step": resume.step,
                    "epoch": resume.epoch,
                    "source": resume.source,
                    "saved_world_size": resume.saved_world_size,
                    "time": time.time(),
                },
                f,
            )
    ids_log = open(f"{out}/ids_seg0_gen{gen}_rank{rank}.jsonl", "w", buffering=1)
    for epoch in range(resume.epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        for ids, x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            # Logged before the step: a rank may end inside it (held at a just-in-time checkpoint).
            ids_log.write(json.dumps({"step": ck.step_count + 1, "epoch": epoch, "ids": ids.tolist()}) + "\n")
            ck.step(opt)
            opt.zero_grad()
            if gen == 1 and ck.step_count == cfg["hold_at"]:
                open(f"{out}/held_rank{rank}", "w").close()
                while True:  # until Ray Train kills this worker (the group fails when the test removes a node)
                    time.sleep(0.1)
            if world == 1:
                time.sleep(cfg["slow_step_s"])
        ck.end_epoch()
    bare = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    final = {k: v.detach().clone() for k, v in bare.state_dict().items()}
    if rank == 0:
        with open(f"{out}/result.json", "w") as f:
            json.dump({"profile": ck.profile_rows(), "events": ck.events(), "steps": ck.step_count}, f, default=str)
        torch.save(final, f"{out}/final_model.pt")
    ck.finish()


def _holder_of(run: str, node_id: str):
    """The holder actor of run ``run`` (its name) on node ``node_id`` (``None``: none yet), named as
    cf_ray names it (``naming.holder_name``) from the run's key, which its controller's name carries."""
    import ray

    from cf_ray._engine.protocol.naming import holder_name

    for ctl_name, ctl_ns in _controllers_of(ray, run):
        key = ctl_name.removeprefix("cf_ray.controller.")
        try:
            return ray.get_actor(holder_name(key, node_id), namespace=ctl_ns)
        except ValueError:
            pass
    return None


def _wait_copied(run: str, origin_node: str, peer_node: str, *, since: int, deadline: float) -> None:
    """Wait until, for some step ``>= since``, every section the holder of ``origin_node`` staged has
    a copy in the holder of ``peer_node`` (asked of both holders: what they hold, not what they said)."""
    import ray

    while time.time() < deadline:
        origin, peer = _holder_of(run, origin_node), _holder_of(run, peer_node)
        if origin is not None and peer is not None:
            staged: dict[int, set[str]] = {}
            for m in ray.get(origin.resync.remote(), timeout=30).staged:
                if m.step >= since:
                    staged.setdefault(m.step, set()).add(m.section)
            held = {(m.step, m.section) for m in ray.get(peer.resync.remote(), timeout=30).replicas}
            if any(all((step, sec) in held for sec in secs) for step, secs in staged.items()):
                return
        time.sleep(0.1)
    raise AssertionError(f"no step from {since} on was copied whole from node {origin_node} to {peer_node}")


def _coordinator_sees(node_ids_alive: set[str], node_ids_dead: set[str], timeout_s: float = 60.0) -> None:
    """Wait until Ray Train's AutoscalingCoordinator counts the nodes in ``node_ids_alive`` and none in
    ``node_ids_dead``. Without an autoscaler, it learns the cluster's nodes (``ray.nodes()``: alive
    ones, their total resources) only in its periodic tick (every 20 s, ``TICK_INTERVAL_S``) or
    when a request changes; the elastic policy reads its reservations. So the test runs that tick
    itself (``_tick()``: what the coordinator's own thread runs) instead of waiting up to 20 s."""
    import ray

    coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")

    def seen(self) -> set[str]:
        self._tick()
        return {nid for nodes in self._cluster_node_resources.values() for nid in nodes}

    deadline = time.time() + timeout_s
    while True:
        got = ray.get(coordinator.__ray_call__.remote(seen), timeout=30)
        if node_ids_alive <= got and not (node_ids_dead & got):
            return
        assert time.time() < deadline, f"the coordinator sees {got}, not {node_ids_alive} without {node_ids_dead}"
        time.sleep(0.2)


def _wait_for(path, trainer: threading.Thread, fitted: dict, timeout_s: float = 240.0) -> None:
    deadline = time.time() + timeout_s
    while not os.path.exists(path):
        assert trainer.is_alive() and time.time() < deadline, (str(path), fitted)
        time.sleep(0.05)


def test_elastic_two_one_two_with_real_num_workers_range(multinode, tmp_path, monkeypatch):
    """``ScalingConfig(num_workers=(1, 2))`` on two 1-CPU nodes, ``CheckpointBeforeResize`` in
    ``RunConfig(callbacks=...)``. The node of one rank is removed while the group holds at step 4:
    Ray Train restarts the group with one worker, which restores the step-3 snapshot from memory
    (the lost rank's section from the peer copy on the surviving node) and re-splits the rest of the
    epoch onto one rank. A node is added: Ray Train's elastic policy grows the healthy group
    (RESIZING), the callback gets a just-in-time checkpoint committed first, and the two-worker group
    restores it from memory. Every sample once per epoch, and the final weights bitwise equal to a
    run without failures that followed the same world-size schedule (``test_spot.replay``)."""
    import ray
    import test_spot as spot
    import torch
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from cf_ray.preemption import CheckpointBeforeResize, controller_of

    cluster, nodes = multinode
    node_a, node_b = nodes
    # The group Ray Train restarts after the node loss may be sized from a view taken before the
    # coordinator saw the loss (2 workers, 1 CPU left): its start then fails after this timeout
    # (60 s by default) and is retried with a fresh view. Read by Ray Train's controller at fit().
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "10")
    out = tmp_path / "out"
    out.mkdir()
    name, storage = "elastic", str(tmp_path / "ray")
    trainer = TorchTrainer(
        elastic_loop,
        train_loop_config={
            "out": str(out),
            "storage": storage,
            "run": name,
            "epochs": 2,
            "every": 3,
            "hold_at": 4,
            "slow_step_s": 0.5,
        },
        scaling_config=ScalingConfig(num_workers=(1, 2), elastic_resize_monitor_interval_s=1.0),
        run_config=RunConfig(
            name=name,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=3),
            callbacks=[CheckpointBeforeResize(timeout_s=30.0)],
        ),
    )
    fitted: dict = {}

    def fit():
        try:
            fitted["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - reported by the assertions below
            fitted["error"] = e

    th = threading.Thread(target=fit, daemon=True)
    th.start()
    for r in range(2):
        _wait_for(out / f"held_rank{r}", th, fitted)
    # Step 3's snapshot survives the loss of node B once every section B holds has a copy on A (the
    # controller's own test at restore; milliseconds for this state).
    ctl = controller_of(storage, name)
    on_a = {node_a.node_id}

    def newest_on_a(self):
        snap = self._ledger.commits.newest_in_memory(on_a)
        return None if snap is None else snap.step

    deadline = time.time() + 60
    while ray.get(ctl.__ray_call__.remote(newest_on_a), timeout=30) != 3:
        assert time.time() < deadline, "step 3 was never copied to node A"
        time.sleep(0.1)
    cluster.remove_node(node_b)  # a spot node reclaimed: the group fails, Ray Train restarts it
    _coordinator_sees({node_a.node_id}, {node_b.node_id})
    _wait_for(out / "resume_gen2.json", th, fitted)
    node_c = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=OBJECT_STORE_BYTES)
    nodes[1] = node_c  # the node a later test of this module takes away
    cluster.wait_for_nodes()
    _coordinator_sees({node_a.node_id, node_c.node_id}, set())
    th.join(300)
    assert not th.is_alive(), "the run did not finish"
    assert "error" not in fitted and fitted["result"].error is None, fitted

    r1, r2, r3 = spot._resumes(out)
    assert [r["world_size"] for r in (r1, r2, r3)] == [2, 1, 2]
    assert r1["source"] == "fresh"
    # Shrink: the newest snapshot (step 3), from memory, the lost rank's section from its peer copy.
    assert (r2["source"], r2["step"], r2["saved_world_size"]) == ("memory", 3, 2), r2
    res = json.load(open(out / "result.json"))
    # Grow: Ray Train's RESIZING ran CheckpointBeforeResize, whose checkpoint the new group restored.
    (jit,) = [r for r in res["profile"] if r.get("kind") == "preempt"]
    assert jit["notice_source"] == "driver" and jit["committed"], jit
    assert any(e["event"] == "notice" and "RESIZING" in str(e.get("detail")) for e in res["events"]), res["events"]
    assert (r3["source"], r3["step"], r3["saved_world_size"]) == ("memory", jit["step"], 1), r3
    assert r3["step"] > r2["step"]
    assert [e["world_size"] for e in res["events"] if e["event"] == "reprofile"] == [1, 2]
    spot._assert_exactly_once(spot._lineage(out), epochs=2)
    final = torch.load(out / "final_model.pt", weights_only=True)
    expected = spot.replay([(2, r2["step"]), (1, r3["step"]), (2, res["steps"])], epochs=2)
    assert final.keys() == expected.keys()
    for k in final:  # bitwise: same data order, same averaging, state restored exactly
        assert torch.equal(final[k], expected[k]), k


def test_node_loss_while_a_copy_is_in_flight_never_restores_that_step(multinode, reference, tmp_path):
    """The origin's node is lost while its holder's copy of step 10 to the peer is in flight (the
    peer's holder got the call and waits 20 s before it pulls the bytes: the test wraps that holder's
    ``Replicator.receive`` in its own process, through ``__ray_call__``), and storage is slow for
    step 10, so only step 5 is committed. Step 10 is
    then half-copied: the survivor's sections have copies, the lost node's have none. The restarted
    group must restore step 5, from memory (its last complete copy), without trying step 10 first
    (no fallback), every sample once and the final state bitwise equal to the uninterrupted run."""
    import pyarrow.fs as pafs
    import ray

    from faulty_fs import SlowHandler

    cluster, nodes = multinode
    # Node X, the survivor. The run goes on A and X.
    node_x = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=OBJECT_STORE_BYTES)
    cluster.remove_node(nodes[1])
    nodes[1] = node_x
    cluster.wait_for_nodes()
    node_a = nodes[0]
    name = "inflight"
    out = tmp_path / "out" / name
    cfg = dict(
        e2e.SMALL,
        keep_last=None,
        step_sleep=0.6,
        replicas=1,
        storage_path=str(tmp_path / "ckpts"),
        # Slow for the first attempt only: the second replays step 10 at full speed.
        storage_filesystem=pafs.PyFileSystem(SlowHandler(10, 11, 15.0, generation=1)),
    )
    fitted: dict = {}

    def train():
        try:
            fitted["result"] = demo.run(name, str(tmp_path), cfg)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            fitted["error"] = e

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    deadline = time.time() + 240
    # X's holder, once the run's worker there made it: its pulls of step 10 wait 20 s first.
    holder_x = None
    while holder_x is None:
        assert time.time() < deadline and trainer.is_alive(), fitted
        holder_x = _holder_of(name, node_x.node_id)
        time.sleep(0.02)
    ray.get(holder_x.__ray_call__.remote(holder_hooks.delay_pulls, 10, 20.0), timeout=60)
    assert _newest_step(out) < 10, "step 10 was copied before the delay was in place"
    while time.time() < deadline and _newest_step(out) < 11 and trainer.is_alive():
        time.sleep(0.05)
    assert _newest_step(out) >= 11, fitted
    # The controller's view now: step 10 staged by both holders, but only step 5 survives A's loss
    # (A's copies of step 10 wait 20 s in X's holder). Its own test at restore, run here.
    ((ctl_name, ctl_ns),) = _controllers_of(ray, name)
    ctl = ray.get_actor(ctl_name, namespace=ctl_ns)

    def newest_in_memory(self, alive):
        snap = self._ledger.commits.newest_in_memory(alive)
        return None if snap is None else snap.step

    while (ray.get(ctl.__ray_call__.remote(newest_in_memory, None), timeout=30) or 0) < 10:
        assert time.time() < deadline, "step 10 was never staged"
        time.sleep(0.05)

    def table(self):  # what the controller knows of each step (the assertion's message)
        return {
            step: (p.state.value, p.lost, dict(p.parts.staged_nodes), {s: dict(r) for s, r in p.parts.replicas.items()})
            for (_gen, step), p in self._ledger.commits.table.entries.items()
        }

    got = ray.get(ctl.__ray_call__.remote(newest_in_memory, {node_x.node_id}), timeout=30)
    assert got == 5, (node_x.node_id, ray.get(ctl.__ray_call__.remote(table), timeout=30))
    cluster.remove_node(node_a)  # before step 15 (3 s): X still holds its own sections of step 5
    nodes[0] = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=OBJECT_STORE_BYTES)
    trainer.join(400)
    assert not trainer.is_alive(), "the run did not finish after the node loss"
    assert "error" not in fitted, fitted
    first, second = e2e.resumes(out)[:2]
    assert first["source"] == "fresh"
    assert (second["source"], second["step"]) == ("memory", 5), second
    res = e2e.result_of(out)
    assert not [e for e in res["events"] if e["event"] == "restore_fallback"], res["events"]
    rows = {r["step"]: r for r in res["profile"] if r.get("generation") == 1}
    # Step 10: only the survivor's sections were copied (to A, lost since); step 5: every section.
    assert rows[10].get("replica_bytes", 0) < rows[5]["replica_bytes"], (rows[10], rows[5])
    assert e2e.lineage(out) == e2e.lineage(reference)
    assert demo.states_equal(reference / "final_state.pt", out / "final_state.pt")
