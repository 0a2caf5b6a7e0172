"""Run the fault scenarios and print the table; write bench/out/faults.json.

    python -m faults                      every scenario of every faults/f_*.py module, by order
    python -m faults --only NAME,...      just those
    python -m faults --list               the registered scenarios, without running any

Exit code 0 when no row is FAILED, 1 otherwise, 2 for an unknown scenario name.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import tempfile
import time
from pathlib import Path

import faults
from faults.harness import FaultRow, Scenario, failed_row, lab, machine_facts, ordered, render_table, write_report
from tuneproof.core.config import PROJECT_ROOT

OUT = PROJECT_ROOT / "bench" / "out" / "faults.json"


def discover() -> list[str]:
    """Import every faults/f_*.py module (each registers its scenarios); returns their names."""
    found = [m.name for m in pkgutil.iter_modules(faults.__path__) if m.name.startswith("f_")]
    for name in sorted(found):
        importlib.import_module(f"faults.{name}")
    return sorted(found)


def run_all(chosen: list[Scenario], workdir: Path) -> list[FaultRow]:
    """Each scenario in one lab; one that raises becomes a FAILED row and the next one still runs."""
    rows = []
    with lab(workdir) as the_lab:
        for sc in chosen:
            began = time.monotonic()
            print(f"--- fault scenario {sc.order} {sc.name}", flush=True)
            try:
                row = sc.run(the_lab)
            except Exception as e:  # the table must show every row, including the harness's own failures
                row = failed_row(sc, e, time.monotonic() - began)
            print(f"--- {sc.name}: {row.outcome} ({time.monotonic() - began:.0f} s)", flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m faults", description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="comma-separated scenario names")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the JSON report (default {OUT})")
    parser.add_argument("--workdir", type=Path, help="where the lab lives (default: a fresh temp dir)")
    args = parser.parse_args(argv)
    discover()
    try:
        chosen = ordered([n.strip() for n in args.only.split(",") if n.strip()] if args.only else None)
    except KeyError as e:
        print(f"--only: {e.args[0]}")
        return 2
    if args.list:
        for sc in chosen:
            print(f"{sc.order:3d}  {sc.name}  ({sc.run.__module__})")
        return 0
    began = time.monotonic()
    if args.workdir:
        rows = run_all(chosen, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="tp-faults-") as tmp:
            rows = run_all(chosen, Path(tmp))
    total = time.monotonic() - began
    write_report(args.out, rows, total, machine_facts())
    from rich.console import Console

    Console(width=200).print(render_table(rows, total))
    print(f"wrote {args.out}")
    return 1 if any(r.outcome == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
