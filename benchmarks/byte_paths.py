"""How bytes move between nodes, measured (issue 24): host bytes copied and seconds per replicated
section, for the path cf_ray uses and for the object-store path it replaced.

* ``stream`` (cf_ray's): two holders in this process (the parts, real slots, real sockets on
  loopback): a worker's hand-off into holder A's slot, then A's replicator offers it and B pulls it
  over the direct transfer into a sealed slot of its own, checking every block. Host bytes copied:
  what the holders count (``Holder.held_bytes()["copied"]``).
* ``object-store`` (before issue 24; ``--object-store``, needs Ray): on a ``ray.cluster_utils.Cluster``
  of two nodes, what ``holder.py`` did: the origin ``ray.put``s the slot's bytes, the peer pulls the
  object (Ray's transfer into its node's store) and ``ray.put``s it again.

Run: ``python -m benchmarks.byte_paths --mib 256 --repeats 5 [--object-store]``. Prints one JSON line
per path (medians). On one machine "two nodes" share the host: a copy across a real network copies
once on each host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def stream_path(nbytes: int, repeats: int) -> dict:
    import numpy as np

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from slot_helpers import staged_slot

    from cf_ray._engine.node.holder import Holder
    from cf_ray._engine.protocol.messages import CheckpointKind, SnapshotMeta, Stage
    from cf_ray._engine.storage.backends import open_storage

    class Sink:
        def __init__(self):
            self.sent = []

        def send(self, method, msg):
            self.sent.append((method, msg))

        def wait_idle(self, _timeout):
            return True

        def pending(self):
            return 0

    class Peer:
        def __init__(self, h):
            self.h, self.node_id = h, h._node

        def hold(self, offer, _watch):
            return self.h.hold_replica(offer)

    root = tempfile.mkdtemp()
    storage = open_storage(root)
    holders: dict = {}
    for node in ("A", "B"):
        peer = "B" if node == "A" else "A"
        holders[node] = Holder(
            storage, "c", "ns", sender=Sink(), name=f"cf_ray.holder.bench.{node}", node=node, host="127.0.0.1",
            peers=lambda meta, _section, p=peer: [Peer(holders[p])] if meta.replicas else [],
        )  # fmt: skip
    a, b = holders["A"], holders["B"]
    data = np.random.default_rng(0).integers(0, 256, size=nbytes, dtype=np.uint8)
    meta = SnapshotMeta(
        rank=0, world_size=1, replicated=False, epoch=0, kind=CheckpointKind.SCHEDULED, replicas=1, persist=False
    )
    seconds, copied = [], []
    for step in range(1, repeats + 1):
        before = a.held_bytes()["copied"] + b.held_bytes()["copied"]
        staged = staged_slot(a.arena("rank_00000", nbytes), 1, step, "rank_00000", data, b'{"entries":[],"tree":null}')
        a.stage(Stage(generation=1, step=step, meta=meta, sections=(staged,)))
        deadline = time.monotonic() + 600
        while not [m for k, m in a._sender.sent if k == "part_replicated" and m.step == step]:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        (msg,) = [m for k, m in a._sender.sent if k == "part_replicated" and m.step == step]
        assert not msg.error, msg.error
        seconds.append(msg.seconds)
        copied.append(a.held_bytes()["copied"] + b.held_bytes()["copied"] - before)
    return {
        "path": "stream",
        "nbytes": nbytes,
        "host_bytes_copied": statistics.median(copied),
        "passes": statistics.median(copied) / nbytes,
        "seconds": statistics.median(seconds),
        "GB_per_s": nbytes / statistics.median(seconds) / 1e9,
    }


def object_store_path(nbytes: int, repeats: int) -> dict:
    import mmap

    import numpy as np
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as Affinity

    @ray.remote(num_cpus=0)
    class Origin:
        def __init__(self, n):
            self.fd = os.memfd_create("slot")
            os.ftruncate(self.fd, n)
            self.m = mmap.mmap(self.fd, n)
            np.frombuffer(self.m, dtype=np.uint8)[:] = 7

        def put(self):
            t = time.perf_counter()
            ref = ray.put(np.frombuffer(self.m, dtype=np.uint8))
            return [ref], time.perf_counter() - t

    @ray.remote(num_cpus=0)
    class PeerHolder:
        def hold(self, refs):
            t0 = time.perf_counter()
            arena = ray.get(refs[0])
            t1 = time.perf_counter()
            self.ref = ray.put(arena)
            return t1 - t0, time.perf_counter() - t1

    store = 3 * nbytes + (64 << 20)
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, "object_store_memory": store}
    )
    nodes = [cluster.add_node(num_cpus=1, object_store_memory=store) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        o = Origin.options(scheduling_strategy=Affinity(nodes[0].node_id, soft=False)).remote(nbytes)
        p = PeerHolder.options(scheduling_strategy=Affinity(nodes[1].node_id, soft=False)).remote()
        rows = []
        for _ in range(repeats):
            refs, put_s = ray.get(o.put.remote())
            pull_s, reput_s = ray.get(p.hold.remote(refs))
            rows.append((put_s, pull_s, reput_s))
            del refs
        put_s, pull_s, reput_s = (statistics.median(x) for x in zip(*rows))
    finally:
        ray.shutdown()
        cluster.shutdown()
    total = put_s + pull_s + reput_s
    return {
        "path": "object-store",
        "nbytes": nbytes,
        "host_bytes_copied": 3 * nbytes,
        "passes": 3,
        "origin_put_s": put_s,
        "pull_s": pull_s,
        "peer_put_s": reput_s,
        "seconds": total,
        "GB_per_s": nbytes / total / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--object-store", action="store_true", help="also measure the object-store path (needs Ray)")
    args = p.parse_args(argv)
    nbytes = args.mib << 20
    print(json.dumps(stream_path(nbytes, args.repeats)), flush=True)
    if args.object_store:
        print(json.dumps(object_store_path(nbytes, args.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
