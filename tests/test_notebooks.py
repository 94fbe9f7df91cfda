"""The notebooks are committed with their outputs, and those outputs come from the current code.

- fast: the committed notebook holds exactly the cells ``notebooks/make_notebook.py`` builds, every
  code cell was executed without error, and the plots are there (so a reader on a code host sees
  the tables and the plot);
- slow, in the default suite: section 4's own cells in a fresh kernel (an interrupted kernel, the
  cell run again): the second fit resumes mid-run;
- slow, nightly: it runs top to bottom as a user would run it in Jupyter (the run, the injected
  failure, the interrupted and resumed fit, the budgets), and a fresh execution gives the committed
  outputs: the same text in the cells tagged ``deterministic``, outputs of the same kinds (tables
  with the same columns, a plot) in the others, whose numbers depend on timing. After editing a
  cell, or a change that alters what a cell shows, regenerate:
  ``.venv/bin/python notebooks/make_notebook.py``.

No run may print a traceback, whichever thread raised it: ``make_notebook.py`` keeps one in the
committed copy (and exits 1), where the fast test finds it.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _maker():
    spec = importlib.util.spec_from_file_location("make_notebook", os.path.join(ROOT, "notebooks", "make_notebook.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKER = _maker()
COMMITTED = MAKER.PATH

#: Ray's log lines, printed by a background thread into whichever cell runs at the time:
#: ``(raylet) A worker died ...``, ``(RayTrainWorker pid=123) ...``, possibly in colour.
_RAY_LOG_LINE = re.compile(r"^(\x1b\[[0-9;]*m)?\((raylet|[A-Za-z_:]+ pid=[^)]*)\)")


def _stdout(cell) -> str:
    text = "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
    return "".join(line for line in text.splitlines(keepends=True) if not _RAY_LOG_LINE.match(line))


def _shown(cell) -> list:
    """What a deterministic cell shows: its stdout (less Ray's log lines) and its results' text."""
    shown: list = [_stdout(cell)] if _stdout(cell) else []
    for o in cell.outputs:
        if o.output_type in ("execute_result", "display_data"):
            shown.append({k: v for k, v in o.data.items() if k.startswith("text/")})
        elif o.output_type == "error":
            shown.append((o.ename, o.evalue))
    return shown


def _kinds(cell) -> set:
    """The kinds of output a cell shows (stderr, Ray's and the kernel's logs, left out)."""
    kinds = {("stream", "stdout")} if _stdout(cell).strip() else set()
    for o in cell.outputs:
        if o.output_type in ("execute_result", "display_data"):
            kinds.update((o.output_type, mime) for mime in o.data)
        elif o.output_type == "error":
            kinds.add(("error", o.ename))
    return kinds


def _columns(cell) -> list[list[str]]:
    """The header of every HTML table (a DataFrame) the cell shows."""
    out = []
    for o in cell.outputs:
        html = o.get("data", {}).get("text/html", "")
        for head in re.findall(r"<thead>(.*?)</thead>", html, re.S):
            out.append(re.findall(r"<th[^>]*>(.*?)</th>", head, re.S))
    return out


def _code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def _is_deterministic(cell) -> bool:
    return MAKER.DETERMINISTIC in cell.metadata.get("tags", [])


def test_every_notebook_is_generated_and_checked_here():
    import glob

    assert sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb"))) == [COMMITTED]


def test_the_committed_notebook_is_the_generated_one_with_its_outputs():
    committed = nbformat.read(COMMITTED, as_version=4)
    built = MAKER.build()
    assert [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in committed.cells] == [
        (c.cell_type, c.source, c.metadata.get("tags", [])) for c in built.cells
    ], "notebooks/make_notebook.py changed: run it to regenerate the notebook with its outputs"
    code = _code_cells(committed)
    assert all(c.execution_count is not None for c in code), "committed without outputs: run make_notebook.py"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "executed top to bottom, once"
    assert not MAKER.failures(committed), "the committed run printed an error: fix it and regenerate"
    assert not [o for c in code for o in c.outputs if o.output_type == "stream" and o.name == "stderr"]
    kinds = set().union(*(_kinds(c) for c in code))
    assert ("display_data", "image/png") in kinds, "the plot"
    assert ("execute_result", "text/html") in kinds, "the tables"
    assert os.path.getsize(COMMITTED) < 1_000_000
    for needle in (
        "def train_loop_per_worker",
        "cf_ray.Checkpointer(",
        "cf_ray.Adaptive(",
        "FailureConfig(max_failures",
        "os.kill(os.getpid(), signal.SIGKILL)",
        "ckpt.restore()",
        ".profile()",
        "report.plot_profile(",
        "signal.SIGINT",
        "fit(name, budget_pct=settings[label])",  # the effect of the budget: runs against a baseline
    ):
        assert any(needle in c.source for c in code), needle


def test_a_traceback_from_any_thread_stays_in_the_saved_copy_and_fails_it():
    """``make_notebook.py`` drops Ray's log lines from stderr, never a traceback: a helper thread
    that raised (its traceback lands on stderr, in whichever cell runs) or a cell that raised is a
    failure ``failures()`` names, and it stays in the copy written, where the test of the committed
    copy finds it."""
    nb = MAKER.build()
    cell, other = _code_cells(nb)[:2]
    ray_log = nbformat.v4.new_output("stream", name="stderr", text="(raylet) WARNING: 8 PYTHON worker processes\n")
    thread = nbformat.v4.new_output(
        "stream",
        name="stderr",
        text="Exception in thread Thread-5 (interrupt_past):\nTraceback (most recent call last):\n"
        "TypeError: boolean value of NA is ambiguous\n",
    )
    cell.outputs = [ray_log, thread, nbformat.v4.new_output("stream", name="stdout", text="interrupted\n")]
    other.outputs = [nbformat.v4.new_output("error", ename="SystemExit", evalue="0", traceback=[])]
    MAKER.without_logs(nb)
    assert [o.get("text") for o in cell.outputs] == [thread.text, "interrupted\n"]
    found = MAKER.failures(nb)
    assert len(found) == 2 and "boolean value of NA" in found[0] and "SystemExit: 0" in found[1]
    clean = MAKER.build()
    _code_cells(clean)[0].outputs = [ray_log]
    MAKER.without_logs(clean)
    assert MAKER.failures(clean) == [] and _code_cells(clean)[0].outputs == []


def _as_a_user(monkeypatch) -> None:
    """The kernel runs as a user's would: without the suite's short timings (a 5 s controller
    linger ends the interrupted run's actors before the cell is run again, and its profile then
    starts over with the second fit())."""
    for name in [n for n in os.environ if n.startswith("CF_RAY_")]:
        monkeypatch.delenv(name)


def _section(nb, heading: str) -> list:
    """The cells from the markdown cell that starts with ``heading`` to the next section's."""
    start = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and c.source.startswith(heading))
    end = next(
        (i for i, c in enumerate(nb.cells) if i > start and c.cell_type == "markdown" and c.source.startswith("## ")),
        len(nb.cells),
    )
    return nb.cells[start:end]


def _section_four(nb):
    """Section 4 as a notebook of its own: the set-up, the training loop and ``fit`` (the code cells
    before section 2), section 4's cells, and the last cell (``ray.shutdown()``)."""
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and c.source.startswith("## 2."))
    out = copy.deepcopy(nb)
    out.cells = [c for c in nb.cells[:first] if c.cell_type == "code"] + _section(nb, "## 4.") + [nb.cells[-1]]
    return out


@pytest.mark.slow
def test_an_interrupted_kernel_resumes_mid_run_when_the_cell_is_run_again(tmp_path, monkeypatch):
    """The notebook's section 4, its own cells in a fresh kernel as Jupyter runs them: the fit is
    interrupted (SIGINT into the kernel's main thread once a checkpoint at step 40 has committed),
    and the same cell run again resumes between that checkpoint and the run's end, with nothing
    raised in any thread. Two fits of 400 steps: about 45 s on 2 cores."""
    pytest.importorskip("nbclient")
    _as_a_user(monkeypatch)
    nb = _section_four(MAKER.build())
    assert nb.cells[-1].source == "ray.shutdown()"
    fresh = MAKER.execute(nb, str(tmp_path), timeout_s=240)
    assert not MAKER.failures(fresh)
    by_first_line = {c.source.splitlines()[0]: c for c in _code_cells(fresh)}
    pressed = _stdout(
        by_first_line[
            "def press_interrupt(name, past_step, pressed, stop):  # for this notebook: what the ■ button does"
        ]
    )
    assert re.fullmatch(
        r"interrupted \((SystemExit|KeyboardInterrupt|RayActorError)\) once step (\d+) was committed\n", pressed
    ), pressed
    committed_at = int(re.search(r"step (\d+)", pressed).group(1))
    resumed = _stdout(by_first_line['result = fit("budget1", budget_pct=1.0)  # the same cell, run again'])
    step, steps = map(
        int, re.match(r"the new attempt resumed at step (\d+) of (\d+), from (memory|storage)\n", resumed).groups()[:2]
    )
    assert 40 <= committed_at <= step < steps == 400, resumed
    checked = by_first_line['a = attempts("budget1")']
    assert _stdout(checked) == (
        "attempts: 2\n"
        "the second resumed mid-run, from a checkpoint the interrupted one committed: True\n"
        "it ran to the end: True\n"
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)  # nine fits: ~4 min on 2 idle cores, over 10 on a loaded machine
def test_the_notebook_runs_and_gives_the_committed_outputs(tmp_path, monkeypatch):
    pytest.importorskip("nbclient")
    _as_a_user(monkeypatch)
    committed = nbformat.read(COMMITTED, as_version=4)
    fresh = MAKER.execute(copy.deepcopy(MAKER.build()), str(tmp_path))
    failed = MAKER.failures(fresh)
    assert not failed, "\n".join(failed)
    for was, now in zip(_code_cells(committed), _code_cells(fresh)):
        first_line = now.source.splitlines()[0]
        if _is_deterministic(now):
            assert _shown(now) == _shown(was), f"cell {first_line!r} shows something else than the committed copy"
        else:
            assert _kinds(now) == _kinds(was), f"cell {first_line!r}: outputs of other kinds than the committed copy"
            assert _columns(now) == _columns(was), f"cell {first_line!r}: tables with other columns"
