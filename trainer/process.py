"""The trainer's process: its place in the process group, the collectives of its bookkeeping, signals."""

from __future__ import annotations

import datetime
import os
import signal
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str


def setup_distributed(backend: str, timeout_s: int) -> Dist:
    """Join torchrun's process group, or make a one-rank group when started without torchrun."""
    if "RANK" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if backend == "nccl" and "device_id" in dist.init_process_group.__code__.co_varnames:
        kwargs["device_id"] = device  # binds the communicator to this GPU (no guessing at barriers)
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        rank=rank,
        world_size=world_size,
        **kwargs,
    )
    return Dist(rank, local_rank, world_size, device, backend)


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj` (a collective); [obj] in a one-rank run."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier() -> None:
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


class StopRequested:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint at the next agreement point.

    A second SIGINT falls through to Python's default (KeyboardInterrupt) for the impatient.
    """

    def __init__(self) -> None:
        self.signum = 0

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum and signum == signal.SIGINT:
            signal.default_int_handler(signum, frame)
        self.signum = signum
