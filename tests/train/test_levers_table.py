"""bench/levers_table.py reads back exactly the lines bench/levers.py prints (one format, checked both ways)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import levers
import levers_table


def lever_result(name: str, al3: float) -> dict:
    return {"name": name, "eval": {"per_step_accuracy": [0.61, 0.5, 0.4], "simulated_acceptance_length": {"3": al3}},
            "final_loss": 3.25, "tokens_per_s": 271.4}


def served(al: float, positions: list[float]) -> dict:
    return {"acceptance_length": al, "per_position": positions, "lossless": True, "output_tokens_per_s": 40.2}


def results_file(tmp_path: Path) -> Path:
    """Two printed runs as levers.py writes them: a short (padded) and a long name, a second seed, a run at
    another budget that must be left out, and a variant served again later (its first figures count)."""
    def header(budget: int, seed: int) -> str:
        return (f"$ .venv/bin/python bench/levers.py --budget {budget}; 2000 anchor conversations, 359 steps = "
                f"{budget + 906} trained tokens per variant, seed {seed}")

    lines = [
        header(680000, 0),
        levers.sim_line(lever_result("base", 2.5), 2580.0),
        levers.sim_line(lever_result("recipe rows=512 lr=1e-3 fc_norm 2 layers", 2.75), 2580.0),
        levers.served_line("base", served(1.8, [0.45, 0.23, 0.12])),
        levers.served_line("recipe rows=512 lr=1e-3 fc_norm 2 layers", served(1.9314, [0.497, 0.274, 0.1604])),
        header(120000, 0),
        levers.sim_line(lever_result("base", 9.0), 10.0),
        levers.served_line("base", served(9.0, [0.9, 0.9, 0.9])),
        header(680000, 1),
        levers.sim_line(lever_result("base", 2.4), 2580.0),
        levers.served_line("base", served(1.7, [0.4, 0.2, 0.1])),
        levers.served_line("base", served(1.6, [0.3, 0.2, 0.1])),
    ]
    path = tmp_path / "results-levers.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_printed_figure_is_read_back(tmp_path):
    rows = levers_table.read_lever_runs(results_file(tmp_path), 680000)
    assert rows == {
        ("base", 0): {"sim": 2.5, "served": 1.8, "positions": ("0.450", "0.230", "0.120")},
        ("recipe rows=512 lr=1e-3 fc_norm 2 layers", 0): {"sim": 2.75, "served": 1.931,
                                                          "positions": ("0.497", "0.274", "0.160")},
        ("base", 1): {"sim": 2.4, "served": 1.7, "positions": ("0.400", "0.200", "0.100")},
    }


def test_table_is_sorted_by_served_with_ratios(tmp_path, capsys):
    best = tmp_path / "best.txt"
    best.write_text("served AL at K=3 (vLLM)                  1.931        1.862   1.04x\n")
    levers_table.main(["--results", str(results_file(tmp_path)), "--speculators-results", str(best)])
    out = capsys.readouterr().out.splitlines()
    assert "serves 1.862" in out[0] and "1.15x is 2.141" in out[0]
    rows = out[2:5]
    assert [line.split("  ")[0] for line in rows] == ["recipe rows=512 lr=1e-3 fc_norm 2 layers", "base", "base"]
    assert [line.split()[-1] for line in rows] == ["(*)", f"{1.8 / 1.862:.3f}x", f"{1.7 / 1.862:.3f}x"]
    assert f"{1.931 / 1.862:.3f}x  (*)" in rows[0]  # a second layer: outside the architecture item 3 fixes
    assert out[5].startswith("(*) leaves the architecture item 3 fixes")


def test_missing_results_file_names_it(tmp_path):
    with pytest.raises(SystemExit, match="no-such.txt: no such results file"):
        levers_table.read_lever_runs(tmp_path / "no-such.txt", 680000)
