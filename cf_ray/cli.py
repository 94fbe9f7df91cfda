"""The ``cf-ray`` command.

Every command that reads a run takes it the same way, as ``RUN``: the run's directory
``<storage_path>/<name>`` (what ``RunConfig(storage_path=..., name=...)`` created), its ``cf_ray``
folder, or the same as a URI (``s3://bucket/runs/my-run``). ``cf-ray <command> --help`` shows an
example for each.

    cf-ray demo                                  the main job (a worker SIGKILLed part-way)
    cf-ray bench                                 the benchmark (from a clone of the repository)
    cf-ray soak                                  the fault soak (from a clone of the repository)
    cf-ray ls RUN                                the committed checkpoints
    cf-ray profile RUN                           the profile table
    cf-ray verify RUN [--step N]                 every file's size and checksum; exit 1 on damage
    cf-ray export RUN [--step N] --to FMT DIR    the model as model.safetensors or model.pt, or
                                                 the checkpoint as a DCP directory (--to dcp)
"""

from __future__ import annotations

import argparse
import sys

_RUN_HELP = (
    "the run: its directory <storage_path>/<name> (as RunConfig(storage_path, name) made it), its cf_ray "
    "folder, or a URI such as s3://bucket/runs/my-run"
)

COMMANDS = {
    "demo": "run the main job: a TorchTrainer run with a worker SIGKILLed part-way",
    "bench": "benchmark cf_ray against Ray Train's own checkpointing and DCP",
    "soak": "fault soak: seeded fault schedules, each run checked against an uninterrupted one",
    "ls": "list a run's committed checkpoints",
    "profile": "print a run's checkpoint profile table",
    "verify": "check every file of a run's checkpoints (size, CRC-32, manifest) without loading them",
    "export": "write a checkpoint's model as model.safetensors or model.pt for other tools",
}


def _parser(cmd: str, example: str, usage: str | None = None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=f"cf-ray {cmd}",
        description=COMMANDS[cmd][0].upper() + COMMANDS[cmd][1:] + ".",
        usage=usage,
        epilog="example:\n" + example,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def ls_parser() -> argparse.ArgumentParser:
    p = _parser("ls", "  cf-ray ls cf_ray_runs/my-run\n  cf-ray ls s3://bucket/runs/my-run")
    p.add_argument("run", metavar="RUN", help=_RUN_HELP)
    return p


def _ls(args: argparse.Namespace) -> int:
    from cf_ray.load import list_checkpoints, quarantined_checkpoints

    infos = list_checkpoints(args.run)
    quarantined = quarantined_checkpoints(args.run)
    if not infos:
        print(f"no committed checkpoints under {args.run}")
    else:
        print(f"{'step':>10} {'epoch':>6} {'kind':>10} {'milestone':>9} {'ranks':>5}  path")
        for c in infos:
            print(f"{c.step:>10} {c.epoch:>6} {c.kind:>10} {str(c.milestone):>9} {c.world_size:>5}  {c.path}")
    for step, why in sorted(quarantined.items()):
        print(f"quarantined: step {step} ({why}); kept on storage, never restored from")
    return 0 if infos else 1


def profile_parser() -> argparse.ArgumentParser:
    p = _parser(
        "profile",
        "  cf-ray profile cf_ray_runs/my-run\n"
        "  cf-ray profile cf_ray_runs/my-run > profile.txt\n\n"
        "(cf-ray profile STORAGE_PATH NAME, the older form, still works and is deprecated)",
        usage="cf-ray profile [-h] RUN",
    )
    p.add_argument("where", nargs="+", metavar="RUN", help=_RUN_HELP)
    return p


def _profile(args: argparse.Namespace) -> int:
    if len(args.where) > 2:
        profile_parser().error("give one RUN: <storage_path>/<name> or a URI")
    from cf_ray.run import Run

    if len(args.where) == 2:
        print(
            f"cf-ray profile STORAGE_PATH NAME is deprecated: give the run as one argument, "
            f"cf-ray profile {args.where[0].rstrip('/')}/{args.where[1]}",
            file=sys.stderr,
        )
        run = Run(*args.where)
    else:
        run = Run.from_path(args.where[0])
    print(run.profile().to_string(index=False))
    return 0


def _size(n_bytes: int) -> str:
    value, unit = float(n_bytes), "B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            break
        value /= 1000
    return f"{n_bytes} B" if unit == "B" else f"{value:.1f} {unit}"


def verify_parser() -> argparse.ArgumentParser:
    p = _parser(
        "verify",
        "  cf-ray verify cf_ray_runs/my-run\n"
        "  cf-ray verify cf_ray_runs/my-run --step 1200\n"
        "  cf-ray verify s3://bucket/runs/my-run && echo intact\n\n"
        "One line per committed checkpoint: its step, its kind, and OK or DAMAGED with the file\n"
        "and what is wrong with it. Every file the manifest lists is read and checked against\n"
        "its size and CRC-32, the manifest against its own checksum, the tensor tables against\n"
        "their data files; no tensor is loaded into a model and nothing is unpickled.\n"
        "Exit status: 0 all intact, 1 damage found, 2 nothing to check (no committed\n"
        "checkpoint, or none at --step).",
    )
    p.add_argument("run", metavar="RUN", help=_RUN_HELP + "; or one checkpoint's directory")
    p.add_argument("--step", type=int, default=None, metavar="N", help="check only the checkpoints of this step")
    return p


def _verify(args: argparse.Namespace) -> int:
    from cf_ray._verify import verify_run
    from cf_ray.errors import CheckpointNotFoundError
    from cf_ray.load import open_run

    storage, directory = open_run(args.run)
    try:
        checks = verify_run(storage, directory, step=args.step)
    except CheckpointNotFoundError as e:
        print(f"cf-ray verify: {e}", file=sys.stderr)
        return 2
    print(f"{'step':>10}  {'kind':<10} status")
    for c in checks:
        if c.vanished:
            status = "GONE (deleted while it was checked: keep-last of a live run)"
        elif c.ok:
            status = f"OK ({c.files} file{'s' if c.files != 1 else ''}, {_size(c.size_bytes)})"
        else:
            status = "DAMAGED: " + "; ".join(c.problems)
        print(f"{c.step:>10}  {c.kind:<10} {status}")
    damaged = [c for c in checks if not c.ok]
    print(
        f"{len(checks)} checkpoint{'s' if len(checks) != 1 else ''} under {storage.uri()}: "
        f"{len(checks) - len(damaged)} intact, {len(damaged)} damaged"
    )
    return 1 if damaged else 0


def export_parser() -> argparse.ArgumentParser:
    p = _parser(
        "export",
        "  cf-ray export cf_ray_runs/my-run --step 1200 --to safetensors exported/\n"
        "  cf-ray export cf_ray_runs/my-run --to torch exported/\n\n"
        "  cf-ray export cf_ray_runs/my-run --step 1200 --to dcp exported_dcp/\n\n"
        "then, in Python:\n"
        "  safetensors.torch.load_file('exported/model.safetensors')\n"
        "  torch.load('exported/model.pt', weights_only=True)\n"
        "  torch.distributed.checkpoint.load({'model': get_model_state_dict(model), ...},\n"
        "                                    checkpoint_id='exported_dcp')   # any number of ranks\n\n"
        "The model is the object tracked as 'model' (Checkpointer({'model': model, ...}));\n"
        "without --step, the newest checkpoint (the final model when the run finished).\n"
        "--to dcp writes every tracked object (or --object) of a full checkpoint, sharded\n"
        "(FSDP2) ones included, as a torch.distributed.checkpoint directory.\n"
        "Every file is verified against the manifest before it is read.",
        usage="cf-ray export [-h] RUN [--step N] --to {safetensors,torch,dcp} DIR",
    )
    p.add_argument("run", metavar="RUN", help=_RUN_HELP + "; or one checkpoint's directory")
    p.add_argument(
        "out_dir", metavar="DIR", help="local directory to write <object>.safetensors, <object>.pt or DCP files to"
    )
    p.add_argument("--to", required=True, choices=("safetensors", "torch", "dcp"), help="the file format")
    p.add_argument("--step", type=int, default=None, metavar="N", help="the checkpoint's step (default: the newest)")
    p.add_argument(
        "--object",
        default=None,
        dest="obj",
        help="the tracked object to export, as named in Checkpointer({...}) (default: model; with --to dcp: all)",
    )
    return p


def _export(args: argparse.Namespace) -> int:
    from cf_ray._export import DCP, export_dcp_dir, export_model
    from cf_ray.errors import CfRayError
    from cf_ray.load import open_run

    storage, directory = open_run(args.run)
    try:
        if args.to == DCP:
            objects = None if args.obj is None else [args.obj]
            done = export_dcp_dir(storage, directory, args.out_dir, step=args.step, objects=objects)
            print(
                f"wrote {done.path}: a torch.distributed.checkpoint directory, {done.tensors} tensor chunks, "
                f"{_size(done.size_bytes)}, from the checkpoint of step {done.step} ({done.source})"
            )
            return 0
        done = export_model(storage, directory, args.out_dir, to=args.to, step=args.step, obj=args.obj or "model")
    except CfRayError as e:  # no such checkpoint, damaged, sharded, not storable: said in one line
        print(f"cf-ray export: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(
        f"wrote {done.path}: {done.tensors} tensors, {_size(done.size_bytes)}, from {done.kind} checkpoint of step "
        f"{done.step} ({done.source})"
    )
    return 0


#: The commands that read a run: their parsers (``--help``, and the examples of docs/reference/cli.md
#: are checked against them) and what they do with the parsed arguments.
PARSERS = {"ls": ls_parser, "profile": profile_parser, "verify": verify_parser, "export": export_parser}
_RUN = {"ls": _ls, "profile": _profile, "verify": _verify, "export": _export}


def _from_repo(cmd: str, module: str, argv: list[str]) -> int:
    """``cf-ray bench`` and ``cf-ray soak`` live in the repository's ``benchmarks/`` package, not in the
    installed one."""
    import importlib
    import pathlib

    try:
        main = importlib.import_module(module).main
    except ImportError:
        root = pathlib.Path(__file__).resolve().parents[1]
        if not (root / "benchmarks" / "__init__.py").exists():
            print(
                f"cf-ray {cmd} runs from a clone of the cf_ray repository (it is not part of the installed "
                f"package): git clone it, `pip install -e .` there and run `cf-ray {cmd}` again",
                file=sys.stderr,
            )
            return 2
        sys.path.insert(0, str(root))
        main = importlib.import_module(module).main
    return main(argv)


def _usage() -> str:
    lines = ["usage: cf-ray {" + ",".join(COMMANDS) + "} [options]", ""]
    lines += [f"  {k:<8} {v}" for k, v in COMMANDS.items()]
    lines += [
        "",
        "RUN, for every command that reads a run: " + _RUN_HELP + ".",
        "cf-ray COMMAND --help shows the command's options and an example, e.g.:",
        "  cf-ray verify cf_ray_runs/my-run",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        known = not argv or argv[0] in ("-h", "--help")
        print(
            _usage() if known else f"cf-ray: unknown command {argv[0]!r}\n\n{_usage()}",
            file=sys.stdout if known else sys.stderr,
        )
        return 0 if known else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from cf_ray.demo import main as demo_main

        return demo_main(rest)
    if cmd == "bench":
        return _from_repo("bench", "benchmarks.bench", rest)
    if cmd == "soak":
        return _from_repo("soak", "benchmarks.soak.runner", rest)
    return _RUN[cmd](PARSERS[cmd]().parse_args(rest))


if __name__ == "__main__":
    sys.exit(main())
