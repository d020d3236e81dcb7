"""What every results file opens with: its title, a note in bold where the run is partial or
reduced, and the sentence naming the command, when it started, how long it took and the
machine (`machine.written_by`); one `Run`, started by each benchmark's `main`, gives it."""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

from benchmarks import machine


@dataclass(frozen=True)
class Run:
    """One benchmark run as its results file names it: the command typed, when it started
    (UTC), and the monotonic clock then, so the file says how long it took."""

    command: str
    started: datetime.datetime
    clock: float

    @classmethod
    def start(cls, module: str) -> Run:
        """This process's `python -m MODULE ...`, starting now."""
        return cls(machine.command(module), datetime.datetime.now(datetime.UTC), time.monotonic())

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.clock

    def progress(self, done: int, total: int) -> str:
        """A progress line's opening, `[DONE/TOTAL N.N min]`: cells done and minutes so far."""
        return f"[{done}/{total} {self.elapsed() / 60:.1f} min]"

    def header(self, title: str, note: str = "", also: str = "") -> list[str]:
        """The file's first lines: `# TITLE`, the note in bold if there is one, and the
        machine sentence with `also` right after it (its separator included: what the
        benchmark adds to that paragraph), each followed by a blank line."""
        return [f"# {title}", "", *([f"**{note}**", ""] if note else []),
                machine.written_by(self.command, self.started, self.elapsed()) + also, ""]


def partial(done: int, total: int) -> str:
    """The note of a results file rewritten after every cell: none once the last one is done."""
    return "" if done == total else f"Partial: {done} of {total} cells so far."
