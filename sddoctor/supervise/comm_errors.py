"""The errors of rendezvous, communication and GPU set-up that have one usual cause, and what to do.

A rank (or the launcher itself) that dies of "address already in use", a store client's "failed to
connect" or NCCL's "invalid usage" prints torch's words, which name the failing call but not the
cause a user can act on. `known_error` reads an error message and returns the cause and the fix,
which a crash verdict adds to its evidence (`details.known_error`). Pure: no process or file is
looked at here; who holds a taken port is found by the supervisor (`port_holders`) and passed in.
An exception whose type says what happened (pdb's `BdbQuit` in a rank without a terminal, or
input()'s `EOFError` with its own words) is read by `known_exception_type`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KnownError:
    code: str
    #: the cause and the fix, one sentence a report can show as it is
    advice: str
    #: the cause in a few words, for the verdict's one line (torch's own words often hide it)
    cause: str
    #: the TCP port the error names, when it names one (a taken or unreachable rendezvous port)
    port: int | None = None
    #: the process that holds a taken port, when the supervisor found it
    holder: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "advice": self.advice}
        if self.port is not None:
            out["port"] = self.port
        if self.holder:
            out["holder"] = self.holder
        return out

    def summary_clause(self) -> str:
        """What the verdict's one line adds: the cause, and who holds a taken port (the fix is in
        the advice)."""
        holder = self.holder or {}
        if self.code == "port_in_use":  # torch's words say the port is in use; who holds it, not
            if not holder.get("pid"):
                return ""
            return f"; port {self.port} is held by pid {holder['pid']} ({_command_text(holder)[:120]})"
        return f"; {self.cause}"


_PORT_IN_USE = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)
#: the rendezvous store's client (TCPStore) failing to reach its server; not gloo's own pair
#: connections between ranks, whose "Connection refused" follows a peer's death
_UNREACHABLE = re.compile(
    r"client socket has (?:failed to connect|timed out)|TCP client failed to connect|"
    r"connection to the C10d store has failed|"
    r"network addresses of .* cannot be retrieved|Name or service not known|"
    r"Temporary failure in name resolution",
    re.IGNORECASE,
)
_RENDEZVOUS_TIMEOUT = re.compile(r"RendezvousTimeoutError")
_INVALID_DEVICE = re.compile(r"invalid device ordinal|CUDA_ERROR_INVALID_DEVICE", re.IGNORECASE)
_NO_GPU = re.compile(r"no CUDA GPUs are available|Found no NVIDIA driver", re.IGNORECASE)
_DUPLICATE_GPU = re.compile(r"Duplicate GPU detected", re.IGNORECASE)
_NCCL_SYSTEM = re.compile(r"unhandled system error|ncclSystemError", re.IGNORECASE)
_NCCL_REMOTE = re.compile(
    r"remote process exited or there was a network error|ncclRemoteError", re.IGNORECASE
)
_NCCL_VERSION = re.compile(r"NCCL version mismatch|ncclInvalidUsage.*version", re.IGNORECASE)
#: DDP's construction compares every rank's parameters with rank 0's
_DDP_MODEL_MISMATCH = re.compile(
    r"appears not to match (?:sizes|strides) of the same param in process|"
    r"DDP expects same model across all ranks",
    re.IGNORECASE,
)
#: "port: 29500" (TCPStore's own words), "[host]:29500", "127.0.0.1:29500", "localhost:29500",
#: "connect to (host, 29500)"; not a "file.py:41" of a traceback
_PORT = re.compile(
    r"\bport[:= ]+(\d{2,5})\b|\]:(\d{2,5})\b|\b(?:\d{1,3}\.){3}\d{1,3}:(\d{2,5})\b|\blocalhost:(\d{2,5})\b"
    r"|connect to \([^,()]+, (\d{2,5})\)",
    re.IGNORECASE,
)


def known_error(message: str | None, holders: dict[str, dict[str, Any]] | None = None) -> KnownError | None:
    """The usual cause of `message` and its fix, or None when it is not one of these errors.
    `holders`: by port, the process that listens on it ({pid, name, cmdline, started_before_run}),
    as the supervisor found them for the ports port-in-use errors name."""
    if not message:
        return None
    text = str(message)
    port = _port_of(text)
    if _PORT_IN_USE.search(text):
        holder = (holders or {}).get(str(port)) if port else None
        taken = f"port {port} is taken" if port else "the rendezvous port is taken"
        store = bool(_STORE_WORDS.search(text))
        return KnownError("port_in_use", _port_in_use_advice(port, holder, store), taken, port, holder)
    for pattern, code, advice, cause in _FIXED:
        if pattern.search(text):
            return KnownError(code, advice, cause)
    if _UNREACHABLE.search(text):
        where = _store_address(text, port)
        cause = f"the rendezvous store at {where} was unreachable"
        return KnownError("store_unreachable", _unreachable_advice(where), cause, port)
    return None


#: (words, code, advice, cause) of the errors whose advice does not depend on the message, in the
#: order they are tried (the GPU set-up errors before NCCL's own, which may wrap them)
_FIXED: tuple[tuple[re.Pattern[str], str, str, str], ...] = (
    (
        _DUPLICATE_GPU,
        "duplicate_gpu",
        "two ranks use the same GPU: NCCL needs one GPU per rank. Call "
        "`torch.cuda.set_device(int(os.environ['LOCAL_RANK']))` before `init_process_group` (or pass "
        "`device_id=`), and start no more ranks per node than it has GPUs",
        "NCCL found two ranks on one GPU (no torch.cuda.set_device(LOCAL_RANK)?)",
    ),
    (
        _INVALID_DEVICE,
        "invalid_device",
        "`torch.cuda.set_device(LOCAL_RANK)` (or `cuda:N`) needs N < torch.cuda.device_count(): start "
        "no more ranks per node (`--nproc-per-node`, `--num_processes`) than the GPUs visible to them "
        "(CUDA_VISIBLE_DEVICES limits them), and use LOCAL_RANK, not RANK, for the device on several "
        "nodes",
        "it asked for a GPU this node does not show (more ranks per node than visible GPUs?)",
    ),
    (
        _NO_GPU,
        "no_gpu",
        "the process sees no GPU: CUDA_VISIBLE_DEVICES is empty or names no GPU of this node, or (in a "
        "container) the driver is not passed in (`docker run --gpus all`); `nvidia-smi` in the same "
        "environment shows what it can see",
        "it sees no GPU (CUDA_VISIBLE_DEVICES? the container's --gpus?)",
    ),
    (
        _NCCL_SYSTEM,
        "nccl_system_error",
        "NCCL failed in a system call: most often /dev/shm is too small (in Docker: `--ipc=host` or "
        "`--shm-size=8g`), or NCCL picked a network interface it cannot use (set NCCL_SOCKET_IFNAME). "
        "Rerun with NCCL_DEBUG=INFO to see which call, and run `sddoctor check-nccl`",
        "NCCL failed in a system call (/dev/shm too small? a network interface it cannot use?)",
    ),
    (
        _NCCL_REMOTE,
        "nccl_remote_error",
        "NCCL lost a peer: another rank exited or its network connection dropped. The peer's own "
        "failure is the cause; if every rank was alive, run `sddoctor check-nccl` for the network",
        "NCCL lost a peer (another rank exited, or the network dropped)",
    ),
    (
        _NCCL_VERSION,
        "nccl_version",
        "the ranks load different NCCL versions: install the same torch (and NCCL) on every node",
        "the ranks load different NCCL versions",
    ),
    (
        _DDP_MODEL_MISMATCH,
        "ddp_model_mismatch",
        "the ranks built different models: DDP compares every rank's parameters (their number, "
        "shapes and strides) with rank 0's as it wraps the model, and this rank's differ. Every "
        "rank must build the same model: look for what differs per rank in its construction (a "
        "config or checkpoint read per rank, a branch on the rank, a random choice without a shared "
        "seed, a layer added only on some ranks)",
        "its model's parameters differ from rank 0's (the ranks built different models)",
    ),
    (
        _RENDEZVOUS_TIMEOUT,
        "rendezvous_timeout",
        "torchrun waited its rendezvous timeout (--rdzv-conf join_timeout, 600 s by default) for "
        "the nodes of --nnodes to join, and some never did: start torchrun on every node with the "
        "same --nnodes, --rdzv-id and --rdzv-endpoint (host:port of one node that every node can "
        "reach); `sddoctor check-nccl` checks the network between them",
        "not every node joined torchrun's rendezvous in time",
    ),
)


#: the host a store client tried, as torch names it: "to host 10.0.0.1:29500", "connect to
#: (node-0, 29500)", "connect to [node-0]:29500"
_HOST = re.compile(r"to host ([^\s:\[\]]+):\d|connect to \(([^,()]+), \d|connect to \[([^\]]+)\]:\d")


def _store_address(text: str, port: int | None) -> str:
    """host:port of the store a client could not reach, MASTER_ADDR/MASTER_PORT for what the
    message does not name."""
    match = _HOST.search(text)
    host = next((g for g in match.groups() if g), None) if match else None
    return f"{host or 'MASTER_ADDR'}:{port or 'MASTER_PORT'}"


def _command_text(holder: dict[str, Any]) -> str:
    """The holder's command line on one line (a `python -c` program may hold newlines)."""
    words = " ".join(str(w) for w in holder.get("cmdline") or []) or str(holder.get("name") or "?")
    return " ".join(words.split())


def _port_of(text: str) -> int | None:
    match = _PORT.search(text)
    if match is None:
        return None
    number = int(next(g for g in match.groups() if g))
    return number if 0 < number < 65536 else None


#: a port-in-use error of torch's rendezvous store, not of a server of the program's own
_STORE_WORDS = re.compile(
    r"server socket|TCPStore|c10d|DistNetworkError|rendezvous|MASTER_PORT", re.IGNORECASE
)


def _port_in_use_advice(port: int | None, holder: dict[str, Any] | None, store: bool) -> str:
    which = f"port {port}" if port else "the port"
    advice = f"{which} is already taken on this host"
    if store:
        advice += ", so the rendezvous store could not listen on it"
    if holder and holder.get("pid"):
        command = _command_text(holder)
        advice += f": pid {holder['pid']} holds it ({command[:200]})"
        if holder.get("started_before_run"):
            advice += f", started before this run (an earlier run's rank that still lives?); stop it: `kill {holder['pid']}`"
    else:
        advice += " (often by a rank of an earlier run that still lives"
        advice += f": `ss -ltnp 'sport = :{port}'` shows which)" if port else ")"
    if store:
        advice += (
            ". Or pick another port: MASTER_PORT, `torchrun --master-port N`, or `torchrun --standalone`, "
            "which picks a free one"
        )
    else:
        advice += ". Or give the server that failed another port"
    return advice


def _unreachable_advice(where: str) -> str:
    return (
        f"a process could not reach the rendezvous store at {where}: rank 0 (or the node that "
        "runs the store) was not up, or the address is not reachable from here. On several nodes "
        "MASTER_ADDR must be an address of the first node that the others can reach (not 127.0.0.1 or "
        "a name only that node resolves), and the port open in its firewall; `sddoctor check-nccl` "
        "checks both"
    )


#: exception types whose cause needs no message: type name -> (code, advice, cause)
_BY_TYPE: dict[str, tuple[str, str, str]] = {
    "BdbQuit": (
        "debugger_without_terminal",
        "a `breakpoint()` or `pdb.set_trace()` ran in this rank while its standard input was not a "
        "terminal (under `sddoctor run` the job reads /dev/null), so pdb read end-of-input and quit. "
        "Remove it; to stop one rank in the debugger, run the job without sddoctor and call "
        "`torch.distributed.breakpoint(rank=N)` (it holds the other ranks at a barrier meanwhile), or "
        "use a debugger that listens on a port (debugpy, remote-pdb)",
        "a breakpoint() or pdb.set_trace() ran without a terminal: pdb read end-of-input and quit",
    ),
}


#: (type name, words of its message, code, advice, cause) of exceptions whose type names the cause
#: only together with torch's or Python's own words
_BY_TYPE_AND_WORDS: tuple[tuple[str, str, str, str, str], ...] = (
    (
        "EOFError",
        "EOF when reading a line",
        "prompt_without_terminal",
        "the rank called input() (or a library asked a question on the terminal: a login, a "
        "y/n confirmation) while its standard input was not a terminal (under `sddoctor run` the job "
        "reads /dev/null; under torchrun alone every rank shares one terminal). Give the answer "
        "without a prompt: a command-line option or environment variable of the program or library "
        "(for wandb: `wandb login` beforehand, or WANDB_API_KEY / WANDB_MODE=offline), or ask only "
        "on rank 0 before the ranks start",
        "it asked a question on standard input, which a rank does not have (input() read end-of-input)",
    ),
)


def known_exception_type(type_name: str | None, message: str = "") -> KnownError | None:
    """The usual cause of an exception that its type names (alone, or with its message), or None."""
    bare = str(type_name or "").rsplit(".", 1)[-1]
    found = _BY_TYPE.get(bare)
    if found:
        return KnownError(*found)
    for name, words, code, advice, cause in _BY_TYPE_AND_WORDS:
        if bare == name and words in message:
            return KnownError(code, advice, cause)
    return None
