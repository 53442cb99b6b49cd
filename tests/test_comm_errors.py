"""Rendezvous and communication errors with one usual cause (`sddoctor.supervise.comm_errors`): each
read from the words torch and NCCL print, with the cause and the fix it gets."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from sddoctor.supervise.comm_errors import known_error, known_exception_type
from sddoctor.supervise.port_holders import port_holders, taken_ports

PORT_IN_USE = (
    "The server socket has failed to listen on any local network address. port: 29512, useIpv6: "
    "false, code: -98, name: EADDRINUSE, message: address already in use"
)


#: what torch 2.11 with NCCL 2.28.9 raised on an H100 for two ranks left on cuda:0
#: (tests/clients/nccl_same_gpu.py, docs/run.md)
DUPLICATE_GPU = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, invalid usage (run with "
    "NCCL_DEBUG=WARN for details), NCCL version 2.28.9\nncclInvalidUsage: This usually reflects invalid "
    "usage of NCCL library.\nLast error:\nDuplicate GPU detected : rank 0 and rank 1 both on CUDA device 60"
)


@pytest.mark.parametrize(
    ("message", "code", "port"),
    [
        (PORT_IN_USE, "port_in_use", 29512),
        ("RuntimeError: Address already in use", "port_in_use", None),
        (
            "The client socket has failed to connect to [localhost]:29500 (errno: 111 - Connection refused).",
            "store_unreachable",
            29500,
        ),
        (
            "The IPv4 network addresses of (node-0, 29500) cannot be retrieved (gai error: -2 - Name or "
            "service not known).",
            "store_unreachable",
            None,
        ),
        (
            "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO "
            "for details), NCCL version 2.21.5",
            "nccl_system_error",
            None,
        ),
        (DUPLICATE_GPU, "duplicate_gpu", None),
        (
            "CUDA error: invalid device ordinal\nGPU device may be out of range, do you have enough GPUs?\n"
            "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
            "invalid_device",
            None,
        ),
        ("No CUDA GPUs are available", "no_gpu", None),
        (
            "NCCL error: remote process exited or there was a network error, NCCL version 2.21.5",
            "nccl_remote_error",
            None,
        ),
    ],
)
def test_each_error_gets_its_cause_and_its_port(message: str, code: str, port: int | None) -> None:
    found = known_error(message)
    assert found is not None and (found.code, found.port) == (code, port), found
    assert found.advice and found.to_dict()["code"] == code
    # the verdict's line gets the cause; a taken port's is in torch's words already, unless its holder is known
    assert found.summary_clause() == ("" if code == "port_in_use" else f"; {found.cause}"), found


def test_the_cause_torch_hides_behind_invalid_usage_reaches_the_verdicts_line() -> None:
    found = known_error(DUPLICATE_GPU)
    assert found is not None
    assert (
        found.summary_clause() == "; NCCL found two ranks on one GPU (no torch.cuda.set_device(LOCAL_RANK)?)"
    )


@pytest.mark.parametrize(
    "message",
    [
        "ValueError: bad batch",
        # a peer's death as gloo sees it: no rendezvous problem, whatever the file:line it names
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:17469",
        "RuntimeError: expected scalar type Float at /u/train.py:41",
        "",
    ],
)
def test_other_errors_get_nothing(message: str) -> None:
    assert known_error(message) is None


def test_a_taken_port_of_the_programs_own_server_is_not_called_the_rendezvous() -> None:
    """A rank's own HTTP server (a metrics exporter) failing to bind: the port is named, the
    rendezvous advice is not given."""
    found = known_error("OSError: [Errno 98] Address already in use (port 6006)")
    assert found is not None and (found.code, found.port) == ("port_in_use", 6006), found
    assert "rendezvous" not in found.advice and "MASTER_PORT" not in found.advice, found.advice
    store = known_error(PORT_IN_USE)
    assert store is not None and "the rendezvous store could not listen on it" in store.advice


def test_a_taken_port_names_the_process_that_listens_on_it() -> None:
    """A real listening socket of this process: it is found and named, as started before the run."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        message = PORT_IN_USE.replace("29512", str(port))
        assert taken_ports(["noise", message, message]) == [port]
        holders = port_holders(["noise", message], run_started=float("inf"))
    holder = holders[str(port)]
    assert holder["pid"] == os.getpid() and holder["started_before_run"] is True, holder
    found = known_error(message, holders)
    assert found is not None and found.holder == holder
    assert f"pid {os.getpid()} holds it" in found.advice and f"`kill {os.getpid()}`" in found.advice
    assert found.summary_clause().startswith(f"; port {port} is held by pid {os.getpid()} (")
    assert port_holders(["ValueError: bad batch"], run_started=0.0) == {}


def test_torch_own_words_for_an_unreachable_store_are_read() -> None:
    """The message this torch really raises when nothing listens on the store's port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(Exception) as raised:
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1))
    found = known_error(str(raised.value))
    assert found is not None and found.code == "store_unreachable", str(raised.value)[:500]
    assert found.port == port


def test_an_exception_type_that_says_it_all_gets_its_cause() -> None:
    """pdb's BdbQuit has an empty message: its type (bare or qualified) is what names the cause."""
    for name in ("BdbQuit", "bdb.BdbQuit"):
        found = known_exception_type(name)
        assert found is not None and found.code == "debugger_without_terminal", name
        assert "pdb read end-of-input" in found.summary_clause()
    assert known_exception_type("RuntimeError") is None and known_exception_type(None) is None


def test_input_without_a_terminal_is_named_by_type_and_words() -> None:
    """input()'s EOFError says "EOF when reading a line"; an EOFError of another reader (a truncated
    file) is not a prompt."""
    found = known_exception_type("EOFError", "EOF when reading a line")
    assert found is not None and found.code == "prompt_without_terminal"
    assert "standard input" in found.summary_clause()
    assert known_exception_type("EOFError", "Ran out of input") is None
    assert known_exception_type("ValueError", "EOF when reading a line") is None


def test_ranks_that_built_different_models_are_told_so() -> None:
    """DDP's construction raises this on the rank whose parameters differ from rank 0's."""
    message = (
        "[1]: params[0] in this process with sizes [64, 8] appears not to match sizes of the same "
        "param in process 0."
    )
    found = known_error(message)
    assert found is not None and found.code == "ddp_model_mismatch", found
    assert "built different models" in found.summary_clause()
