"""Spot and elastic training: preemption notices, just-in-time checkpoints, 2 -> 1 -> 2 workers.

Three tiers: the watcher alone (no Ray), a Checkpointer in this process (Ray actors, no
TorchTrainer), and real ``TorchTrainer`` runs (``slow``): a SIGTERM notice, a deadline too short
for the persist, and a run that shrinks and grows within an epoch.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import threading
import time

import pyarrow.fs as pafs
import pytest
import torch

import cf_ray
from cf_ray import preemption
from cf_ray._engine.format.catalog import list_committed, list_uncommitted
from cf_ray._engine.format.layout import LATEST, MANIFEST, step_dir
from cf_ray._engine.storage.fs import FsStorage
from cf_ray._engine.worker import preemption_watcher
from cf_ray._engine.worker.preemption_watcher import PreemptionWatcher
from cf_ray.config import PreemptionConfig
from cf_ray.data import ResumableDistributedSampler
from cf_ray.preemption import notify_preemption

from faulty_fs import FaultyHandler  # tests/ is on the workers' PYTHONPATH too (conftest.py)

# -- the watcher alone ----------------------------------------------------------------------------------


def _watcher(rank=0, **kw):
    requests = []
    kw.setdefault("ray_signal", "off")
    kw.setdefault("sigterm", False)
    kw.setdefault("hold_extra_s", 0.0)
    return PreemptionWatcher(PreemptionConfig(**kw), rank, lambda: requests.append(time.time())), requests


def _info(deadline_s, ranks=(1,), node="node-a"):
    from ray.train.v2.api.preemption import PreemptionInfo

    deadline_ms = None if deadline_s is None else int((time.time() + deadline_s) * 1000)
    return PreemptionInfo(deadline_ms=deadline_ms, preempted_node_to_ranks={node: list(ranks)})


def test_config_is_checked():
    with pytest.raises(cf_ray.ConfigError, match="ray_signal"):
        PreemptionConfig(ray_signal="sometimes")
    with pytest.raises(cf_ray.ConfigError, match="ray_poll_every"):
        PreemptionConfig(ray_poll_every=0)
    with pytest.raises(cf_ray.ConfigError, match="sigterm_deadline_s"):
        PreemptionConfig(sigterm_deadline_s=-1)
    with pytest.raises(cf_ray.ConfigError, match="preemption"):
        cf_ray.CheckpointConfig(preemption="yes")
    assert cf_ray.CheckpointConfig(preemption=PreemptionConfig(hold=False)).preemption.hold is False


def test_sigterm_in_the_main_thread_is_a_notice_passed_on_after_the_checkpoint():
    passed_on = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: passed_on.append(s))
    w, requests = _watcher(sigterm=True, sigterm_deadline_s=0.3)
    try:
        w.install()
        assert w.sources["sigterm"] == "main"
        w.poll(1)  # a training step ended: there is work to save
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs at the next bytecode of the main thread
        assert len(requests) == 1 and w.active.source == "sigterm"
        assert w.active.seconds_left() == pytest.approx(0.3, abs=0.1)
        assert passed_on == []  # deferred, not swallowed ...
        w.after_checkpoint(7, wait=lambda t: None, committed=lambda s: True)
        assert passed_on == [signal.SIGTERM]  # ... passed on once the checkpoint is durable
        assert signal.getsignal(signal.SIGTERM) is not preemption_watcher._python_sigterm
        (out,) = w.outcomes
        assert out.step == 7 and out.durable and out.durable_before_deadline
        assert w.jit_steps == [7] and w.active is None
    finally:
        w.close()
        signal.signal(signal.SIGTERM, previous)


def _sigterm_passed_on_at_once(w, requests, caplog, why):
    """Sends SIGTERM to this process; asserts that the watcher passed it on at once, as if it were not
    there, with no notice, no checkpoint asked for, and a line that says what it was."""
    passed_on = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: passed_on.append(s))
    try:
        w.install()
        assert w.sources["sigterm"] == "main"
        with caplog.at_level("INFO", logger="cf_ray"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # the handler runs at the next bytecode of the main thread
        assert passed_on == [signal.SIGTERM] and w.notices == [] and requests == [] and w.active is None
        assert "preemption notice" not in caplog.text
        assert re.search(rf"rank 0: SIGTERM {why}.*not a preemption: passed on, no checkpoint", caplog.text)
    finally:
        w.close()
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_before_the_first_step_is_not_a_preemption_notice(caplog):
    """A rank whose restore() raised (or has not returned) holds nothing its restore did not load: a
    SIGTERM then is the worker being stopped, and there is no work to save."""
    w, requests = _watcher(sigterm=True, sigterm_deadline_s=30.0)
    _sigterm_passed_on_at_once(w, requests, caplog, "before the first training step")


def test_sigterm_after_ray_train_began_stopping_the_group_is_not_a_preemption_notice(caplog):
    """Ray Train v2 stops a worker group (a peer died or raised, the run ended) by calling each worker
    actor's shutdown(), whose worker callbacks run first; the SIGTERM that follows is no notice."""
    from ray.train.v2._internal.execution.worker_group.worker import RayTrainWorker

    w, requests = _watcher(sigterm=True, sigterm_deadline_s=30.0)
    w.poll(5)  # training had been going on
    worker = RayTrainWorker()  # Ray Train's worker actor class, in this process
    worker._callbacks = [preemption_watcher._GroupShutdownHook(w._sigterm._token)]  # as _main_install adds it
    preemption_watcher._REGISTRY[w._sigterm._token] = w._sigterm
    worker.shutdown()  # what the worker group's shutdown calls on every worker before ray.kill
    _sigterm_passed_on_at_once(w, requests, caplog, "after Ray Train began stopping the worker group")


def test_rays_signal_from_the_worker_mailbox(monkeypatch):
    info = _info(5.0)
    monkeypatch.setattr(preemption_watcher, "_read_mailbox", lambda: info)
    w0, r0 = _watcher(0, ray_signal="auto")
    w1, r1 = _watcher(1, ray_signal="auto")
    w0.install()
    w1.install()
    assert w0.sources["ray"] == "mailbox"
    for step in (1, 2, 3):  # the same signal, seen after every step: one notice
        w0.poll(step)
        w1.poll(step)
    assert len(r0) == 1 and r1 == []  # every rank gets Ray's signal; rank 0 alone asks (ranks see it a step apart)
    assert len(w0.notices) == len(w1.notices) == 1
    assert w1.active.requested is False and "(this rank)" in w1.active.detail
    assert w0.active.deadline_unix == pytest.approx(info.deadline_ms / 1000)
    info = _info(None, ranks=(0, 1), node="node-b")  # a new drain, without a deadline: Ray's 120 s
    w0.poll(4)
    assert len(r0) == 2
    assert w0.notices[-1].seconds_left() == pytest.approx(120.0, abs=2.0)


def test_rays_public_call_is_made_every_n_steps(monkeypatch):
    import ray.train

    calls = []
    monkeypatch.setattr(ray.train, "get_preemption_info", lambda: calls.append(1) or None, raising=False)
    w, _ = _watcher(ray_poll_every=10)
    w._ray_mode = "api"  # what install() picks inside Ray Train when the mailbox is not reachable
    for step in range(1, 26):
        w.poll(step)
    assert len(calls) == 2  # steps 10 and 20: the same steps on every rank (it is a barrier)


def test_hold_until_the_deadline_then_training_goes_on():
    w, requests = _watcher()
    n = w.notify("user", deadline_s=0.4, detail="metadata endpoint")
    assert requests and w.active is n
    waited = []
    t0 = time.time()
    w.after_checkpoint(3, wait=waited.append, committed=lambda s: True)
    assert time.time() - t0 >= 0.3  # held: a step now would be lost with the node
    assert waited and 0.3 <= waited[0] <= 0.5  # the wait is bounded by the deadline (at least 0.5 s)
    (out,) = w.outcomes
    assert out.durable_before_deadline and out.held_s > 0.2 and w.active is None
    # Not durable in time: recorded as such, no hold past the deadline.
    w.notify("user", deadline_s=0.0)
    w.after_checkpoint(4, wait=lambda t: None, committed=lambda s: False)
    assert w.outcomes[-1].durable is False and w.outcomes[-1].durable_before_deadline is False
    # No deadline: wait up to max_wait_s for durability, no hold.
    w2, _ = _watcher(max_wait_s=2.5)
    w2.notify("user")
    w2.after_checkpoint(5, wait=waited.append, committed=lambda s: True)
    assert waited[-1] == 2.5 and w2.outcomes[-1].durable_before_deadline is None


def test_earliest_deadline_wins_and_late_passive_notices_expire():
    w, _ = _watcher(1)
    w.notify("driver", deadline_s=30.0, request=False)
    w.notify("sigterm", deadline_s=10.0)
    assert w.active.source == "sigterm"
    w2, requests = _watcher(1)
    w2.notify("ray", deadline_unix=time.time() - 5.0, request=False)  # heard of after its checkpoint
    w2.poll(1)
    assert w2.active is None and requests == []


# -- a Checkpointer in this process (Ray actors, no TorchTrainer) -------------------------------------------


def _tiny(tmp_path, run_name, **cfg):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg.setdefault("policy", cf_ray.FixedInterval(every=100))
    ck = cf_ray.Checkpointer(
        {"model": model, "optimizer": opt},
        config=cf_ray.CheckpointConfig(
            storage_path=str(tmp_path), run_name=run_name, register_with_ray=False, final_model=None, **cfg
        ),
    )
    ck.restore()

    def step():
        model(torch.randn(2, 4)).sum().backward()
        ck.step(opt)
        opt.zero_grad()

    return ck, step


def _row(ck, step):
    return next(r for r in ck.profile_rows() if r["step"] == step)


def test_jit_checkpoint_from_the_user_and_from_the_driver(ray_cluster, tmp_path):
    ck, step = _tiny(tmp_path, "jit")
    for _ in range(3):
        step()
    ck.request_checkpoint(preemption=True, deadline_s=1.5, detail="metadata endpoint says 2 min")
    t0 = time.time()
    step()  # one rank: the request is agreed at once, so this is the just-in-time step
    assert ck.preemption.jit_steps == [4]
    assert time.time() - t0 >= 1.0  # held until the deadline
    row = _row(ck, 4)
    assert row["kind"] == "preempt" and row["committed"] and row["made_deadline"] is True
    assert row["notice_source"] == "user" and row["durable_unix"] <= row["deadline_unix"]
    assert [c.step for c in cf_ray.list_checkpoints(str(tmp_path / "jit"))] == [4]

    notify_preemption(str(tmp_path), "jit", deadline_s=1.0, detail="the group grows")  # from the driver
    deadline = time.time() + 10
    while len(ck.preemption.jit_steps) < 2 and time.time() < deadline:
        step()
        time.sleep(0.05)
    assert len(ck.preemption.jit_steps) == 2
    row = _row(ck, ck.preemption.jit_steps[1])
    assert row["notice_source"] == "driver" and row["made_deadline"] is True
    assert any(e["event"] == "notice" and e["detail"] == "the group grows" for e in ck.events())
    ck.finish()


def test_a_rank_whose_restore_raised_passes_sigterm_on_without_a_notice(ray_cluster, tmp_path, caplog):
    """restore() raised: the worker is being stopped, not preempted; its SIGTERM does what it would do
    without cf_ray, at once, and no just-in-time checkpoint is asked for."""
    passed_on = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: passed_on.append(s))
    (tmp_path / "empty").mkdir()
    model = torch.nn.Linear(4, 1)
    ck = cf_ray.Checkpointer(
        {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)},
        config=cf_ray.CheckpointConfig(
            storage_path=str(tmp_path), run_name="raised", register_with_ray=False, final_model=None,
            resume_from=str(tmp_path / "empty"), preemption=PreemptionConfig(sigterm_deadline_s=30.0),
        ),
    )  # fmt: skip
    try:
        with pytest.raises(cf_ray.ConfigError, match="holds no cf_ray checkpoint"):
            ck.restore()
        with caplog.at_level("INFO", logger="cf_ray"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # the handler runs at the next bytecode of the main thread
        assert passed_on == [signal.SIGTERM] and ck.preemption.notices == []
        assert "preemption notice" not in caplog.text and "not a preemption: passed on" in caplog.text
    finally:
        ck.close()
        signal.signal(signal.SIGTERM, previous)


class _RankInAnActor:
    """A rank as Ray Train runs one: ``_tiny``'s job on a thread of its own in a Ray actor, whose
    main thread stays free for calls (the doorbell rings through it)."""

    def start(self, tmp_path, run_name, poll_interval_s):
        from cf_ray._engine import env

        env.BELL_POLL_INTERVAL_S = poll_interval_s  # this actor's process only
        self.ck, step = _tiny(tmp_path, run_name, preemption=PreemptionConfig(hold_extra_s=0.0))
        self.stop = threading.Event()

        def train():
            while not self.stop.is_set():
                step()
                time.sleep(0.05)

        self.thread = threading.Thread(target=train, daemon=True)
        self.thread.start()

    def bell_known(self):
        return self.ck._steps.link._sync._bell_known

    def jit_steps(self):
        return list(self.ck.preemption.jit_steps)

    def finish(self):
        self.stop.set()
        self.thread.join(timeout=30)
        self.ck.finish()


def test_a_driver_notice_rings_the_ranks_doorbell_so_the_next_step_hears_it_not_the_next_poll(ray_cluster, tmp_path):
    """A rank in a Ray actor polls the controller once a minute here (1 s by default): the driver's
    notice still reaches it at once, because the controller rings its doorbell."""
    import ray

    rank = ray.remote(num_cpus=0)(_RankInAnActor).remote()
    ray.get(rank.start.remote(tmp_path, "bell", 60.0), timeout=120)
    deadline = time.time() + 30
    while not ray.get(rank.bell_known.remote(), timeout=30):  # the first poll's reply says so
        assert time.time() < deadline, "the controller never acknowledged the rank's doorbell"
        time.sleep(0.05)
    time.sleep(1.0)  # the polls now wait a minute: only the bell can bring the notice in time
    t0 = time.time()
    notify_preemption(str(tmp_path), "bell", deadline_s=5.0, detail="spot reclaim")
    while not ray.get(rank.jit_steps.remote(), timeout=30):
        assert time.time() - t0 < 10, "the notice waited for the next poll"
        time.sleep(0.02)
    heard_s = time.time() - t0
    ray.get(rank.finish.remote(), timeout=120)
    assert heard_s < 5.0
    # The policy's every=100 may have checkpointed step 100 before the notice (a fast machine).
    (jit,) = [c for c in cf_ray.list_checkpoints(str(tmp_path / "bell")) if c.kind == "preempt"]
    assert jit.step > 0


def test_checkpoint_before_an_elastic_resize(ray_cluster, tmp_path):
    from types import SimpleNamespace

    from ray.train.v2._internal.execution.controller.state import ResizingState, RunningState
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision

    with pytest.raises(cf_ray.CfRayError, match="no running cf_ray job"):
        notify_preemption(str(tmp_path), "resize", deadline_s=1.0)
    ck, step = _tiny(tmp_path, "resize", preemption=PreemptionConfig(hold_extra_s=0.0))
    stop = threading.Event()

    def train():  # the job goes on while Ray Train's controller decides to resize
        while not stop.is_set():
            step()
            time.sleep(0.02)

    th = threading.Thread(target=train, daemon=True)
    th.start()
    cb = preemption.CheckpointBeforeResize(timeout_s=5.0)
    cb.after_controller_start(
        SimpleNamespace(run_config=SimpleNamespace(storage_path=str(tmp_path), name="resize", storage_filesystem=None))
    )
    cb.after_controller_state_update(RunningState(), RunningState())
    assert cb.outcomes == []  # not a resize
    cb.after_controller_state_update(
        RunningState(), ResizingState(ResizeDecision(num_workers=2, resources_per_worker={"CPU": 1}))
    )
    (out,) = cb.outcomes
    assert out["committed"] and out["seconds"] < 5.0  # Ray tears the group down only after this returns
    stop.set()
    th.join(timeout=30)
    assert ck.preemption.jit_steps == [out["step"]]
    assert out["step"] in [c.step for c in cf_ray.list_checkpoints(str(tmp_path / "resize"))]
    ck.finish()


def test_jit_checkpoint_that_cannot_persist_leaves_the_previous_one_latest(ray_cluster, tmp_path):
    fs = pafs.PyFileSystem(FaultyHandler(from_step=6))  # storage refuses every write from step 6 on
    ck, step = _tiny(tmp_path, "nojit", policy=cf_ray.FixedInterval(every=3), storage_filesystem=fs)
    for _ in range(5):
        step()
    ck.wait()
    ck.request_checkpoint(preemption=True, deadline_s=1.0)
    step()
    assert ck.preemption.jit_steps == [6] and ck.preemption.outcomes[0].durable is False
    row = _row(ck, 6)
    assert row["kind"] == "preempt" and not row["committed"] and row["made_deadline"] is False
    assert [c.step for c in cf_ray.list_checkpoints(str(tmp_path / "nojit"))] == [3]
    storage = FsStorage(pafs.LocalFileSystem(), str(tmp_path / "nojit" / "cf_ray"))
    assert bytes(storage.read_file(LATEST)).decode() == step_dir(3).rsplit("/", 1)[-1]
    assert not storage.exists(f"{step_dir(6)}/{MANIFEST}")
    ck.finish()


# -- real TorchTrainer runs --------------------------------------------------------------------------------

SAMPLES, DIM, BATCH = 96, 8, 4


class IdDataset(torch.utils.data.Dataset):
    """``(id, x, y)``, a fixed function of the id."""

    def __init__(self, n=SAMPLES, dim=DIM):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return i, self.x[i], self.y[i]


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def build_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def build_adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


def build_fsdp2(world: int):
    """``build_model()`` sharded with FSDP2 (``fully_shard`` per layer and at the root) over every
    rank, and Adam over its DTensor parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, build_adam(model)


def make_loader(dataset, sampler):
    return torch.utils.data.DataLoader(
        dataset, batch_size=BATCH, sampler=sampler, generator=torch.Generator().manual_seed(0)
    )


class StallingHandler(FaultyHandler):
    """Local disk; while ``flag`` exists, writing a checkpoint's data files stalls (a storage that
    cannot keep up with a short deadline). Manifests are never stalled."""

    def __init__(self, flag: str):
        super().__init__(fail=r"(?!)")  # never fails
        self.flag = flag

    def __reduce__(self):
        return (StallingHandler, (self.flag,))

    def equals(self, other):
        return isinstance(other, StallingHandler) and other.flag == self.flag

    def _check(self, path):
        if re.search(r"checkpoints/step_\d+/", path) and not path.endswith(MANIFEST):
            t0 = time.time()
            while os.path.exists(self.flag) and time.time() - t0 < 120:
                time.sleep(0.05)


def spot_loop(cfg: dict) -> None:
    """The training loop of the TorchTrainer tests; ``cfg['scenario']`` says what happens to it."""
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    out = cfg["out"]
    if cfg.get("log"):  # what cf_ray says on this rank, down to debug lines
        import logging

        handler = logging.FileHandler(f"{out}/cf_ray_rank{rank}.log")
        handler.setFormatter(logging.Formatter("%(created).3f %(levelname)s %(message)s"))
        logging.getLogger("cf_ray").addHandler(handler)
        logging.getLogger("cf_ray").setLevel(logging.DEBUG)
    if os.path.exists(f"{out}/killed"):
        try:
            os.remove(f"{out}/stall")  # the new attempt's storage keeps up again
        except FileNotFoundError:
            pass
    dataset = IdDataset()
    sampler = ResumableDistributedSampler(dataset, rank=rank, world_size=world, shuffle=True, seed=0, pad=False)
    loader = make_loader(dataset, sampler)
    fsdp2 = cfg.get("strategy") == "fsdp2"
    if fsdp2:
        model, opt = build_fsdp2(world)
    else:
        model = ray.train.torch.prepare_model(build_model())
        opt = build_optimizer(model)
    fs = pafs.PyFileSystem(StallingHandler(f"{out}/stall")) if cfg["scenario"] == "short_deadline" else None
    config = cf_ray.CheckpointConfig(
        policy=cf_ray.FixedInterval(every=cfg.get("every", 100)),
        storage_path=cfg["storage"],
        run_name=cfg["run"],
        storage_filesystem=fs,
        register_with_ray=False,
        restore_from=cfg.get("restore_from", "auto"),
        final_model="model" if fsdp2 else None,
        preemption=PreemptionConfig(sigterm_deadline_s=20.0, hold_extra_s=0.0),
    )
    ck = cf_ray.Checkpointer({"model": model, "optimizer": opt}, data={"sampler": sampler}, config=config)
    resume = ck.restore()
    gen = resume.generation
    if rank == 0:
        storage = FsStorage(pafs.LocalFileSystem(), f"{cfg['storage']}/{cfg['run']}/cf_ray")
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
                    "segment": cfg.get("segment"),
                    "visible": [c.step for c in list_committed(storage)],
                    "uncommitted": [s for _, s in list_uncommitted(storage)],
                    "latest": bytes(storage.read_file(LATEST)).decode() if storage.exists(LATEST) else None,
                },
                f,
            )
    ids_log = open(f"{out}/ids_seg{cfg.get('segment', 0)}_gen{gen}_rank{rank}.jsonl", "w")
    for epoch in range(resume.epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        for ids, x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            # Logged before the step: a rank may end inside it (held at a just-in-time checkpoint).
            ids_log.write(
                json.dumps({"step": ck.step_count + 1, "epoch": epoch, "ids": ids.tolist(), "time": time.time()}) + "\n"
            )
            ids_log.flush()
            ck.step(opt)
            opt.zero_grad()
            _scenario(cfg, ck, rank, gen)
            if cfg.get("step_s"):
                time.sleep(cfg["step_s"])
            if cfg.get("end_at_jit") and ck.preemption.jit_steps and ck.preemption.jit_steps[-1] == ck.step_count:
                ck.wait()  # this segment ends here: the group is about to change size
                return
        ck.end_epoch()
    if fsdp2:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        final = {k: v.full_tensor().detach().clone() for k, v in get_model_state_dict(model).items()}  # collectives
    else:
        bare = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        final = {k: v.detach().clone() for k, v in bare.state_dict().items()}
    if rank == 0:
        with open(f"{out}/result.json", "w") as f:
            json.dump({"profile": ck.profile_rows(), "events": ck.events(), "steps": ck.step_count}, f, default=str)
        torch.save(final, f"{out}/final_model.pt")
    summary = ck.finish()
    if rank == 0:
        with open(f"{out}/finish.json", "w") as f:
            json.dump({"final_path": summary.final_path, "failures": summary.failures}, f, default=str)


def _scenario(cfg, ck, rank, gen):
    s, out = cfg["scenario"], cfg["out"]
    if rank != cfg.get("notice_rank", 1) or ck.step_count != cfg.get("notice_at"):
        return
    if s != "elastic" and gen != 1:  # the failure scenarios act in the first attempt only
        return
    if s == "sigterm":  # the cloud agent's SIGTERM; the process ends once the checkpoint is durable
        with open(f"{out}/notice.json", "w") as f:
            json.dump({"step": ck.step_count, "time": time.time()}, f)
        os.kill(os.getpid(), signal.SIGTERM)
    elif s == "short_deadline":  # a notice whose deadline is too short for the (stalled) persist
        ck.wait()  # the scheduled checkpoints so far are committed; from here on storage stalls
        open(f"{out}/stall", "w").close()
        deadline = time.time() + cfg["deadline_s"]
        ck.request_checkpoint(preemption=True, deadline_unix=deadline, detail="too short")

        def node_goes_away():  # at the deadline: the node, its holder and this worker are gone
            time.sleep(max(deadline - time.time(), 0.0))
            import ray

            with open(f"{out}/killed", "w") as f:
                json.dump({"step": ck.step_count, "time": time.time()}, f)
            ray.kill(ck.holder)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=node_goes_away, daemon=True).start()
    elif s == "raise":  # a bug in one worker: Ray Train stops the whole group
        raise RuntimeError(f"rank {rank} raised at step {ck.step_count}")
    elif s == "elastic":  # this node (or a new one) changes the group: checkpoint, then resize
        ck.request_checkpoint(preemption=True, deadline_s=cfg["deadline_s"], detail="resize")


def _fit(tmp_path, name, cfg, *, workers=2, max_failures=0):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    trainer = TorchTrainer(
        spot_loop,
        train_loop_config=dict(cfg, out=str(out), storage=str(tmp_path / "ckpt"), run=cfg.get("run", "spot")),
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(
            name=name, storage_path=str(tmp_path / "ray"), failure_config=FailureConfig(max_failures=max_failures)
        ),
    )
    return trainer.fit()


def _records(out, segment=None):
    """(generation, rank, step) -> record, for every step any attempt logged."""
    rec = {}
    for f in glob.glob(f"{out}/ids_seg*_gen*_rank*.jsonl"):
        seg, gen, rank = map(int, re.search(r"seg(\d+)_gen(\d+)_rank(\d+)", f).groups())
        if segment is not None and seg != segment:
            continue
        for line in open(f):
            r = json.loads(line)
            rec[(gen, rank, r["step"])] = r
    return rec


def _lineage(out):
    """The steps that count, per rank: a later generation replaces what an earlier one did after
    the step it resumed from."""
    kept = {}
    for (gen, rank, step), r in sorted(_records(out).items()):
        kept[(rank, step)] = (gen, r)
    resumes = {r["generation"]: r["step"] for r in _resumes(out)}
    for (rank, step), (gen, _r) in list(kept.items()):
        later = [g for g in resumes if g > gen and resumes[g] < step]
        if later:
            del kept[(rank, step)]
    return kept


def _resumes(out):
    return sorted((json.load(open(f)) for f in glob.glob(f"{out}/resume_gen*.json")), key=lambda r: r["generation"])


def _assert_exactly_once(kept, epochs):
    for epoch in range(epochs):
        ids = sorted(i for (_, r) in kept.values() if r["epoch"] == epoch for i in r["ids"])
        assert ids == list(range(SAMPLES)), f"epoch {epoch}: not every sample exactly once"


@pytest.mark.slow
def test_sigterm_notice_checkpoint_durable_then_resume_loses_at_most_one_step(ray_cluster, tmp_path):
    cfg = {"scenario": "sigterm", "notice_at": 6, "epochs": 1, "every": 100, "restore_from": "storage", "step_s": 0.01}
    result = _fit(tmp_path, "sigterm", cfg, max_failures=1)
    assert result.error is None
    out = tmp_path / "out"
    res = json.load(open(out / "result.json"))
    (jit,) = [r for r in res["profile"] if r["kind"] == "preempt"]
    assert jit["committed"] and jit["made_deadline"] is True and jit["notice_source"] == "sigterm"
    notice = json.load(open(out / "notice.json"))
    assert notice["step"] < jit["step"] <= notice["step"] + 3  # posted at the next exchange, agreed one step later
    first, second = _resumes(out)
    assert second["source"] == "storage" and second["step"] == jit["step"]  # durable before the kill
    done_before = max(step for (gen, _, step) in _records(out) if gen == first["generation"])
    assert done_before - second["step"] <= 1  # work lost: at most one step
    _assert_exactly_once(_lineage(out), epochs=1)
    assert res["steps"] == SAMPLES // (2 * BATCH)


@pytest.mark.slow
def test_a_group_stopped_after_a_worker_raised_hears_no_preemption_notice(ray_cluster, tmp_path):
    """Rank 1 raises; Ray Train stops the group, and the surviving rank 0 with it (a SIGTERM reaches
    both): neither may call that a preemption notice and ask for a just-in-time checkpoint."""
    cfg = {"scenario": "raise", "notice_at": 3, "epochs": 1, "every": 100, "step_s": 0.05, "log": True}
    with pytest.raises(Exception, match="rank 1 raised at step 3"):
        _fit(tmp_path, "raised", cfg)
    for rank in (0, 1):
        said = (tmp_path / "out" / f"cf_ray_rank{rank}.log").read_text()
        assert "Ray Train stops the worker group" in said, said
        assert "preemption notice" not in said, said
        sigterm = [line for line in said.splitlines() if "SIGTERM" in line and "watches preemption" not in line]
        assert all("not a preemption: passed on, no checkpoint" in line for line in sigterm), said


@pytest.mark.slow
def test_deadline_too_short_for_the_persist_keeps_the_previous_checkpoint(ray_cluster, tmp_path):
    cfg = {"scenario": "short_deadline", "notice_at": 9, "deadline_s": 0.5, "epochs": 1, "every": 4}
    result = _fit(tmp_path, "short", cfg, max_failures=1)
    assert result.error is None
    out = tmp_path / "out"
    assert os.path.exists(out / "killed")
    first, second = _resumes(out)
    assert second["step"] == 8 and second["source"] == "storage"  # the previous committed checkpoint
    res = json.load(open(out / "result.json"))
    (row,) = [r for r in res["profile"] if r["kind"] == "preempt"]
    assert row["generation"] == first["generation"] and row["step"] in (10, 11)
    assert not row["committed"] and row["made_deadline"] is False and row["where"] == "abandoned"
    assert row["deadline_unix"] - row["notice_unix"] == pytest.approx(0.5, abs=0.05)
    assert row["step"] not in second["visible"] and second["latest"] == "step_000000000008"  # nothing partial
    _assert_exactly_once(_lineage(out), epochs=1)


def replay(schedule: list[tuple[int, int]], epochs: int, optimizer=build_optimizer) -> dict:
    """The weights of a run without failures that follows ``schedule`` ([(world size, last step)]):
    DDP's update (the mean of the per-rank gradients) computed in this process, the data re-split
    by the sampler itself at each change of world size, no checkpoint anywhere.

    FSDP2's update is the same: each rank's shard of the mean gradient (reduce-scatter with AVG;
    halving is exact), and Adam is elementwise, so a shard's update equals that rows' update of the
    whole tensor, bitwise."""
    torch.set_num_threads(1)
    dataset = IdDataset()
    model = build_model()
    opt = optimizer(model)
    step, epoch, samplers, iters = 0, 0, None, None
    for world, last in schedule:
        old = [s.state_dict() for s in samplers] if samplers else None
        samplers = []
        for r in range(world):
            s = ResumableDistributedSampler(dataset, rank=r, world_size=world, shuffle=True, seed=0, pad=False)
            if old is not None:
                s.load_elastic_state(old, r, world)
            s.set_epoch(epoch)
            samplers.append(s)
        iters = [iter(make_loader(dataset, s)) for s in samplers]
        while step < last and epoch < epochs:
            try:
                batches = [next(it) for it in iters]
            except StopIteration:
                epoch += 1
                for s in samplers:
                    s.set_epoch(epoch)
                iters = [iter(make_loader(dataset, s)) for s in samplers]
                continue
            grads = None
            for _, x, y in batches:
                model.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                g = [p.grad / world for p in model.parameters()]
                grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            opt.step()
            step += 1
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2"])
def test_two_one_two_workers_within_an_epoch_exactly_once_and_same_weights(ray_cluster, tmp_path, strategy):
    """FSDP2 + Adam (sharded state, resharded 2 -> 1 -> 2 at restore); parametrize with ``"ddp"``
    for DDP + SGD (replicated state). DDP's 2 -> 1 -> 2 runs in CI as a real elastic resize instead
    (``test_multinode.py::test_elastic_two_one_two_with_real_num_workers_range``: one fit with
    ``num_workers=(1, 2)``, a node removed and one added), to keep the suite's time."""
    base = {
        "strategy": strategy,
        "scenario": "elastic",
        "epochs": 2,
        "every": 100,
        "end_at_jit": True,
        "deadline_s": 1.0,
        "notice_rank": 0,
        "run": "elastic",
    }
    # 96 samples, 4 per rank and step: with 2 workers an epoch is 12 steps.
    assert _fit(tmp_path, "seg1", dict(base, segment=1, notice_at=3), workers=2).error is None
    assert _fit(tmp_path, "seg2", dict(base, segment=2, notice_at=9), workers=1).error is None
    assert _fit(tmp_path, "seg3", dict(base, segment=3, notice_at=None), workers=2).error is None
    out = tmp_path / "out"
    r1, r2, r3 = _resumes(out)
    assert (r1["world_size"], r2["world_size"], r3["world_size"]) == (2, 1, 2)
    assert r2["saved_world_size"] == 2 and r3["saved_world_size"] == 1
    assert 0 < r2["step"] < r3["step"] < 12  # both changes within epoch 0
    assert r2["epoch"] == r3["epoch"] == 0
    for seg, resumed in ((1, r2), (2, r3)):  # a segment's last step is the one the next resumed from
        assert max(step for (_, _, step) in _records(out, seg)) == resumed["step"]
    kept = _lineage(out)
    _assert_exactly_once(kept, epochs=2)
    res = json.load(open(out / "result.json"))
    final = torch.load(out / "final_model.pt", weights_only=True)
    expected = replay(
        [(2, r2["step"]), (1, r3["step"]), (2, res["steps"])],
        epochs=2,
        optimizer=build_adam if strategy == "fsdp2" else build_optimizer,
    )
    assert final.keys() == expected.keys()
    for k in final:  # bitwise: same data order, same DDP averaging, state restored exactly
        assert torch.equal(final[k], expected[k]), k
    assert [e["world_size"] for e in res["events"] if e["event"] == "reprofile"] == [1, 2]
    if strategy == "fsdp2":  # the final model.safetensors, written tensor by tensor by both ranks
        finish = json.load(open(out / "finish.json"))
        assert not finish["failures"] and finish["final_path"] is not None
        written = cf_ray.load_state(finish["final_path"])["model"]
        assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)
