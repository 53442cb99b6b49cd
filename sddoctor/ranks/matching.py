"""Which GPU process is which DDP rank.

NVML lists processes by PID; ranks report their own pid, host and CUDA device. Inside a
container NVML sees host PIDs while a rank reports its container PID, so a PID match alone is
not enough. Rules, in order:

1. pid: a GPU process whose PID equals a rank's reported pid is that rank.
2. device: a rank not matched by pid, on this host, claims the one process left unmatched on
   its own device (its `device_uuid` when it reports one, else its device index).
   Two or more candidates is ambiguous: nothing is claimed.
Anything else stays unmatched and is shown as such.

A rank matched by pid that holds memory on a GPU other than its own gets a flag: the classic
`torch.cuda.set_device` omission that puts a context of every rank on GPU 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sddoctor.gpu.samples import GpuSample
from sddoctor.ranks.status import RankStatus


@dataclass
class Match:
    rank: RankStatus
    how: str  # "pid" | "device"


@dataclass
class Matching:
    by_process: dict[tuple[int, int], Match] = field(default_factory=dict)  # (gpu index, pid)
    wrong_gpu: list[tuple[RankStatus, GpuSample, int | None]] = field(
        default_factory=list
    )  # rank, gpu, bytes

    def of(self, gpu_index: int, pid: int) -> Match | None:
        return self.by_process.get((gpu_index, pid))

    def flags(self, gpu_index: int, pid: int) -> list[str]:
        return [
            f"rank {r.rank} belongs on GPU {r.device}"
            for r, g, _ in self.wrong_gpu
            if g.index == gpu_index and r.pid == pid
        ]


def _own_gpu(rank: RankStatus, gpu: GpuSample) -> bool:
    if rank.device_uuid:
        return rank.device_uuid == gpu.uuid
    return rank.device == gpu.index


def match_processes(gpus: list[GpuSample], ranks: list[RankStatus], hostname: str) -> Matching:
    m = Matching()
    live = [r for r in ranks if r.state not in ("exited", "crashed")]
    by_pid: dict[int, list[RankStatus]] = {}
    for r in live:
        if r.pid is not None:
            by_pid.setdefault(r.pid, []).append(r)
    matched_ranks: set[int] = set()
    for g in gpus:
        for p in g.processes:
            candidates = by_pid.get(p.pid, [])
            # prefer a rank on this host when several nodes report the same pid
            local = [r for r in candidates if r.host == hostname] or candidates
            if local:
                r = local[0]
                m.by_process[(g.index, p.pid)] = Match(r, "pid")
                matched_ranks.add(id(r))
                if r.device is not None or r.device_uuid:
                    if not _own_gpu(r, g):
                        m.wrong_gpu.append((r, g, p.gpu_memory))
    hosts = {r.host for r in live}
    for r in live:
        if id(r) in matched_ranks:
            continue
        # A rank of another host cannot own a local process, unless all ranks share one host name
        # (one node whose ranks run in a container with its own hostname).
        if r.host != hostname and not (len(hosts) == 1 and hostname not in hosts):
            continue
        for g in gpus:
            if not _own_gpu(r, g):
                continue
            free = [p for p in g.processes if (g.index, p.pid) not in m.by_process]
            if len(free) == 1:
                m.by_process[(g.index, free[0].pid)] = Match(r, "device")
                matched_ranks.add(id(r))
    return m
