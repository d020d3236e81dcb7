"""What a command job needs of the file system where it runs: its working directory, its
program, and the script a Python program is given. Checked where a scenario is checked or run
on this host (`load_scenario(..., files=True)`), not wherever it is read: a Compose worker
finds the job's files in its own mount."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from testbed.scenario.fields import Loc

if TYPE_CHECKING:
    from testbed.scenario.model import Scenario


def command_path(path: str | None) -> str:
    """The PATH a command job runs with: the directory of the interpreter that runs the
    testbed first (so `python` is that one), then `path` (the worker's own)."""
    return os.pathsep.join([str(Path(sys.executable).parent), path or os.defpath])


def missing_files(scenario: Scenario, base: Path) -> list[tuple[Loc, str]]:
    """What the command job of `scenario` names and `base` (the scenario's directory) lacks:
    its `cwd`, its program, the script given to `python`. Empty for a training job."""
    job = scenario.command
    if job is None:
        return []
    cwd = base / job.cwd if job.cwd else base
    if not cwd.is_dir():
        return [(("job", "cwd"), f"no directory {cwd} (job.cwd is relative to the scenario "
                                 f"file's directory, {base})")]
    program, *arguments = job.command
    if os.sep in program:  # a path: from the working directory, as the command starts there
        found = (cwd / program).is_file() and os.access(cwd / program, os.X_OK)
        where = f"in {cwd} (the command runs in job.cwd; a program needs its x bit)"
    else:
        search = job.env.get("PATH", command_path(os.environ.get("PATH")))
        found = shutil.which(program, path=search) is not None
        where = "on the workers' PATH (the testbed's interpreter's directory, then this one's)"
    if not found:
        return [(("job", "command", 0), f"no program {program!r} {where}")]
    script = next(iter(arguments), "")
    if (Path(program).name.startswith("python") and script.endswith(".py")
            and not (cwd / script).is_file()):
        return [(("job", "command", 1), f"no file {script} in {cwd} (the command runs in "
                                        "job.cwd, by default the scenario file's directory)")]
    return []
