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
    cf-ray --version                             cf_ray's version, and Ray's, torch's and Python's

A bad RUN (nothing there, a file, a storage path that holds several runs, storage that cannot be
reached) is said in one line on stderr with exit status 2 by every command (``cf_ray._cli_run``).
"""

from __future__ import annotations

import argparse
import os
import posixpath
import sys

from cf_ray._cli_run import BAD_INPUT, CliError, failure, locate
from cf_ray._engine.observe.profile_table import human_size

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
    from cf_ray._engine.format.catalog import list_committed
    from cf_ray._engine.format.commit import read_manifest
    from cf_ray.errors import CfRayError, CheckpointNotFoundError
    from cf_ray.load import list_checkpoints, quarantined_checkpoints

    storage, _ = locate(args.run)
    infos = list_checkpoints(storage.root, storage.fs)
    quarantined = quarantined_checkpoints(storage.root, storage.fs)
    skipped = []  # committed, but its manifest cannot be read: list_checkpoints leaves it out
    for c in list_committed(storage, kinds=("step", "final"), skip_quarantined=True):
        try:
            read_manifest(storage, c.path)
        except CheckpointNotFoundError:
            continue  # deleted since it was listed (keep-last of a live run): not damage
        except CfRayError as e:
            skipped.append((c, str(e).replace(storage.uri(c.path) + "/", "").splitlines()[0]))
    if infos:
        print(f"{'step':>10} {'epoch':>6} {'kind':>10} {'milestone':>9} {'ranks':>5}  path")
        for c in infos:
            print(f"{c.step:>10} {c.epoch:>6} {c.kind:>10} {str(c.milestone):>9} {c.world_size:>5}  {c.path}")
    for step, why in sorted(quarantined.items()):
        print(f"quarantined: step {step} ({why}); kept on storage, never restored from")
    for c, why in skipped:
        print(f"skipped, damaged: {posixpath.basename(c.path)} ({why}); never restored from")
    if skipped:
        print(
            f"{len(skipped)} damaged checkpoint{'s' if len(skipped) != 1 else ''} not listed: cf-ray verify {args.run}"
        )
    if not infos:
        print(f"cf-ray ls: no committed checkpoints under {storage.uri()}", file=sys.stderr)
    return 0 if infos else BAD_INPUT


def profile_parser() -> argparse.ArgumentParser:
    p = _parser(
        "profile",
        "  cf-ray profile cf_ray_runs/my-run\n"
        "  cf-ray profile cf_ray_runs/my-run --all --csv > profile.csv\n\n"
        "Columns by default: step, kind, generation, interval, stall_ms, committed (and error when a\n"
        "checkpoint failed); --all adds the others. Seconds are shown as milliseconds (stall_s as\n"
        "stall_ms), Unix times as ISO 8601 UTC (*_unix as *_utc); a missing value is '-' in the\n"
        "table, empty in CSV, null in JSON.",
    )
    p.add_argument("run", metavar="RUN", help=_RUN_HELP)
    p.add_argument(
        "--all", action="store_true", dest="all_columns", help="every column (default: those of the metrics guide)"
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--csv", action="store_const", const="csv", dest="fmt", help="write CSV (missing: empty)")
    out.add_argument("--json", action="store_const", const="json", dest="fmt", help="write JSON (missing: null)")
    return p


def _profile(args: argparse.Namespace) -> int:
    from cf_ray._engine.observe.profile_table import render
    from cf_ray.run import Run

    storage, _ = locate(args.run)
    run = Run.from_path(storage.root, storage_filesystem=storage.fs)
    print(render(run.profile(), all_columns=args.all_columns, fmt=args.fmt or "table"))
    return 0


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
        "Exit status: 0 all intact, 1 damage found, 2 bad input (no such run, no committed\n"
        "checkpoint, or none at --step).",
    )
    p.add_argument("run", metavar="RUN", help=_RUN_HELP + "; or one checkpoint's directory")
    p.add_argument("--step", type=int, default=None, metavar="N", help="check only the checkpoints of this step")
    return p


def _verify(args: argparse.Namespace) -> int:
    from cf_ray._verify import verify_run

    storage, directory = locate(args.run)
    checks = verify_run(storage, directory, step=args.step)  # no checkpoint: CheckpointNotFoundError, exit 2
    print(f"{'step':>10}  {'kind':<10} status")
    for c in checks:
        if c.vanished:
            status = "GONE (deleted while it was checked: keep-last of a live run)"
        elif c.ok:
            status = f"OK ({c.files} file{'s' if c.files != 1 else ''}, {human_size(c.size_bytes)})"
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
    from cf_ray._export import DCP, check_object_name, export_dcp_dir, export_model

    if args.obj is not None:
        check_object_name(args.obj)
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise CliError(f"{args.out_dir} is a file: give a directory to write to (it is created if missing)")
    storage, directory = locate(args.run)
    if args.to == DCP:
        objects = None if args.obj is None else [args.obj]
        done = export_dcp_dir(storage, directory, args.out_dir, step=args.step, objects=objects)
        print(
            f"wrote {done.path}: a torch.distributed.checkpoint directory, {done.tensors} tensor chunks, "
            f"{human_size(done.size_bytes)}, from the checkpoint of step {done.step} ({done.source})"
        )
        return 0
    done = export_model(storage, directory, args.out_dir, to=args.to, step=args.step, obj=args.obj or "model")
    print(
        f"wrote {done.path}: {done.tensors} tensors, {human_size(done.size_bytes)}, from {done.kind} checkpoint of step "
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


def _version() -> str:
    """``cf-ray --version``: cf_ray's version, and what it runs with (for a bug report)."""
    import platform
    from importlib import metadata

    from cf_ray._version import __version__

    parts = []
    for dist in ("ray", "torch"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} not installed")
    return f"cf-ray {__version__} ({', '.join(parts)}, Python {platform.python_version()})"


def _quiet_stdout() -> None:
    """After the reader of a pipe went away (``cf-ray ls RUN | head``): what is left of the output
    goes nowhere, so that the interpreter's flush at exit does not fail on the closed pipe again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # not a real file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _usage() -> str:
    lines = ["usage: cf-ray {" + ",".join(COMMANDS) + "} [options]", "       cf-ray --version", ""]
    lines += [f"  {k:<8} {v}" for k, v in COMMANDS.items()]
    lines += [
        "",
        "RUN, for every command that reads a run: " + _RUN_HELP + ".",
        "cf-ray COMMAND --help shows the command's options and an example, e.g.:",
        "  cf-ray verify cf_ray_runs/my-run",
    ]
    return "\n".join(lines)


#: Exit status when the reader of the output went away (``| head``), as for a process SIGPIPE ended.
BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rc = _main(argv)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        _quiet_stdout()
        return BROKEN_PIPE


def _main(argv: list[str]) -> int:
    if argv and argv[0] == "--version":
        print(_version())
        return 0
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
    args = PARSERS[cmd]().parse_args(rest)
    try:
        return _RUN[cmd](args)
    except BrokenPipeError:
        raise
    except Exception as e:
        said = failure(e)
        if said is None:  # a bug: its traceback is what a report needs
            raise
        print(f"cf-ray {cmd}: {said[0]}", file=sys.stderr)
        return said[1]


if __name__ == "__main__":
    sys.exit(main())
