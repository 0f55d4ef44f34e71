"""Long benchmark steps say they are still running, and printed tables never show `nan`."""

from __future__ import annotations

import threading

from serving.benchmarks.progress import ticking
from serving.benchmarks.serve_bench import _table


def test_a_long_step_logs_while_it_runs_and_stops_when_it_ends() -> None:
    lines: list[str] = []
    two = threading.Event()

    def log(line: str) -> None:
        lines.append(line)
        if len(lines) >= 2:
            two.set()

    with ticking(log, "(engine) run 2/3", expected_s=100.0, every_s=0.01):
        assert two.wait(10)
    assert all(line.startswith("    (engine) run 2/3: ") and "s left" in line for line in lines)
    # Its thread is joined when the step ends: nothing logs after it.
    assert not any(thread.name == "bench-progress" for thread in threading.enumerate())


def test_a_figure_a_column_lacks_is_a_dash_not_nan() -> None:
    text = _table({"engine alone": {"busy_pct": 99.5}, "API": {"busy_pct": float("nan"), "p50_itl_ms": 3.0}})
    assert "nan" not in text
    busy, itl = text.splitlines()[1:]
    assert busy.split()[1:] == ["99.50", "-"] and itl.split()[1:] == ["-", "3.00"]
