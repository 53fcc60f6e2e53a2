"""The --benchmark table at the end of a run: median and max of each duration over the steps."""

from __future__ import annotations

from example_trainer.grpo import print_benchmark_summary


def test_the_benchmark_table_lists_durations_and_leaves_out_the_wall_clock(capsys):
    # time/wall is the Unix time a step ended: its "median" is a date, not a duration.
    history = [{"step": s, "time/step": 0.5 * s, "time/wall": 1.8e9 + s, "sync/seconds": 0.01 * s,
                "train/loss": 0.1} for s in (1, 2, 3)]
    print_benchmark_summary(history)
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows == {"sync/seconds": ["0.0200", "0.0300"], "time/step": ["1.0000", "1.5000"]}
