"""``shardax launch`` end to end: every launch runs in a fresh subprocess under
a timeout; ranks are the small scripts in ``scripts/``. Readiness is known by
polling for the PID files the ranks write, never by sleeping blindly."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from shardax.errors import LaunchError
from shardax.launch import LaunchSpec, free_port, launch, rank_command, rank_env
from shardax.launch._cli import launch_command
from shardax.launch._stream import extract_traceback

SCRIPTS = Path(__file__).parent / "scripts"
BEHAVE = str(SCRIPTS / "behave.py")
# Through the real command line (imports shardax, so torch: seconds per start) ...
CLI = [sys.executable, "-c", "from shardax.cli import main; main(prog_name='shardax')", "launch"]
# ... or the same command without the package __init__, for most tests.
LIGHT = [sys.executable, str(SCRIPTS / "light_cli.py")]
FAIL_FAST_BOUND_S = 15.0  # the requirement: a failed rank stops the launch within 15 s
TIMEOUT_S = 60.0  # the last resort: no test can hang the suite


def _env(**extra: str) -> dict[str, str]:
    """The launcher's environment: ours minus what the launcher defaults."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS", "THP_MEM_ALLOC_ENABLE")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.update(extra)
    return env


def run_launch(
    *args: str, env: dict[str, str] | None = None, entry: list[str] = LIGHT
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*entry, *args],
        env=_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def start_launch(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*LIGHT, *args],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def rank_lines(output: str, rank: int) -> list[str]:
    prefix = f"[rank {rank}] "
    return [line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix)]


def wait_for_pids(pid_dir: Path, world: int, proc: subprocess.Popen | None = None) -> list[int]:
    """All pids the ranks wrote (ranks and their children), once all wrote."""
    deadline = time.monotonic() + 30.0
    files = [pid_dir / f"rank{k}.pids" for k in range(world)]
    while not all(f.exists() for f in files):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"launcher exited early: {proc.communicate()}")
        assert time.monotonic() < deadline, f"ranks did not start: {os.listdir(pid_dir)}"
        time.sleep(0.02)
    return [int(pid) for f in files for pid in f.read_text().split()]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"  # a zombie is gone for our purpose


def assert_all_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 5.0  # SIGKILLed processes need a moment to be torn down
    while (alive := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in alive:  # leave nothing behind for the next test either
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"processes left behind: {alive}"


pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="checks /proc for orphaned processes"
)


# --- success: environment, output, arguments ------------------------------------------


def test_two_ranks_get_torchrun_env_and_prefixed_output() -> None:
    result = run_launch("--nproc-per-node", "2", str(SCRIPTS / "report_env.py"), entry=CLI)
    assert result.returncode == 0, result.stderr
    cpus = len(os.sched_getaffinity(0))
    reports = []
    for rank in (0, 1):
        lines = rank_lines(result.stdout, rank)
        assert lines[-1] == "no newline at the end"
        (env_line,) = [line for line in lines if line.startswith("ENV ")]
        report = json.loads(env_line[len("ENV ") :])
        reports.append(report)
        assert report == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": reports[0]["MASTER_PORT"],
            "SHARDAX_LAUNCHED": "1",
            "PYTHONUNBUFFERED": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": str(max(1, cpus // 2)),
            "THP_MEM_ALLOC_ENABLE": "1",
            "argv": [],
            "executable": sys.executable,
        }
        assert rank_lines(result.stderr, rank) == [f"stderr of rank {rank}"]
    assert 0 < int(reports[0]["MASTER_PORT"]) < 65536
    assert "stderr of rank" not in result.stdout


def test_master_addr_port_and_preset_variables_are_kept() -> None:
    port = str(free_port())
    env = _env(OMP_NUM_THREADS="3", GLOO_SOCKET_IFNAME="eth7", THP_MEM_ALLOC_ENABLE="0")
    args = ["--master_addr", "localhost", "--master-port", port, str(SCRIPTS / "report_env.py")]
    result = run_launch(*args, env=env)
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in rank_lines(result.stdout, 0) if line.startswith("ENV ")]
    report = json.loads(line[len("ENV ") :])
    assert (report["MASTER_ADDR"], report["MASTER_PORT"]) == ("localhost", port)
    assert (report["OMP_NUM_THREADS"], report["GLOO_SOCKET_IFNAME"]) == ("3", "eth7")
    assert report["THP_MEM_ALLOC_ENABLE"] == "0"


@pytest.mark.parametrize("form", ["script", "module"])
def test_arguments_pass_through_untouched(form: str) -> None:
    target = ["-m", "report_env"] if form == "module" else [str(SCRIPTS / "report_env.py")]
    passed = ["--lr", "3", "--nproc-per-node", "5", "-m", "x", "--help", "--", "a b", ""]
    result = run_launch("--nproc-per-node", "2", *target, *passed)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        (line,) = [line for line in rank_lines(result.stdout, rank) if line.startswith("ENV ")]
        assert json.loads(line[len("ENV ") :])["argv"] == passed


def test_log_ranks_shows_only_the_chosen_ranks() -> None:
    result = run_launch(
        "--nproc-per-node", "3", "--log-ranks", "0,2", str(SCRIPTS / "report_env.py")
    )
    assert result.returncode == 0, result.stderr
    shown = {m for m in re.findall(r"^\[rank (\d)\] ", result.stdout + result.stderr, re.M)}
    assert shown == {"0", "2"}


def test_lines_of_different_ranks_never_mix() -> None:
    result = run_launch("--nproc-per-node", "2", str(SCRIPTS / "chatter.py"), "400")
    assert result.returncode == 0, result.stderr
    for output in (result.stdout, result.stderr):
        lines = output.splitlines()
        assert len(lines) == 2 * 200
        for line in lines:
            assert re.fullmatch(r"\[rank (\d)\] line \d+ of rank \1 \1{200}", line), line


def test_leftover_children_of_a_successful_rank_are_stopped(tmp_path: Path) -> None:
    result = run_launch("--nproc-per-node", "2", BEHAVE, str(tmp_path), "ok-grandchild", "ok")
    assert result.returncode == 0, result.stderr
    assert "left behind by rank 0" in result.stderr
    assert_all_gone(wait_for_pids(tmp_path, 2))


# --- fail-fast -----------------------------------------------------------------------


@pytest.mark.parametrize("rank0", ["sleep", "sleep-ignore-term", "sleep-grandchild"])
def test_a_raising_rank_stops_everything_and_shows_its_traceback(
    tmp_path: Path, rank0: str
) -> None:
    args = ["--nproc-per-node", "2", "--log-ranks", "0", BEHAVE, str(tmp_path), rank0, "raise"]
    start = time.monotonic()  # the bound includes the launcher's start-up through shardax.cli
    result = run_launch(*args, entry=CLI if rank0 == "sleep" else LIGHT)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    assert elapsed < FAIL_FAST_BOUND_S
    assert "rank 1 failed first: exit code 1" in result.stderr
    summary = result.stderr[result.stderr.index("traceback of rank 1:") :]
    assert summary.splitlines()[1] == "Traceback (most recent call last):"
    assert 'raise ValueError("boom")' in summary
    assert "ValueError: boom" in summary
    assert not rank_lines(result.stdout + result.stderr, 1)  # rank 1 is filtered: summary only
    assert_all_gone(wait_for_pids(tmp_path, 2))


@pytest.mark.parametrize(
    ("action", "code", "words"),
    [("exit3", 3, "exit code 3"), ("sigkill", 137, "killed by SIGKILL (exit code 137)")],
)
def test_the_launcher_exits_with_the_failed_ranks_code(
    tmp_path: Path, action: str, code: int, words: str
) -> None:
    result = run_launch("--nproc-per-node", "2", BEHAVE, str(tmp_path), "sleep", action)
    assert result.returncode == code, result.stderr
    assert f"rank 1 failed first: {words}" in result.stderr
    assert_all_gone(wait_for_pids(tmp_path, 2))


def test_a_rank_without_a_traceback_shows_its_last_lines_of_stdout_and_stderr(
    tmp_path: Path,
) -> None:
    """Its reason may be on stdout, and its stderr only a progress bar and a
    blank line: the summary shows what it said on both, blank lines left out."""
    result = run_launch("--nproc-per-node", "2", BEHAVE, str(tmp_path), "sleep", "quiet-exit2")
    assert result.returncode == 2, result.stderr
    summary = result.stderr[result.stderr.index("rank 1 failed first: exit code 2") :]
    assert "no Python traceback; the last 3 line(s) rank 1 wrote (stdout and stderr" in summary
    said = [line for line in summary.splitlines() if line.startswith("  std")]
    assert sorted(said) == [
        "  stderr| step 2/10",
        "  stdout| fatal: cannot open shard 3",
        "  stdout| giving up",
    ]
    assert said.index("  stdout| fatal: cannot open shard 3") < said.index("  stdout| giving up")
    assert_all_gone(wait_for_pids(tmp_path, 2))


MISMATCH = str(Path(__file__).parents[1] / "collectives" / "scripts" / "mismatch_rank.py")


@pytest.mark.parametrize("backend", ["torch", "shm"])
def test_a_collective_mismatch_ends_the_job_with_exit_1_and_the_error(backend: str) -> None:
    """Issue 35.3: the ranks raise CollectiveMismatchError and exit 1 — no
    SIGABRT in gloo's teardown (tests/collectives/test_exit_status.py checks
    each rank on its own)."""
    if backend == "shm":
        from shardax.collectives._shm_backend import shm_available

        if not shm_available()[0]:
            pytest.skip(f"no shm backend here: {shm_available()[1]}")
    env = _env(SHARDAX_BACKEND=backend)
    result = run_launch("--nproc-per-node", "2", MISMATCH, "psum-shape", env=env)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "SIGABRT" not in result.stderr and "terminate called" not in result.stderr
    summary = result.stderr[result.stderr.index("failed first: exit code 1") :]
    assert "shardax.errors.CollectiveMismatchError: collective #0" in summary
    assert "they differ in: element count" in summary


def test_the_first_failure_wins(tmp_path: Path) -> None:
    # Rank 0 exits 5 when the launcher stops it: a consequence, not the cause.
    result = run_launch("--nproc-per-node", "2", BEHAVE, str(tmp_path), "term-exit5", "raise")
    assert result.returncode == 1, result.stderr
    assert "rank 1 failed first: exit code 1" in result.stderr
    assert "other ranks: rank 0: exit code 5" in result.stderr
    assert_all_gone(wait_for_pids(tmp_path, 2))


# --- the job's time limit ---------------------------------------------------------------


def test_timeout_stops_a_job_that_never_ends(tmp_path: Path) -> None:
    """--timeout 15: both ranks still run (one ignores SIGTERM, one has a
    child) when it passes; all are stopped, named with their last lines,
    and the launcher exits 124. (The outcome is asserted, not the time:
    15 s leaves a loaded host ample time to start both ranks, which the
    last lines need.)"""
    args = ["--nproc-per-node", "2", "--timeout", "15", "--kill-grace", "1", BEHAVE, str(tmp_path)]
    result = run_launch(*args, "sleep-ignore-term", "sleep-grandchild")
    assert result.returncode == 124, result.stderr
    assert "the job ran past --timeout 15 s; stopping rank 0, rank 1" in result.stderr
    summary = result.stderr[result.stderr.index("2 rank(s) were still running: rank 0, rank 1") :]
    assert "rank 0: killed by SIGKILL (exit code 137); its last 1 line(s):" in summary
    assert "rank 1: killed by SIGTERM (exit code 143); its last 1 line(s):" in summary
    assert "stdout| rank 0 sleeping" in summary and "stdout| rank 1 sleeping" in summary
    assert_all_gone(wait_for_pids(tmp_path, 2))


def test_a_job_within_its_timeout_is_untouched(tmp_path: Path) -> None:
    result = run_launch(
        "--nproc-per-node", "2", "--timeout", "600", BEHAVE, str(tmp_path), "ok", "ok"
    )
    assert result.returncode == 0, result.stderr
    assert "--timeout" not in result.stderr


# --- signals to the launcher -----------------------------------------------------------


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signal_stops_every_rank(tmp_path: Path, signum: int, code: int) -> None:
    args = ["--nproc-per-node", "2", "--kill-grace", "1", BEHAVE, str(tmp_path)]
    proc = start_launch(*args, "sleep-grandchild", "sleep-ignore-term")
    try:
        pids = wait_for_pids(tmp_path, 2, proc)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=FAIL_FAST_BOUND_S)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == code, stderr
    assert f"got {signal.Signals(signum).name}" in stderr
    assert_all_gone(pids)


def test_a_second_signal_skips_the_grace_period(tmp_path: Path) -> None:
    proc = start_launch(
        "--nproc-per-node", "1", "--kill-grace", "60", BEHAVE, str(tmp_path), "sleep-ignore-term"
    )
    try:
        pids = wait_for_pids(tmp_path, 1, proc)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=FAIL_FAST_BOUND_S)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode in (130, 143), stderr  # pending signals arrive lowest number first
    assert time.monotonic() - start < FAIL_FAST_BOUND_S
    assert_all_gone(pids)


def test_ranks_and_their_children_die_with_a_killed_launcher(tmp_path: Path) -> None:
    proc = start_launch("--nproc-per-node", "2", BEHAVE, str(tmp_path), "sleep-grandchild", "sleep")
    try:
        pids = wait_for_pids(tmp_path, 2, proc)
        proc.kill()
        proc.communicate(timeout=FAIL_FAST_BOUND_S)
    finally:
        proc.kill()
        proc.communicate()
    assert_all_gone(pids)


# --- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc-per-node", "0", "t.py"], "0 is not in the range x>=1"),
        ([], "Missing argument 'SCRIPT'"),
        (["no_such_script.py"], "script 'no_such_script.py' not found"),
        (["--nproc-per-nod", "2", "t.py"], "No such option '--nproc-per-nod'"),
        (["--nproc-per-node", "2", "--log-ranks", "2", "t.py"], "no rank(s) [2] in a job of 2"),
        (["--log-ranks", "first", "t.py"], "is not 'all' or a list of ranks"),
        (["--kill-grace", "-1", "t.py"], "-1.0 is not in the range x>=0"),
        (["--timeout", "0", "t.py"], "0.0 is not in the range x>0"),
        (["--timeout", "soon", "t.py"], "'soon' is not a valid float"),
        (["--master-port", "70000", "t.py"], "70000 is not in the range 1<=x<=65535"),
        (["-m", "--no-python", "x"], "module and no_python cannot be combined"),
        (["--no-python", "no-such-exe-shardax"], "executable 'no-such-exe-shardax' not found"),
    ],
)
def test_bad_input_is_a_usage_error(args: list[str], message: str) -> None:
    result = CliRunner().invoke(launch_command, args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_bad_input_end_to_end() -> None:
    result = run_launch("--nproc-per-node", "2", "no_such_script.py", entry=CLI)
    assert result.returncode == 2
    assert "Error: script 'no_such_script.py' not found" in result.stderr
    assert "Traceback" not in result.stderr


# --- the Python API ----------------------------------------------------------------------


def test_python_api_runs_ranks_in_process(capfd: pytest.CaptureFixture[str]) -> None:
    cmd = rank_command(str(SCRIPTS / "report_env.py"), ["--x"])
    assert launch(cmd, nproc_per_node=2, log_ranks=[1], env=_env()) == 0
    out = capfd.readouterr().out
    assert not rank_lines(out, 0)
    assert json.loads(rank_lines(out, 1)[0][len("ENV ") :])["argv"] == ["--x"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cmd": "python t.py"}, "not one string"),
        ({"cmd": []}, "cmd is empty"),
        ({"nproc_per_node": 0}, "nproc_per_node must be an integer >= 1"),
        ({"master_port": 0}, "master_port must be an integer in 1..65535"),
        ({"master_addr": ""}, "master_addr must be a host name"),
        ({"log_ranks": [3]}, "no rank(s) [3] in a job of 2"),
        ({"kill_grace": -1}, "kill_grace must be a number of seconds >= 0"),
        ({"timeout": 0}, "timeout must be a number of seconds > 0"),
        ({"cmd": ["/no/such/program"]}, "could not start rank 0 of 2"),
    ],
)
def test_python_api_errors(kwargs: dict, message: str) -> None:
    call = {"cmd": [sys.executable, "-c", "pass"], "nproc_per_node": 2, **kwargs}
    with pytest.raises(LaunchError) as info:
        launch(call.pop("cmd"), **call)
    assert message in str(info.value)


def test_rank_env_and_spec() -> None:
    spec = LaunchSpec(cmd=["t"], nproc_per_node=4, master_port=1234)
    assert eval(repr(spec), {"LaunchSpec": LaunchSpec}) == spec
    env = rank_env(spec, 3, {"RANK": "9", "OMP_NUM_THREADS": "2"})
    assert (env["RANK"], env["WORLD_SIZE"], env["OMP_NUM_THREADS"]) == ("3", "4", "2")
    with pytest.raises(LaunchError, match="local_rank 4 is out of range"):
        rank_env(spec, 4, {})


def test_extract_traceback_keeps_chained_exceptions() -> None:
    lines = [
        "noise",
        "Traceback (most recent call last):",
        "KeyError: 'a'",
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        "Traceback (most recent call last):",
        "ValueError: boom",
        "some atexit noise",
    ]
    assert extract_traceback(lines) == lines[1:]
    assert extract_traceback(["only noise"]) == []


def test_the_launcher_does_not_import_torch() -> None:
    check = subprocess.run(
        [*LIGHT, "--check-no-torch"], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert check.stdout.strip() == "False", check.stderr


def _pump(data: bytes) -> str:
    """What the launcher shows of a rank that writes ``data`` to stdout."""
    import io
    import threading

    from shardax.launch._stream import RankOutput, Sink

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    shown = io.StringIO()
    ranks = RankOutput(
        0, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"), sink=Sink(shown), show=True
    )
    ranks.start()
    writer = threading.Thread(
        target=lambda: (os.write(out_w, data), os.close(out_w), os.close(err_w))
    )
    writer.start()
    writer.join()
    assert ranks.join(30)
    return shown.getvalue()


def test_a_progress_bar_redraws_in_place_and_lines_stay_whole() -> None:
    """A ``\\r`` redraw is passed on as ``\\r[rank k] text`` (the bar redraws
    on the launcher's terminal); the line after it starts at the margin;
    ``\\r\\n`` still ends a line; a partial last line gets its newline."""
    got = _pump(b"start\n\r 10%|#  |\r 50%|## |\nlog\n\r100%|###|\ndone\r\ntail")
    assert got == (
        "[rank 0] start\n"
        "\r[rank 0]  10%|#  |"
        "\r\x1b[K[rank 0]  50%|## |\n"
        "[rank 0] log\n"
        "[rank 0] 100%|###|\n"
        "[rank 0] done\r\n"
        "[rank 0] tail\n"
    )


def _shown_tty(tmp_path: Path) -> str:
    """The launcher's output of a rank printing its ``SHARDAX_TTY``, with the
    launcher's stdout and stderr on a pseudo-terminal."""
    import pty

    script = tmp_path / "tty.py"
    script.write_text("import os\nprint('tty', os.environ.get('SHARDAX_TTY', 'unset'))\n")
    argv = [sys.executable, "-m", "shardax", "launch", "--nproc-per-node", "1", str(script)]
    main, side = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=side, stderr=side)
    os.close(side)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the terminal's other side closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    assert proc.wait(timeout=120) == 0
    return b"".join(chunks).decode()


def test_the_ranks_learn_whether_the_launcher_is_on_a_terminal(tmp_path: Path) -> None:
    assert "[rank 0] tty 1" in _shown_tty(tmp_path)  # (off one: test_examples)
