"""Stack dumps of every rank with py-spy, taken in parallel with a timeout.

py-spy attaches with ptrace. When that is not allowed, `ptrace_problem()` says exactly why
and how to allow it; the rest of the diagnosis works without stacks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sddoctor.codepaths import CodeRoots, current_roots

_CAP_SYS_PTRACE = 19


def tool_path(name: str) -> str | None:
    """A program installed with this Python (its scripts folder, the folder of the interpreter) before
    PATH: `VENV/bin/sddoctor` run from cron, SLURM or an IDE without the venv activated still finds
    the py-spy installed in that venv."""
    folders: list[str] = []
    for candidate in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        if candidate and candidate not in folders:
            folders.append(candidate)
    for folder in folders:
        found = shutil.which(name, path=folder)
        if found:
            return found
    return shutil.which(name)


def py_spy_path() -> str | None:
    return tool_path("py-spy")


def ptrace_problem() -> str | None:
    """Why this process may not be able to ptrace its ranks (None if nothing is known to block it)."""
    if py_spy_path() is None:
        return "py-spy is not installed: `pip install py-spy` (stacks are skipped)"
    if os.geteuid() == 0 and _has_cap_sys_ptrace():
        return None
    scope = _read("/proc/sys/kernel/yama/ptrace_scope")
    if scope is not None and scope.strip() not in ("0", "1"):
        return (
            f"kernel.yama.ptrace_scope is {scope.strip()}: only root with CAP_SYS_PTRACE may attach. "
            "Allow it with `sudo sysctl kernel.yama.ptrace_scope=1` (or 0), or run sddoctor as root."
        )
    if os.geteuid() == 0 and not _has_cap_sys_ptrace():
        return (
            "running as root without CAP_SYS_PTRACE (a container?): start the container with "
            "`--cap-add SYS_PTRACE` (docker) or add SYS_PTRACE to securityContext.capabilities (Kubernetes)."
        )
    return None


def explain_failure(stderr: str) -> str:
    """Turn a py-spy error into a cause and a fix."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    text = (errors or lines or ["py-spy failed"])[0][:300]
    lowered = stderr.lower()
    if "permission denied" in lowered or "operation not permitted" in lowered or "eperm" in lowered:
        scope = (_read("/proc/sys/kernel/yama/ptrace_scope") or "").strip()
        fixes = [
            "run sddoctor as root (sudo)",
            "in a container, add the capability: `docker run --cap-add SYS_PTRACE` "
            "(Kubernetes: securityContext.capabilities.add: [SYS_PTRACE])",
        ]
        if scope:
            fixes.append(f"kernel.yama.ptrace_scope is {scope}: `sudo sysctl kernel.yama.ptrace_scope=0`")
        else:
            fixes.append("if Yama is enabled: `sudo sysctl kernel.yama.ptrace_scope=0`")
        return f"ptrace not permitted ({text}); to allow it: " + "; or ".join(fixes)
    return text


def dump_stacks(
    pids: dict[Any, int],
    out_dir: Path,
    *,
    timeout: float = 10.0,
    native: bool = False,
    roots: dict[Any, CodeRoots] | None = None,
) -> dict[Any, dict[str, Any]]:
    """Dump every process's stack in parallel: key -> {ok, top_user_frame, frames, error, file}.

    Keys are ranks (files `rank-NNNNN.*`) or strings such as "pid-123" for processes that are not
    ranks yet (files `pid-123.*`). `roots` gives, per key, where the process's libraries are
    installed (from its `start` event); the supervisor's own are used besides.
    """
    exe = py_spy_path()
    if exe is None:
        return {r: {"ok": False, "error": ptrace_problem()} for r in pids}
    out_dir.mkdir(parents=True, exist_ok=True)
    mine = current_roots()

    def one(key: Any, pid: int) -> tuple[Any, dict[str, Any]]:
        return key, _dump_one(exe, key, pid, out_dir, timeout, native, mine.merged((roots or {}).get(key)))

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(pids)))) as pool:
        return dict(pool.map(lambda item: one(*item), pids.items()))


def dump_workers(
    rank: int, pid: int, out_dir: Path, *, roots: CodeRoots | None = None, timeout: float = 10.0
) -> list[dict[str, Any]]:
    """Stacks of the Python child processes of a rank (its DataLoader workers), as `dump_stacks`
    gives them, each with its `pid`; files `rank-NNNNN-worker-PID.*`. A rank blocked in its
    DataLoader waits for them: the line that does not return is in a worker's stack."""
    import psutil

    try:  # any child: DataLoader workers rename themselves (pt_data_worker); py-spy skips non-Python ones
        children = psutil.Process(pid).children()
    except psutil.Error:
        return []
    if not children:
        return []
    keys = {f"rank-{rank:05d}-worker-{c.pid}": c.pid for c in children[:8]}
    results = dump_stacks(keys, out_dir, timeout=timeout, roots=dict.fromkeys(keys, roots) if roots else None)
    return [res for res in results.values() if res.get("ok")]


#: py-spy's words for a read that caught the process mid-change; worth reading again
TRANSIENT_FAILURE = "Failed to get stack traces"
DUMP_ATTEMPTS = 3


def _dump_one(
    exe: str, key: Any, pid: int, out_dir: Path, timeout: float, native: bool, roots: CodeRoots
) -> dict[str, Any]:
    held = _process_state(pid)
    # T: SIGSTOP or Ctrl-Z stopped it; t: a tracer (gdb, strace) holds it. Its memory does not
    # change, so py-spy reads it without attaching (attaching, and the SIGCONT after a failed
    # attach, would resume it; a traced process cannot be attached at all)
    stopped = held in ("T", "t")
    marks = {"stopped": True} if held == "T" else {"traced": True} if held == "t" else {}
    if stopped:
        cmd = [exe, "dump", "--pid", str(pid), "--json", "--nonblocking"]
    else:
        cmd = [exe, "dump", "--pid", str(pid), "--json"] + (["--native"] if native else [])

    def resume_unless_held() -> None:
        if not stopped:  # a process held before the dump is left as it was; py-spy may stop others
            _resume(pid)

    deadline = time.monotonic() + timeout
    for attempt in range(DUMP_ATTEMPTS):
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic())
            )
        except subprocess.TimeoutExpired:
            resume_unless_held()
            return {"ok": False, "pid": pid, "error": f"py-spy timed out after {timeout:.0f} s"}
        except OSError as exc:
            return {"ok": False, "pid": pid, "error": f"cannot run py-spy: {exc}"}
        # a read of the process's memory can catch it mid-change (a thread starting or ending):
        # py-spy then says "Failed to get stack traces", and the next read succeeds
        transient = TRANSIENT_FAILURE in (proc.stderr or proc.stdout or "")
        if proc.returncode == 0 or not transient or attempt == DUMP_ATTEMPTS - 1:
            break
        resume_unless_held()
        if deadline - time.monotonic() < 1.5:
            break
        time.sleep(0.2)
    if proc.returncode != 0:
        error = explain_failure(proc.stderr or proc.stdout)
        if stopped:
            error += " (the process is stopped: SIGSTOP, Ctrl-Z or a debugger; left stopped)"
        else:
            _resume(pid)  # py-spy can leave its target stopped when it fails mid-attach
            if _process_state(pid) == "T":
                error += " (the process is stopped: SIGSTOP or a debugger; it was sent SIGCONT)"
        failed = {"ok": False, "pid": pid, "error": error, "stderr": (proc.stderr or "")[-2000:]}
        return {**failed, **marks}
    try:
        threads = json.loads(proc.stdout)
    except ValueError:
        resume_unless_held()
        return {"ok": False, "pid": pid, "error": "py-spy printed no JSON"}
    stem = f"rank-{key:05d}" if isinstance(key, int) else str(key)
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(threads, indent=1))
    (out_dir / f"{stem}.txt").write_text(format_threads(threads))
    main = main_thread(threads, pid)
    frames = [
        f"{f.get('filename')}:{f.get('line')} in {f.get('name')}" for f in (main or {}).get("frames", [])
    ]
    top = top_user_frame(main, roots)
    result = {
        "ok": True,
        "pid": pid,
        "file": str(path),
        "frames": frames,
        "top_user_frame": top[0] if top else None,
        "top_user_function": top[1] if top else None,
    }
    result.update(marks)
    helpers = _user_threads(threads, main, roots)
    if helpers:
        result["threads"] = helpers
    if (main or {}).get("owns_gil") is True:
        # a main thread that keeps the GIL while the process hangs is in native code that did not
        # release it: none of the process's Python threads can run
        result["main_holds_gil"] = True
    return result


def _process_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, D, T, Z...)."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat or ")" not in stat:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError:
        pass


def main_thread(threads: Any, pid: int) -> dict[str, Any] | None:
    if not isinstance(threads, list):
        return None
    for thread in threads:
        if isinstance(thread, dict) and (
            thread.get("os_thread_id") == pid or thread.get("thread_name") == "MainThread"
        ):
            return thread
    return threads[0] if threads and isinstance(threads[0], dict) else None


def top_user_frame(
    thread: dict[str, Any] | None, roots: CodeRoots | None = None, library_fallback: bool = True
) -> tuple[str, str] | None:
    """(file:line, function) of the innermost frame in the user's own code (see `codepaths`), else
    (with `library_fallback`) of the innermost library frame outside torch and sddoctor."""
    if not thread:
        return None
    roots = roots or current_roots()
    frames = [f for f in thread.get("frames", []) if isinstance(f, dict)]
    for frame in frames:  # py-spy lists the innermost frame first
        filename = str(frame.get("filename", ""))
        if roots.is_user(filename):
            return f"{filename}:{frame.get('line')}", str(frame.get("name"))
    if not library_fallback:
        return None
    # else a library's frame (accelerate's, Lightning's), never torch's or sddoctor's own: a rank
    # held in sddoctor's code at exit is not there by the user's doing, and the callers fall back
    # to its last collective or its fault instead
    for frame in frames:
        filename = str(frame.get("filename", ""))
        if not roots.is_internal(filename):
            return f"{filename}:{frame.get('line')}", str(frame.get("name"))
    return None


#: most threads a dump names besides the main one
MAX_NAMED_THREADS = 8


def _user_threads(threads: Any, main: dict[str, Any] | None, roots: CodeRoots) -> list[dict[str, Any]]:
    """The process's other threads that are in the user's own code (a prefetcher, a metrics
    thread), with the innermost such frame: where a main thread that waits for one of them is
    really held. sddoctor's own threads, and threads only in library code, are left out."""
    named = []
    for thread in threads if isinstance(threads, list) else []:
        if thread is main or not isinstance(thread, dict):
            continue
        if str(thread.get("thread_name") or "").startswith("sddoctor-"):
            continue
        top = top_user_frame(thread, roots, library_fallback=False)
        if top is not None:
            named.append({"name": thread.get("thread_name"), "frame": top[0], "function": top[1]})
    return named[:MAX_NAMED_THREADS]


def format_threads(threads: Any) -> str:
    lines = []
    for thread in threads if isinstance(threads, list) else []:
        gil = ", holds the GIL" if thread.get("owns_gil") is True else ""
        lines.append(f"Thread {thread.get('os_thread_id')} ({thread.get('thread_name')}{gil}):")
        for f in thread.get("frames", []):
            lines.append(f"    {f.get('name')} ({f.get('filename')}:{f.get('line')})")
    return "\n".join(lines) + "\n"


def _has_cap_sys_ptrace() -> bool:
    status = _read("/proc/self/status") or ""
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            try:
                return bool(int(line.split()[1], 16) & (1 << _CAP_SYS_PTRACE))
            except (IndexError, ValueError):
                return False
    return False


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def sample_hot_frame(
    pid: int, roots: CodeRoots | None = None, *, seconds: int = 2, rate: int = 50, timeout: float = 15.0
) -> dict[str, Any]:
    """Where a process's main thread spends its time outside collectives: py-spy samples it for
    `seconds` without pausing it (--nonblocking), and the innermost frame of the user's own code
    that most samples share is the answer. Samples taken inside torch.distributed (waiting in a
    collective) are left out. {location, function, share, samples} or {error}."""
    exe = py_spy_path()
    if exe is None:
        return {"error": ptrace_problem() or "py-spy is not installed"}
    roots = current_roots().merged(roots)
    with tempfile.TemporaryDirectory(prefix="sddoctor-samples-") as tmp:
        out = Path(tmp) / "raw.txt"
        cmd = [
            exe,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(seconds),
            "--rate",
            str(rate),
            "--format",
            "raw",
        ]
        # its DataLoader workers too: a rank that waits for them is slow where they are
        cmd += [
            "--full-filenames",
            "--nonblocking",
            "--idle",
            "--threads",
            "--subprocesses",
            "--output",
            str(out),
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            _resume(pid)
            return {"error": f"py-spy record timed out after {timeout:.0f} s"}
        except OSError as exc:
            return {"error": f"cannot run py-spy: {exc}"}
        if proc.returncode != 0 or not out.exists():
            _resume(pid)
            return {"error": explain_failure(proc.stderr or proc.stdout)}
        return hot_frame(out.read_text(errors="replace"), pid, roots)


#: the processes py-spy's `--subprocesses` puts before a sample: `process 12:"python train.py";`
_PROCESS_PREFIX = re.compile(r'process (\d+):"(?:[^"\\]|\\.)*";')
_THREAD = re.compile(r"thread \((\d+)\)")
#: a rank whose busiest line spends at least this share of its samples inside torch's DataLoader
#: waits for its workers
LOADER_WAIT_SHARE = 0.5


def _folded_sample(line: str) -> tuple[int | None, int, list[tuple[str, str, str]], int] | None:
    """(process id or None, thread id, frames outermost first, count) of a line of py-spy's raw output."""
    stack, _, count_text = line.rpartition(" ")
    if not count_text.isdigit():
        return None
    process = None
    while match := _PROCESS_PREFIX.match(stack):
        process, stack = int(match.group(1)), stack[match.end() :]
    head, _, frames_text = stack.partition(";")
    thread = _THREAD.match(head)
    if thread is None:
        return None
    frames = [_parse_folded(f) for f in frames_text.split(";") if f]
    return process, int(thread.group(1)), frames, int(count_text)


def hot_frame(raw: str, pid: int, roots: CodeRoots) -> dict[str, Any]:
    """The busiest user line of the main thread in py-spy's raw (folded) output. When most of that
    line's samples wait inside torch's DataLoader (`waits_for: "dataloader"`), the busiest user line of
    its worker processes' main threads (sampled with `--subprocesses`) is `worker`."""
    waiting = tuple(os.path.join(root, "distributed", "") for root in roots.internal)
    loading = tuple(os.path.join(root, "utils", "data", "") for root in roots.internal)
    counts: dict[tuple[str, str], int] = {}
    in_loader: dict[tuple[str, str], int] = {}
    workers: dict[tuple[str, str], int] = {}
    total = worker_total = 0
    for line in raw.splitlines():
        sample = _folded_sample(line)
        if sample is None:
            continue
        process, thread, frames, count = sample
        if process not in (None, pid):
            if thread == process:  # a child's main thread: a DataLoader worker
                worker_total += count
                line_of_worker = _innermost_user(frames, roots)
                if line_of_worker is not None:
                    workers[line_of_worker] = workers.get(line_of_worker, 0) + count
            continue
        if thread != pid:
            continue
        # innermost first: a torch.distributed frame inside the user's code is a wait in a collective;
        # one outside it (an elastic worker's @record wrapper) is not
        user_line, in_collective, loader = None, False, False
        for path, line_no, name in reversed(frames):
            if path.startswith(waiting):
                in_collective = True
                break
            loader = loader or path.startswith(loading)
            if roots.is_user(path):
                user_line = (f"{path}:{line_no}", name)
                break
        if in_collective:
            continue  # waiting, not working
        total += count  # a sample without a user frame (start-up, shutdown) is named nowhere
        if user_line is not None:
            counts[user_line] = counts.get(user_line, 0) + count
            if loader:
                in_loader[user_line] = in_loader.get(user_line, 0) + count
    if not counts:
        return {"error": "no sample of the main thread was in the user's own code", "samples": total}
    hot, hits = max(counts.items(), key=lambda kv: kv[1])
    found: dict[str, Any] = {
        "location": hot[0],
        "function": hot[1],
        "share": round(hits / total, 3),
        "samples": total,
    }
    if in_loader.get(hot, 0) >= LOADER_WAIT_SHARE * hits:
        found["waits_for"] = "dataloader"
        if workers:
            (location, function), worker_hits = max(workers.items(), key=lambda kv: kv[1])
            share = round(worker_hits / worker_total, 3)
            found["worker"] = {
                "location": location,
                "function": function,
                "share": share,
                "samples": worker_total,
            }
    return found


def _innermost_user(frames: list[tuple[str, str, str]], roots: CodeRoots) -> tuple[str, str] | None:
    for path, line_no, name in reversed(frames):
        if roots.is_user(path):
            return f"{path}:{line_no}", name
    return None


def _parse_folded(frame: str) -> tuple[str, str, str]:
    """'name (path:line)' -> (path, line, name)."""
    name, _, rest = frame.rpartition(" (")
    path, _, line = rest.rstrip(")").rpartition(":")
    return path, line, name
