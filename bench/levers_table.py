"""One table of every full-budget lever run that bench/levers.py printed into bench/results-levers-cpu.txt.

Usage: .venv/bin/python bench/levers_table.py [--results bench/results-levers-cpu.txt] [--budget 680000]
Reads the runs' own printed lines (nothing is re-measured), one row per (variant, seed): held-out simulated AL at
K=3, served AL at K=3 with its per-position acceptance, and the served AL as a ratio of speculators' own trainer at
equal 512-token rows, taken from bench/results-vs-speculators-best-cpu.txt's table. Sorted by served AL.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from levers import BEYOND_FIXED_ARCHITECTURE

BENCH = Path(__file__).resolve().parent
RUN_HEADER = re.compile(r"^\$ \S+ bench/levers\.py --budget (\d+);.* seed (\d+)$")
SIM_LINE = re.compile(r"^  (.+?) sim AL K=3 ([\d.]+) ")
SERVED_LINE = re.compile(r"^  (.+?) served AL K=3 ([\d.]+)  per position ([\d.]+) / ([\d.]+) / ([\d.]+) ")
SPECULATORS_SERVED = re.compile(r"^served AL at K=3 \(vLLM\)\s+([\d.]+)\s+([\d.]+)\s")


def read_lever_runs(results: Path, budget: int) -> dict[tuple[str, int], dict]:
    """(variant, seed) -> {"sim": float, "served": float, "positions": tuple} from the runs at `budget` tokens.
    A variant served again in a later run (reused, same drafter) keeps its first figures."""
    if not results.is_file():
        raise SystemExit(f"{results}: no such results file; bench/levers.py --serve prints the runs it reads "
                         "(pass another one with --results)")
    rows: dict[tuple[str, int], dict] = {}
    run_budget = seed = None
    for line in results.read_text().splitlines():
        if m := RUN_HEADER.match(line):
            run_budget, seed = int(m[1]), int(m[2])
            continue
        if run_budget != budget:
            continue
        if m := SIM_LINE.match(line):
            rows.setdefault((m[1].strip(), seed), {}).setdefault("sim", float(m[2]))
        elif m := SERVED_LINE.match(line):
            row = rows.setdefault((m[1].strip(), seed), {})  # levers.py pads short names
            row.setdefault("served", float(m[2]))
            row.setdefault("positions", (m[3], m[4], m[5]))
    return {key: row for key, row in rows.items() if "served" in row}


def speculators_served_al(best: Path) -> float:
    if not best.is_file():
        raise SystemExit(f"{best}: no such results file; bench/vs_speculators.py --budget full prints it "
                         "(pass another one with --speculators-results)")
    for line in best.read_text().splitlines():
        if m := SPECULATORS_SERVED.match(line):
            return float(m[2])
    raise SystemExit(f"{best}: no 'served AL at K=3 (vLLM)' row in its table")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=BENCH / "results-levers-cpu.txt")
    p.add_argument("--speculators-results", type=Path, default=BENCH / "results-vs-speculators-best-cpu.txt")
    p.add_argument("--budget", type=int, default=680000, help="trained tokens per variant of the runs to list")
    a = p.parse_args(argv)
    rows = read_lever_runs(a.results, a.budget)
    if not rows:
        raise SystemExit(f"{a.results}: no run at --budget {a.budget} with a served line")
    ref = speculators_served_al(a.speculators_results)
    width = max(len(name) for name, _ in rows)
    print(f"{len(rows)} full-budget runs ({a.budget} tokens) from {a.results.name}; speculators' own trainer at "
          f"512-token rows serves {ref:.3f} ({a.speculators_results.name}); item 3's 1.15x is {1.15 * ref:.3f}")
    print(f"{'variant':<{width}}  seed  held-out  served  per position          vs speculators")
    for (name, seed), row in sorted(rows.items(), key=lambda kv: -kv[1]["served"]):
        sim = f"{row['sim']:.3f}" if "sim" in row else "   - "
        mark = "  (*)" if name in BEYOND_FIXED_ARCHITECTURE else ""
        print(f"{name:<{width}}  {seed:>4}  {sim:>8}  {row['served']:.3f}  {' / '.join(row['positions'])}"
              f"  {row['served'] / ref:.3f}x{mark}")
    if any(name in BEYOND_FIXED_ARCHITECTURE for name, _ in rows):
        print("(*) leaves the architecture item 3 fixes (1 layer): a measurement of why item 3 is out of reach, "
              "not a candidate for it")


if __name__ == "__main__":
    main()
