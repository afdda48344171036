"""Run command lines (`python tools/x.py ...`, `python -m dzc.dump ...`) each in its own process, as a user runs
them, without paying Python + torch + dzc start-up (~4.5 s of CPU on the CI machine) once per command.

One server process imports torch and dzc, then forks a child per command. A child is a fresh process as far as
the command can tell: its own sys.argv, sys.path[0] (the script's folder, or the working directory for -m),
working directory, environment, stdout/stderr, and the interpreter's handling of its end (an uncaught exception
printed, status 1; SystemExit's status or message; non-daemon threads joined, atexit handlers run, output
flushed; only the teardown of every module is skipped). The tool's own code, and every import it makes past torch
and dzc, runs in it. The one thing shared is what importing torch and dzc did, so every command must run under
the same values of what those imports read from the environment (TRITON_INTERPRET: Triton picks the interpreter
at import; CUDA_VISIBLE_DEVICES): `run` takes those from `env` and refuses a job that sets another. Per-job
variables (DZC_CACHE_DIR and the other DZC_* knobs, read when used) may differ.

    results = run({"list": Job(["-m", "dzc.dump", "--list-models"], cwd=tmp)}, env=env)
    results["list"].returncode, results["list"].stdout, results["list"].stderr
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Read by torch, Triton or dzc when they are imported: the server's values are every child's.
IMPORT_TIME_VARIABLES = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")


@dataclass
class Job:
    argv: list[str]  # what follows `python`: a script and its arguments, or "-m", a module and its arguments
    cwd: str = "."
    env: dict[str, str] = field(default_factory=dict)  # added to run's env for this command
    merge_stderr: bool = False  # stderr into stdout (subprocess.STDOUT)


def run(jobs: dict[str, Job], env: dict[str, str], at_once: int = 4, timeout: float = 900,
        preload: tuple[str, ...] = ("torch", "dzc")) -> dict[str, subprocess.CompletedProcess]:
    """Every job, at most `at_once` at a time; key -> CompletedProcess (args: the command line as a user types
    it; returncode None for a job that had not finished when `timeout` seconds ran out)."""
    with tempfile.TemporaryDirectory(prefix="dzc-prewarmed-") as scratch:
        spec = []
        for key, job in jobs.items():
            job_env = {**env, **job.env}
            for name in IMPORT_TIME_VARIABLES:
                if job_env.get(name) != env.get(name):
                    raise ValueError(f"job {key}: {name} is read at import; it must be the same for every job")
            out = os.path.join(scratch, f"{len(spec)}.out")
            err = out if job.merge_stderr else os.path.join(scratch, f"{len(spec)}.err")
            spec.append(dict(asdict(job), key=key, env=job_env, cwd=str(job.cwd), stdout=out, stderr=err))
        jobs_file = os.path.join(scratch, "jobs.json")
        Path(jobs_file).write_text(json.dumps(dict(jobs=spec, at_once=at_once, preload=list(preload))))
        server = subprocess.Popen([sys.executable, __file__, jobs_file], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        timed_out = False
        try:
            server_out, server_err = server.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)  # the server, its children and theirs (one process group)
            server_out, server_err = server.communicate()
            timed_out = True
        if server.returncode != 0 and not timed_out:
            raise RuntimeError(f"the pre-warmed server failed (exit {server.returncode}):\n{server_err[-6000:]}")
        codes = dict(line.removeprefix("EXIT ").rsplit(" ", 1) for line in server_out.splitlines()
                     if line.startswith("EXIT "))
        results = {}
        for job in spec:
            stdout = Path(job["stdout"]).read_text(errors="replace") if os.path.exists(job["stdout"]) else ""
            stderr = "" if job["merge_stderr"] else (
                Path(job["stderr"]).read_text(errors="replace") if os.path.exists(job["stderr"]) else "")
            code = int(codes[job["key"]]) if job["key"] in codes else None
            if code is None:
                stderr += f"\n(did not finish within {timeout} s)"
            results[job["key"]] = subprocess.CompletedProcess(["python", *job["argv"]], code, stdout, stderr)
        return results


def _child(job: dict) -> None:
    """In the forked child: become `python <argv>`, run it, and exit as the interpreter does (never returns)."""
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    out = os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = out if job["stderr"] == job["stdout"] else os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                                              0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    argv = job["argv"]
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's path in argv[0], as python -m does
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = [argv[0], *argv[1:]]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit:  # as the interpreter handles it: None is 0, a number the status, anything else printed
        code = exit.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 (an uncaught exception: the interpreter prints it, the status is 1)
        sys.excepthook(*sys.exc_info())
        code = 1
    # The interpreter's exit (non-daemon threads joined, atexit handlers, output flushed) without its teardown of
    # every module: that touches every object the fork shares with the server, copying most of its memory (1-2 s).
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _serve(jobs_file: str) -> None:
    spec = json.loads(Path(jobs_file).read_text())
    for module in spec["preload"]:
        __import__(module)
    pending, running = list(spec["jobs"]), {}
    while pending or running:
        while pending and len(running) < spec["at_once"]:
            job = pending.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(job)  # never returns
            running[pid] = job["key"]
        pid, status = os.wait()
        print(f"EXIT {running.pop(pid)} {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    _serve(sys.argv[1])
