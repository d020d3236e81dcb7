"""The zygote a run leaves idle is taken by the next run of the same process, and only by one
whose workers would inherit what the first run's did (no root: nothing is forked here)."""

from __future__ import annotations

from testbed.cluster import zygote


def test_the_next_run_takes_the_idle_zygote_unless_the_environment_changed(tmp_path,
                                                                            monkeypatch):
    log = str(tmp_path / "zygote.log")
    first = zygote.acquire(lambda rank, report: None, log)
    try:
        zygote.release(first)
        monkeypatch.setenv("PYTEST_CURRENT_TEST", "the next test")  # pytest's, not the run's
        second = zygote.acquire(lambda rank, report: None, log)
        assert second is first and second.alive()
        zygote.release(second)

        monkeypatch.setenv("TESTBED_ZYGOTE_TEST", "another environment")
        third = zygote.acquire(lambda rank, report: None, log)
        assert third is not first
        assert not first.alive(), "a zygote with another environment is ended, not kept"
        zygote.release(third)
    finally:
        zygote.close_idle()
        first.close()
    assert not third.alive()
