"""Delay tables made from measured delays, as iproute2's maketable makes them: no kernel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from netem.distribution import (
    NETEM_DIST_SCALE,
    TABLE_SIZE,
    make_table,
    maketable_stats,
    read_samples,
    sample_table,
    table_digest,
)


def write(path: Path, values) -> Path:
    path.write_text("\n".join(repr(float(value)) for value in values) + "\n")
    return path


def test_table_is_maketables_to_the_entry(tmp_path):
    # iproute2's maketable (6.x, netem/maketable.c) gave a table of this digest for this file.
    samples = write(tmp_path / "delays.txt", [(i * 7919 % 1000) ** 1.5 for i in range(5000)])
    made = sample_table(samples)
    assert made.digest == "4c411c82bde9fdf2"
    assert made.table[:4] == (-10914, -10914, -10914, -10914)
    assert made.table[2048] == -1255
    assert sum(made.table) == 73277


def test_table_is_an_inverse_cdf_of_the_normalised_samples(tmp_path):
    values = np.random.default_rng(5).normal(40.0, 3.0, 20_000)
    made = sample_table(write(tmp_path / "normal.txt", values))
    table = np.array(made.table)
    assert table.size == TABLE_SIZE
    assert (np.diff(table) >= 0).all()  # quantiles, in order
    assert table[-1] == 2**15 - 1  # maketable's last entry is always +4 sigma
    # The middle of a normal sample is its mean: 0 sigma; its quartiles are +-0.674 sigma.
    assert abs(table[TABLE_SIZE // 2]) < 0.05 * NETEM_DIST_SCALE
    assert table[TABLE_SIZE // 4] / NETEM_DIST_SCALE == pytest.approx(-0.674, abs=0.05)
    assert (made.mean, made.stdev) == pytest.approx((values.mean(), values.std(ddof=1)))


def test_stats_are_maketables():
    mean, stdev = maketable_stats(np.array([1.0, 2.0, 4.0]))
    assert (mean, stdev) == pytest.approx((7 / 3, np.std([1.0, 2.0, 4.0], ddof=1)))


def test_make_table_fills_gaps_between_few_samples():
    values = np.array([1.0, 2.0, 2.0, 3.5, 10.0])
    table = make_table(values, *maketable_stats(values))
    assert len(table) == TABLE_SIZE and -(2**15) not in table


def test_digest_names_the_contents():
    assert table_digest((1, 2, 3)) == table_digest((1, 2, 3)) != table_digest((1, 2, 4))
    assert len(table_digest((1, 2, 3))) == 16


def test_comments_and_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "ping.txt"
    path.write_text("# rtt in ms\n10.5\n\n  11\n# more\n12e0\n")
    assert read_samples(path).tolist() == [10.5, 11.0, 12.0]


def test_a_csv_column_by_its_header(tmp_path):
    path = tmp_path / "probes.csv"
    path.write_text("seq,rtt_ms\n1,10.5\n2,11\n\n3,12\n")
    assert read_samples(path, "rtt_ms").tolist() == [10.5, 11.0, 12.0]


@pytest.mark.parametrize(
    ("text", "column", "message"),
    [
        ("10\n11\nfast\n", None, r"samples.txt line 3: expected a number, got 'fast'"),
        ("10\nnan\n", None, r"samples.txt line 2: expected a finite number"),
        ("10\n", None, r"samples.txt: a table needs at least 2 samples, found 1"),
        ("seq,rtt\n1,10\n2,\n", "rtt", r"samples.txt line 3: expected a number, got ''"),
        ("seq,rtt\n1,10\n2\n", "rtt", r"samples.txt line 3: no value in column 'rtt'"),
        ("seq,rtt\n1,10\n", "delay", r"samples.txt: no column 'delay' .*columns: seq, rtt"),
        ("5\n5\n5\n", None, r"samples.txt: the samples do not vary"),
    ],
)
def test_errors_name_the_file_and_line(tmp_path, text, column, message):
    path = tmp_path / "samples.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        sample_table(path, column)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"nothing.txt: No such file"):
        sample_table(tmp_path / "nothing.txt")


def test_a_changed_file_is_read_again(tmp_path):
    path = write(tmp_path / "delays.txt", [1, 2, 3, 4])
    before = sample_table(path)
    write(path, [1, 2, 3, 40, 41])
    assert sample_table(path).digest != before.digest
