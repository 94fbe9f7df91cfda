"""The fault soak (issue 23): seeded fault schedules against an uninterrupted reference.

``cf-ray soak --seeds N --out DIR`` (or ``python -m benchmarks.soak``): every schedule is one
``TorchTrainer`` run of the demo's loop on a multi-node test cluster, with one to three faults injected
from outside cf_ray's processes — workers, holders and the controller SIGKILLed at drawn points (a
step, mid-copy, mid-persist, mid-restore, mid-commit), a node removed, checkpoint storage failing or
hanging, one bit flipped in a holder's slot, in a committed file and in a direct transfer — and
checked: final state bitwise equal to the reference, every sample once per epoch, no committed
checkpoint lost, no fault silent, each holder's memory bounded.

Modules: ``schedule`` (drawing), ``storage`` (the faulty filesystem), ``probes`` (the worker-process
setup hook), ``procs`` (processes, slots, signals, flips), ``monitor`` (what the run does),
``inject`` (the faults), ``checks`` (the verdicts), ``report`` (the tables), ``runner`` (the soak).
The user's guide: ``docs/benchmarks/soak.md``.
"""
