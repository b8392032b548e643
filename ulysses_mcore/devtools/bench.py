"""The benchmark harness under every ``tools/bench_*`` script and ``ulysses-mcore sweep``: one world
runner, one report writer, one progress display.

* :func:`run_world` -- ``world`` spawned processes (one per rank, a free port), their results back;
  a failed rank is an error naming every rank's exit code, never a wait for a result that will not
  come.
* :class:`Report` -- a benchmark's record as ``STEM.json`` (the measurements: what the tables and
  plots are made from), ``STEM.md`` (``render(record)``) and, where the script draws one,
  ``STEM.png`` (``plot(record, path)``), all rewritten after each section, so a run cut short
  keeps what it finished; ``text`` is the table last written (what a script prints at the end).
  :func:`rerender` makes the Markdown again from a committed JSON alone (the tests hold every
  committed table to it).
* :func:`progress` -- tqdm's bar on stderr (a maintained library; plain lines when stderr is not a
  terminal, so logs stay readable).

A script keeps only what it measures, ``render`` and ``plot``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Callable, Dict, Iterable, List, Optional

from tqdm import tqdm

Render = Callable[[Dict], str]
Plot = Callable[[Dict, str], None]


def run_world(world: int, worker, *args, what: str = "a benchmark rank") -> List:
    """Run ``worker(rank, world, port, *args, queue)`` in ``world`` spawned processes and return what
    they put on ``queue``; exits with an error naming the ranks' exit codes if any fails."""
    import torch.multiprocessing as mp  # torch only where a world is spawned: the reports need none

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"error: {what} failed (exit codes per rank: {[p.exitcode for p in procs]})")
    out = []
    while not queue.empty():
        out.append(queue.get())
    return out


def progress(items: Iterable, *, total: Optional[int] = None, desc: str = "", unit: str = "run") -> tqdm:
    """``items`` with a progress bar on stderr (one line per step where stderr is not a terminal)."""
    interactive = sys.stderr.isatty()
    return tqdm(
        items,
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        dynamic_ncols=interactive,
        mininterval=0.5 if interactive else 0,
        ascii=not interactive,
    )


def _plot_safely(plot: Optional[Plot], record: Dict, path: str) -> Optional[str]:
    """Draw ``plot`` into ``path`` (matplotlib's headless backend); ``None`` where matplotlib is absent."""
    if plot is None:
        return None
    try:
        import matplotlib  # optional: the JSON and the table do not need it

        matplotlib.use("Agg")
    except ImportError:
        return None
    plot(record, path)
    return path


class Report:
    """A benchmark's record under ``out/STEM``: :meth:`section` adds a finished section and rewrites
    the JSON, the Markdown and the plot."""

    def __init__(self, out: str, stem: str, render: Render, plot: Optional[Plot] = None, record=None):
        self.base = os.path.join(out, stem)
        self.render, self.plot = render, plot
        self.record: Dict = dict(record or {})
        self.text = ""  # the Markdown last written
        os.makedirs(out or ".", exist_ok=True)

    def section(self, key: str, value) -> None:
        self.record[key] = value
        self.write()

    def run_sections(self, sections, label: str = "") -> int:
        """``sections``: (name, function) pairs, run in order, each written as it finishes; a section that
        raises is recorded as a row saying so and the next one runs.  Returns how many failed."""
        failed = 0
        for name, fn in sections:
            try:
                value = fn()
            except Exception as e:  # noqa: BLE001 - recorded in the report; the next section still runs
                value = [{"skipped": f"failed: {type(e).__name__}: {str(e).strip()[:300]}"}]
                failed += 1
            self.section(name, value)
            print(f"[{label or os.path.basename(self.base)}] {name} done", file=sys.stderr, flush=True)
        return failed

    def write(self) -> str:
        """Rewrite ``STEM.json``, ``STEM.md`` and ``STEM.png`` (atomic per file); return the Markdown."""
        _atomic(self.base + ".json", json.dumps(self.record, indent=1))
        self.text = self.render(self.record)
        _atomic(self.base + ".md", self.text)
        _plot_safely(self.plot, self.record, self.base + ".png")
        return self.text


def _atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load(stem_path: str) -> Dict:
    """The record of ``STEM.json`` (a path without the suffix)."""
    with open(stem_path + ".json") as f:
        return json.load(f)


def rerender(stem_path: str, render: Render) -> str:
    """The Markdown a committed record renders to (compared with the committed ``STEM.md``)."""
    return render(load(stem_path))


__all__ = ["run_world", "progress", "Report", "load", "rerender"]
