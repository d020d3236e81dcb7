"""The sandbox's pure parts: the guest's init script and command line, the console splitter,
the cache stamp and version choice. No root, no network, no guest."""

from __future__ import annotations

import shlex
import subprocess
import time
from pathlib import Path

import pytest

from netem import sandbox
from netem.sandbox import (
    PINNED_LIBC,
    PINNED_UML,
    ConsoleSplitter,
    Disk,
    SandboxError,
    UmlKernel,
    choose_libc,
    choose_uml,
    disk_device,
    guest_markers,
    init_script,
    kernel_command_line,
    libc_minimum,
    parse_madison,
    read_stamp,
    write_stamp,
)


def make_script(**overrides) -> str:
    arguments = {
        "argv": ["python3", "-c", "print('it''s here')"],
        "cwd": "/work/a dir",
        "env": {"PATH": "/venv/bin:/usr/bin", "TRICKY": "a 'quoted' $value\nwith a newline"},
        "module_root": Path("/cache/kernel/modroot"),
        "modprobe_helper": Path("/tmp/tb-uml-x/modprobe"),
        "rc_file": Path("/tmp/tb-uml-x/rc"),
        "token": "t0k3n",
    }
    return init_script(**{**arguments, **overrides})


def job_of(script: str) -> str:
    """The shell text between the start and end markers: the job and its exit-code report."""
    after_start = script.split("-start@@\n", 1)[1]
    return after_start.split("\necho @@sandbox-guest-", 1)[0]


@pytest.mark.parametrize("tty", [True, False])
def test_init_script_is_valid_shell(tty):
    script = make_script(tty=tty)
    result = subprocess.run(["sh", "-n"], input=script, text=True, capture_output=True)
    assert result.returncode == 0, result.stderr


def test_init_script_prepares_the_guest_before_the_job():
    script = make_script()
    lines = script.splitlines()
    assert lines[0] == "#!/bin/sh"
    assert "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in lines
    order = [
        "mount -t proc proc /proc",
        "mount -t sysfs sysfs /sys",
        "mount -t tmpfs tmpfs /run",
        "mount -t devtmpfs devtmpfs /dev",
        "mount -t tmpfs tmpfs /dev/shm",
        "mount -t devpts devpts /dev/pts",
        "echo /tmp/tb-uml-x/modprobe >/proc/sys/kernel/modprobe",
        "modprobe -a -q -d /cache/kernel/modroot veth bridge sch_netem",
        "ip link set lo up",
        "echo @@sandbox-guest-t0k3n-start@@",
        "exec env -i --",
        "echo $? >/tmp/tb-uml-x/rc",
        "echo @@sandbox-guest-t0k3n-end@@",
        "echo o >/proc/sysrq-trigger",
        "while :; do sleep 1; done",
    ]
    positions = [script.index(step) for step in order]
    assert positions == sorted(positions)
    for module in ("sch_netem", "ifb", "act_mirred", "cls_u32", "sch_tbf", "sch_htb"):
        assert module in sandbox.REQUIRED_MODULES


def test_init_script_runs_exactly_the_job_with_exactly_its_environment():
    argv = ["python3", "-c", "print('it''s here')"]
    job, report = job_of(make_script(tty=True)).rsplit("\n", 1)
    assert report == "echo $? >/tmp/tb-uml-x/rc"
    assert job.startswith("(cd -- ") and job.endswith(") </dev/null")
    words = shlex.split(job.replace("(cd --", "cd").replace(") </dev/null", ""))
    # cd DIR && exec env -i -- ASSIGNMENTS... ARGV...
    assert words[:2] == ["cd", "/work/a dir"]
    assert words[2:6] == ["&&", "exec", "env", "-i"]
    assert words[6] == "--"
    assert words[7:9] == ["PATH=/venv/bin:/usr/bin", "TRICKY=a 'quoted' $value\nwith a newline"]
    assert words[9:] == argv


def test_init_script_needs_a_command():
    with pytest.raises(ValueError, match="argv"):
        make_script(argv=[])


@pytest.mark.parametrize("tty", [True, False])
def test_the_job_runs_with_its_environment_when_executed(tmp_path, tty):
    """The job's part of the script, run by a real sh here: quoting survives, nothing else
    leaks into the environment, stderr is kept, and the job's own exit code is reported."""
    job = job_of(
        make_script(
            argv=["sh", "-c", 'printf "%s|%s|%s" "$TRICKY" "$(pwd)" "${HOME-unset}" >&2; exit 5'],
            cwd=str(tmp_path),
            rc_file=tmp_path / "rc",
            tty=tty,
        )
    )
    result = subprocess.run(["sh", "-c", job], capture_output=True, text=True)
    job_output = result.stdout if not tty else result.stderr  # a pipe merges stderr
    assert job_output == f"a 'quoted' $value\nwith a newline|{tmp_path}|unset"
    assert (tmp_path / "rc").read_text() == "5\n"


def test_command_line_boots_the_hosts_root_with_the_console_on_stdout():
    line = kernel_command_line(
        init=Path("/tmp/tb-uml-x/init"), uml_dir=Path("/tmp/tb-uml-x/uml"), umid="tb-1-ab"
    )
    assert " ".join(line) == (
        "mem=1G quiet rootfstype=hostfs rootflags=/ rw con=null con0=null,fd:1 seccomp=auto "
        "uml_dir=/tmp/tb-uml-x/uml umid=tb-1-ab init=/tmp/tb-uml-x/init"
    )


@pytest.mark.parametrize("mem", ["0", "1T", "-1G", "1 G", ""])
def test_command_line_rejects_bad_memory_sizes(mem):
    with pytest.raises(ValueError, match="mem"):
        kernel_command_line(init=Path("/i"), uml_dir=Path("/u"), umid="x", mem=mem)


def test_command_line_rejects_whitespace_that_would_split_an_argument():
    with pytest.raises(ValueError, match="init"):
        kernel_command_line(init=Path("/a dir/init"), uml_dir=Path("/u"), umid="x")


def test_disks_become_the_guests_block_devices_in_order():
    line = kernel_command_line(init=Path("/i"), uml_dir=Path("/u"), umid="x",
                               disks=[Disk(Path("/c/docker.img"), cow=Path("/t/run.cow")),
                                      Disk(Path("/c/other.img"))])
    assert line[-2:] == ["ubdb=/t/run.cow,/c/docker.img", "ubdc=/c/other.img"]
    assert [disk_device(i) for i in range(2)] == ["/dev/ubdb", "/dev/ubdc"]
    with pytest.raises(ValueError, match=r"disks\[0\]\.image"):
        kernel_command_line(init=Path("/i"), uml_dir=Path("/u"), umid="x",
                            disks=[Disk(Path("/c/a,b.img"))])
    with pytest.raises(ValueError, match="at most 7"):
        disk_device(7)


def test_console_shows_warnings_and_the_job_and_drops_boot_noise_and_power_off():
    start, end = guest_markers("tok")
    console = ConsoleSplitter("tok")
    stream = (
        b"Failed to initialize ubd device 0 :Couldn't determine size of device's file\n"
        b"sandbox: could not load every module of: sch_netem\n"
        + start + b"\nline one\nno newline at the end" + end + b"\nsysrq: Power Off\n"
    )
    shown = b"".join(console.feed(stream[i : i + 5]) for i in range(0, len(stream), 5))
    shown += console.finish()
    assert shown == (
        b"sandbox: could not load every module of: sch_netem\n"
        b"line one\nno newline at the end"
    )
    assert bytes(console.raw) == stream


def test_console_holds_back_only_what_could_be_the_end_marker():
    start, end = guest_markers("tok")
    console = ConsoleSplitter("tok")
    assert console.feed(start + b"\nprogress ...") == b"progress ..."
    assert console.feed(b".." + end[:4]) == b".."
    assert console.feed(b"x") == end[:4] + b"x"  # it was not the marker after all
    assert console.feed(end + b"\nreboot: Power down\n") == b""


def test_console_without_an_end_marker_gives_everything_back():
    start, _ = guest_markers("tok")
    console = ConsoleSplitter("tok")
    shown = console.feed(start + b"\nKernel panic - not syncing: @@sandbox-guest-t")
    assert shown + console.finish() == b"Kernel panic - not syncing: @@sandbox-guest-t"


def fake_cache(cache: Path, uml: str = PINNED_UML, libc: str = PINNED_LIBC) -> UmlKernel:
    """A cache with the files a stamp vouches for (empty stand-ins for the real ones)."""
    kernel_dir = cache.resolve() / f"kernel-{uml}_{libc}"
    kernel = UmlKernel(
        binary=kernel_dir / "root" / "usr" / "bin" / "linux.uml",
        module_root=kernel_dir / "modroot",
        kernel_version="7.2.7",
        uml_package=uml,
        libc_package=libc,
    )
    kernel.binary.parent.mkdir(parents=True)
    kernel.binary.write_text("#!/bin/sh\n")
    kernel.binary.chmod(0o755)
    modules = kernel.module_root / "lib" / "modules" / "7.2.7"
    modules.mkdir(parents=True)
    (modules / "modules.dep").write_text("")
    return kernel


def test_stamp_round_trip(tmp_path):
    kernel = fake_cache(tmp_path)
    assert read_stamp(tmp_path) is None  # files without a stamp: not complete
    write_stamp(tmp_path, kernel)
    assert read_stamp(tmp_path) == kernel
    assert not list(tmp_path.glob("*.partial"))


def test_stamp_does_not_vouch_for_missing_files(tmp_path):
    kernel = fake_cache(tmp_path)
    write_stamp(tmp_path, kernel)
    (kernel.module_root / "lib" / "modules" / "7.2.7" / "modules.dep").unlink()
    assert read_stamp(tmp_path) is None


def test_stamp_of_other_pins_or_format_is_stale(tmp_path):
    write_stamp(tmp_path, fake_cache(tmp_path))
    stamp = tmp_path / "stamp.json"
    text = stamp.read_text()
    stamp.write_text(text.replace(f'"{PINNED_UML}"', '"6.0um1"', 1))
    assert read_stamp(tmp_path) is None
    stamp.write_text(text.replace('"format": 1', '"format": 0'))
    assert read_stamp(tmp_path) is None
    stamp.write_text(text[:-10])
    assert read_stamp(tmp_path) is None


def test_a_moved_cache_is_stale(tmp_path):
    """The binary's ELF interpreter is an absolute path into the cache: it cannot move."""
    (tmp_path / "a").mkdir()
    write_stamp(tmp_path / "a", fake_cache(tmp_path / "a"))
    assert read_stamp(tmp_path / "a") is not None
    (tmp_path / "a").rename(tmp_path / "b")
    assert read_stamp(tmp_path / "b") is None


def test_warm_prepare_returns_from_the_stamp_without_network_or_tools(tmp_path, monkeypatch):
    kernel = fake_cache(tmp_path)
    write_stamp(tmp_path, kernel)
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools-here"))
    started = time.monotonic()
    assert sandbox.prepare(tmp_path, quiet=True) == kernel
    assert time.monotonic() - started < 0.5


def test_cold_prepare_names_the_missing_tools_and_the_fix(tmp_path, monkeypatch):
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("apt-get", "apt-cache", "dpkg-deb", "dpkg"):
        (tools / tool).symlink_to(f"/usr/bin/{tool}")
    monkeypatch.setenv("PATH", str(tools))
    with pytest.raises(SandboxError) as caught:
        sandbox.prepare(tmp_path / "cache")
    message = str(caught.value)
    assert "patchelf" in message and "apt-get install" in message and "bootstrap.sh" in message
    assert not (tmp_path / "cache").exists()  # nothing fetched, nothing written


def test_default_cache_is_outside_the_repository(monkeypatch, tmp_path):
    monkeypatch.delenv("TESTBED_CACHE", raising=False)
    assert sandbox.default_cache_dir() == Path.home() / ".cache" / "testbed" / "uml"
    monkeypatch.setenv("TESTBED_CACHE", str(tmp_path))
    assert sandbox.default_cache_dir() == tmp_path / "uml"


MADISON = """\
user-mode-linux |     7.3um1 | http://mirror.invalid/debian sid/main amd64 Packages
user-mode-linux | 6.12.38-1um1 | http://mirror.invalid/debian trixie/main amd64 Packages
"""


def test_parse_madison():
    assert parse_madison(MADISON) == [("7.3um1", "sid"), ("6.12.38-1um1", "trixie")]


def test_the_pinned_kernel_is_used_while_the_mirror_has_it():
    assert choose_uml([PINNED_UML, "7.3um1"]) == (PINNED_UML, None)


def test_the_newest_kernel_is_used_when_the_pin_is_gone():
    chosen, note = choose_uml(["7.10um1", "7.3um1"])
    assert chosen == "7.10um1"  # Debian order, not string order
    assert PINNED_UML in note and "7.10um1" in note


def test_no_kernel_at_all_is_a_clear_error():
    with pytest.raises(SandboxError, match="user-mode-linux"):
        choose_uml([])


def test_libc_pin_when_listed_and_new_enough():
    listed = [(PINNED_LIBC, "trixie"), ("2.42-1", "sid")]
    assert choose_libc(listed, "2.38") == (PINNED_LIBC, None)


def test_libc_fallback_prefers_trixie_then_sid_and_respects_the_bound():
    listed = [("2.41-12+deb13u9", "trixie"), ("2.41-12+deb13u5", "trixie"), ("2.43-2", "sid")]
    assert choose_libc(listed, "2.38")[0] == "2.41-12+deb13u9"
    chosen, note = choose_libc(listed, "2.42")
    assert chosen == "2.43-2" and "sid" in note
    with pytest.raises(SandboxError, match=r">= 2\.44"):
        choose_libc(listed, "2.44")


def test_libc_minimum_from_control_fields():
    control = "Package: user-mode-linux\nDepends: libc6 (>= 2.38), adduser\nVersion: 7.2um1\n"
    assert libc_minimum(control) == "2.38"
    assert libc_minimum("Package: x\nDepends: adduser\n") is None


def test_modprobe_helper_passes_every_argument_through():
    helper = sandbox.modprobe_helper_script(Path("/cache/a dir/modroot"))
    assert helper.splitlines() == [
        "#!/bin/sh",
        "exec modprobe -d '/cache/a dir/modroot' \"$@\"",
    ]
