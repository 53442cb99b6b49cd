"""What a job run with TORCH_DISTRIBUTED_DEBUG=DETAIL tells, and what that setting does to it.

DETAIL wraps every process group in torch's checking wrapper, which compares each collective's
fingerprint (op, shapes, dtypes) across the ranks before running it. On a difference every rank
raises "Detected mismatch between collectives on ranks. Rank R is running collective:
CollectiveFingerPrint(SequenceNumber=N, OpType=OP, TensorShape=[...], ...), but Rank Q is running
collective: ..." before the call reaches the backend, so sddoctor's own record of the call may end
before it says which call each rank made: the fingerprints in the errors say it.

The setting is also a suspect of its own: with torch 2.13's CPU build and gloo, every rank that
constructed a DDP model under it died of SIGSEGV in that call, and the same script without it ran.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sddoctor.supervise.state import RankState

#: One rank's call in the wrapper's error: "Rank 1 is running collective: CollectiveFingerPrint(
#: SequenceNumber=9, OpType=BROADCAST, TensorShape=[16], ..."
_FINGERPRINT = re.compile(
    r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), OpType=(\w+)"
    r"(?:, TensorShape=\[([^\]]*)\])?"
)

#: torch's OpType names that are not the torch.distributed function's name in capitals
_OP_NAMES = {
    "ALLREDUCE": "all_reduce",
    "ALLREDUCE_COALESCED": "all_reduce_coalesced",
    "ALLGATHER": "all_gather",
    "_ALLGATHER_BASE": "all_gather_into_tensor",
    "ALLGATHER_COALESCED": "all_gather_coalesced",
    "REDUCE_SCATTER": "reduce_scatter",
    "_REDUCE_SCATTER_BASE": "reduce_scatter_tensor",
    "ALLTOALL": "all_to_all",
    "ALLTOALL_BASE": "all_to_all_single",
}

SETTING = "TORCH_DISTRIBUTED_DEBUG"

CRASH_CLAUSE = f"; {SETTING}=DETAIL was set, which can crash a rank by itself"
CRASH_EVIDENCE = (
    f"{SETTING}=DETAIL wraps every process group in a checking wrapper that runs extra collectives; "
    "with torch 2.13 (CPU, gloo) every rank constructing a DDP model under it died of SIGSEGV. Run "
    f"once with {SETTING}=INFO or unset to see whether the crash is the wrapper's"
)


@dataclass(frozen=True)
class FingerprintedCall:
    """A rank's collective as the DETAIL wrapper's error describes it."""

    rank: int
    op: str
    shape: str | None
    #: torch's own sequence number of the call (not sddoctor's numbering)
    torch_seq: int

    def describe(self) -> str:
        return f"{self.op} [{self.shape}]" if self.shape is not None else self.op


def set_to_detail(rank: RankState) -> bool:
    """Whether the rank ran with TORCH_DISTRIBUTED_DEBUG=DETAIL (its `start` event's comm_env)."""
    return rank.comm_env.get(SETTING, "").strip().upper() == "DETAIL"


def fingerprinted_calls(ranks: list[RankState]) -> dict[int, FingerprintedCall]:
    """Each rank's call from the wrapper's errors, by rank: a rank's own error names its call and a
    peer's, so a rank that died before writing its error is still known by its peer's."""
    calls: dict[int, FingerprintedCall] = {}
    for rank in ranks:
        message = str((rank.exception or {}).get("message", ""))
        for m in _FINGERPRINT.finditer(message):
            who = int(m.group(1))
            op = _OP_NAMES.get(m.group(3), m.group(3).lower())
            call = FingerprintedCall(who, op, m.group(4), int(m.group(2)))
            if who == rank.rank or who not in calls:  # a rank's word on its own call wins
                calls[who] = call
    return calls


def mismatch_details(calls: dict[int, FingerprintedCall], locations: dict[int, str | None]) -> dict[str, Any]:
    """report.json's `details.detail_fingerprints`: each rank's op, shape and line."""
    return {
        str(r): {"op": c.op, "shape": c.shape, "torch_seq": c.torch_seq, "location": locations.get(r)}
        for r, c in sorted(calls.items())
    }
