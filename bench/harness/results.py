"""Where a bench's results go: PREFIX.json (the measurements), PREFIX.md (the report, rendered from them
alone) and, where a curve says more, PREFIX.png; each finished row as soon as it finishes.

    out = H.Results(opts.out, settings)              # settings: what a row's measurement depends on
    row = out.row("small|torch", lambda: measure())  # computed once; kept in PREFIX.rows.json at once
    out.write(payload, render, plot)                 # PREFIX.json + PREFIX.md (+ PREFIX.png)
    out.rewrite(render, plot)                        # --from-json: the report again, from PREFIX.json

A run stopped halfway keeps its finished rows: the next run with the same settings takes them from the rows
file instead of measuring them again (each row records the load average it was measured at). ``write``
removes the rows file unless ``keep_rows``. The payload gets ``machine``: the CPU count, the torch version
and the 1-, 5- and 15-minute load averages at the start and at the end of the run.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any


def machine() -> dict:
    """CPU count and load averages now (torch's version when torch is loaded)."""
    import sys

    out: dict[str, Any] = {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]}
    if "torch" in sys.modules:
        out["torch"] = sys.modules["torch"].__version__
    return out


def load_line(m: dict | None = None) -> str:
    m = m or machine()
    return "load average {:.2f}, {:.2f}, {:.2f} on {} CPUs".format(*m["load_average"], m["cpus"])


def cpus_of_load_line(line: str) -> int | None:
    """The CPU count a ``load_line`` recorded (None where ``line`` is not one)."""
    found = re.search(r"on (\d+) CPUs", line)
    return int(found.group(1)) if found else None


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")


def dump_json(path: str, obj: Any, indent: int | None = 1) -> None:
    """Write ``obj`` as JSON through a temporary file and a rename (never a half-written file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent, default=_finite)
    os.replace(tmp, path)


class Results:
    """The output files of one bench run, and its finished rows (see the module docstring)."""

    def __init__(self, prefix: str, settings: dict | None = None, *, rows_path: str | None = None,
                 fresh: bool = False, keep_rows: bool = False) -> None:
        self.prefix = prefix
        self.rows_path = rows_path or prefix + ".rows.json"
        self.settings = json.dumps(settings or {}, sort_keys=True, default=str)
        self.keep_rows = keep_rows
        self.start = machine()
        self.rows: dict[str, Any] = {}
        self.meta: dict[str, dict] = {}
        if os.path.exists(self.rows_path) and not fresh:
            with open(self.rows_path) as f:
                saved = json.load(f)
            if saved.get("settings") == self.settings:
                self.rows, self.meta = saved["rows"], saved.get("meta", {})
                print(f"resuming: {len(self.rows)} finished row(s) from {self.rows_path}", flush=True)

    def row(self, key: str, compute: Callable[[], Any]) -> Any:
        """The row ``key``: from the rows file when a run with these settings finished it, else computed and
        saved there at once."""
        if key not in self.rows:
            self.rows[key] = compute()
            self.meta[key] = {"load_average": machine()["load_average"],
                              "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
            meta = {k: v for k, v in self.meta.items() if k in self.rows}
            dump_json(self.rows_path, {"settings": self.settings, "rows": self.rows, "meta": meta}, indent=None)
        return self.rows[key]

    def write(self, payload: Any, render: Callable[[Any], str],
              plot: Callable[[Any, str], Any] | None = None, *, record_machine: bool = True) -> str:
        """Write PREFIX.json, PREFIX.md (``render(payload)``) and PREFIX.png (``plot(payload, path)``)."""
        if record_machine and isinstance(payload, dict):
            payload.setdefault("machine", {"start": self.start, "end": machine()})
        dump_json(self.prefix + ".json", payload)
        md = self._report(payload, render, plot)
        if not self.keep_rows and os.path.exists(self.rows_path):
            os.remove(self.rows_path)
        return md

    def rewrite(self, render: Callable[[Any], str], plot: Callable[[Any, str], Any] | None = None) -> str:
        """``--from-json``: PREFIX.md (and PREFIX.png) again from PREFIX.json; nothing is measured."""
        with open(self.prefix + ".json") as f:
            payload = json.load(f)
        return self._report(payload, render, plot)

    def _report(self, payload: Any, render: Callable[[Any], str], plot: Callable[[Any, str], Any] | None) -> str:
        md = render(payload)
        with open(self.prefix + ".md", "w") as f:
            f.write(md)
        written = [self.prefix + ".json", self.prefix + ".md"]
        if plot is not None:
            import matplotlib

            matplotlib.use("Agg")
            plot(payload, self.prefix + ".png")
            written.append(self.prefix + ".png")
        print(md)
        print("wrote " + ", ".join(written), flush=True)
        return md
