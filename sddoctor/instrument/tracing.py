"""Collective tracing: every torch.distributed collective and p2p op, numbered per process group.

`install(...)` replaces the collective functions of `torch.distributed` (and of
`torch.distributed.distributed_c10d`, which the package re-exports) with thin wrappers. Each call
gets a sequence number on its process group, and its op, tensor shapes/dtypes, caller file:line
(the first frame outside torch and sddoctor), enqueue time and completion are kept in memory.
The heartbeat thread turns that into the `collectives` part of the rank's state snapshot.

What the hot path does, and why it stays cheap: a dict lookup for the group, an integer
increment, a small record object, a frame walk whose per-code-object verdict is cached, and one
attribute store or deque append. No I/O, no locks.

Completion:
- synchronous call on CPU tensors (gloo): done when the call returns;
- `async_op=True`, isend/irecv, batch_isend_irecv, DDP's gradient buckets: the Work object is
  kept and polled with `is_completed()` by the heartbeat thread (never blocking); on CPU tensors
  its future's done-callback gives the exact end as well, whichever comes first;
- synchronous call on CUDA tensors (NCCL returns before the GPU is done): a CUDA event is
  recorded on the current stream after the call and polled the same way.
Polled completion times are as precise as the poll interval (about a second). Time in
collectives (`totals.seconds`) counts overlapping calls once, so it never exceeds wall time.

Sequence numbers start at 1 on every group. Point-to-point ops are numbered separately, under
the key "<group>:p2p", because they involve only two ranks and would otherwise make the
collective numbering of the group differ between ranks.

Names bound before `install()` (`from torch.distributed import all_reduce` executed earlier)
keep the original function and are not traced; `sddoctor run` installs the wrappers when
torch.distributed is first imported, before user code can bind them.
Calls made inside another traced call (all_gather_object calls all_gather) count once.
isend/irecv are wrapped in the `torch.distributed` namespace only: torch compares
`P2POp.op` with its own module globals by identity.
"""

from __future__ import annotations

import atexit
import collections
import functools
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sddoctor.codepaths import CodeRoots, current_roots
from sddoctor.instrument.backend_callbacks import BackendCallback
from sddoctor.instrument.faults import Fault
from sddoctor.instrument.safety import internal_error, is_injected
from sddoctor.telemetry.schema import EventKind

#: ops whose first tensor argument is written in place (shape faults copy the result back)
_INPLACE = {"all_reduce", "broadcast", "reduce"}
#: position of the `op` (ReduceOp) parameter of the reducing collectives, in torch's signatures
REDUCE_OP_POSITION = {
    "all_reduce": 1,
    "all_reduce_coalesced": 1,
    "reduce": 2,
    "reduce_scatter": 2,
    "reduce_scatter_tensor": 2,
}


@dataclass(frozen=True)
class OpSpec:
    """Where a traced function keeps its group, async flag and payload tensor."""

    name: str
    payload: str | None  # parameter holding the tensor (or list) whose shape is recorded
    kind: str = "coll"  # "coll" | "p2p" | "batch" | "object"
    peer: str | None = None  # dst/src parameter of p2p ops
    #: (name, position) of a rooted collective's root parameter (broadcast's src, reduce's dst):
    #: every rank must pass the same root
    root: tuple[str, int] | None = None
    #: numbered apart from the group's collectives (only two ranks take part); set from `kind`
    p2p: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "p2p", self.kind in ("p2p", "batch"))


_SPECS: tuple[OpSpec, ...] = (
    OpSpec("all_reduce", "tensor"),
    OpSpec("all_gather", "tensor"),
    OpSpec("all_gather_into_tensor", "input_tensor"),
    OpSpec("reduce_scatter", "input_list"),
    OpSpec("reduce_scatter_tensor", "input"),
    # torch >= 2.12: FSDP2 calls these directly (absent names are skipped)
    OpSpec("all_gather_single", "input_tensor"),
    OpSpec("reduce_scatter_single", "input"),
    OpSpec("broadcast", "tensor", root=("src", 1)),
    OpSpec("reduce", "tensor", root=("dst", 1)),
    OpSpec("all_to_all", "input_tensor_list"),
    OpSpec("all_to_all_single", "input"),
    OpSpec("all_reduce_coalesced", "tensors"),
    OpSpec("all_gather_coalesced", "input_tensor_list"),
    OpSpec("barrier", None),
    OpSpec("monitored_barrier", None),
    OpSpec("gather", "tensor", root=("dst", 2)),
    OpSpec("scatter", "tensor", root=("src", 2)),
    OpSpec("all_gather_object", None, "object"),
    OpSpec("broadcast_object_list", "object_list", "object", root=("src", 1)),
    OpSpec("gather_object", None, "object", root=("dst", 2)),
    OpSpec("scatter_object_list", "scatter_object_output_list", "object", root=("src", 2)),
    OpSpec("send", "tensor", "p2p", "dst"),
    OpSpec("recv", "tensor", "p2p", "src"),
    OpSpec("isend", "tensor", "p2p", "dst"),
    OpSpec("irecv", "tensor", "p2p", "src"),
    OpSpec("batch_isend_irecv", "p2p_op_list", "batch"),
)
#: wrapped only in the torch.distributed namespace (see the module docstring)
_NAMESPACE_ONLY = {"isend", "irecv"}
#: functions that issue collectives of their own we do not want to count
_QUIET = ("init_process_group", "new_group", "new_subgroups", "destroy_process_group")

_MAX_PENDING = 4096  # per group: bounds memory if completion is never observed
#: completed calls kept for the timeline until the heartbeat drains them (about once a second)
RECENT_MAX = 4096
_MAX_LISTED = 8  # tensors of one call whose shapes are recorded

_tls = threading.local()
_tracer: Tracer | None = None
_originals: dict[tuple[Any, str], Any] = {}
_roots: CodeRoots | None = None
#: per code object: _INTERNAL (torch, sddoctor), _LIBRARY (other installed code) or _USER
_code_kind: dict[Any, int] = {}
_INTERNAL, _LIBRARY, _USER = 0, 1, 2
_dtype_names: dict[Any, str] = {}


class _Rec:
    """One traced call."""

    __slots__ = (
        "op",
        "key",
        "seq",
        "shapes",
        "dtypes",
        "file",
        "line",
        "t0",
        "t1",
        "handle",
        "deferred",
        "exact_end",
        "peer",
        "ddp",
        "reduce",
        "root",
        "user_async",
        "off_main",
        "error",
    )
    op: str
    key: str
    seq: int
    shapes: list[Any]
    dtypes: list[Any]
    file: str
    line: int
    t0: float
    t1: float | None
    handle: Any  # the Work or CUDA event whose completion is polled
    deferred: bool
    exact_end: bool  # an async call whose end its future reported (CPU), not the poll
    peer: int | None
    #: issued by DDP inside a training step: "bucket" (a gradient bucket's all-reduce) or
    #: "buffers" (the buffer broadcast before a forward); the diagnosis tells a step's calls apart
    ddp: str | None
    #: the reduce op passed to a reducing collective (a torch ReduceOp, named at flush time)
    reduce: Any
    #: the root a rooted collective was given (`root_of`): a global rank, or "group rank N"
    root: int | str | None
    #: the program asked for a Work back (async_op=True, isend/irecv) and waits for it when it
    #: chooses: such a call may stay pending while the program goes on
    user_async: bool
    #: issued from a thread other than the main one (a metrics or listener thread, or autograd's)
    off_main: bool
    #: what the call raised, or its Work's future failed with (a peer that left: "Connection
    #: closed by peer"): kept even when the program catches it
    error: str | None

    def __init__(self) -> None:
        # optional fields default here so every construction site (and a hand-built record)
        # yields a complete record; the call sites fill in the rest
        self.handle, self.t1, self.peer, self.ddp, self.reduce, self.root = None, None, None, None, None, None
        self.error = None
        self.deferred, self.exact_end, self.user_async, self.off_main = False, False, False, False

    def as_dict(self, now: float | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "pg": self.key,
            "seq": self.seq,
            "op": self.op,
            "shapes": [list(s) for s in self.shapes],
            "dtypes": [dtype_name(d) for d in self.dtypes],
            "caller": f"{self.file}:{self.line}",
            "since": self.t0,
            "async": self.deferred,
        }
        if self.user_async:
            d["user_async"] = True
        if self.off_main:
            d["off_main"] = True
        if self.peer is not None:
            d["peer"] = self.peer
        if self.root is not None:
            d["root"] = self.root
        if self.ddp is not None:
            d["ddp"] = self.ddp
        if self.error is not None:
            d["error"] = self.error
        if self.t1 is not None:
            d["t"] = self.t1
            d["duration"] = round(self.t1 - self.t0, 6)
        elif now is not None:
            d["waiting"] = round(now - self.t0, 3)
        return d


class _Group:
    """Per process group counters (collectives and p2p apart)."""

    __slots__ = ("pg", "name", "members", "seq", "p2p_seq", "current", "pending", "ddp_seq", "ddp_current")

    def __init__(self, pg: Any, name: str, members: list[int] | None = None) -> None:
        self.pg = pg
        self.name = name
        #: the global ranks of a subgroup (None for the default group): a rank outside it never
        #: issues its collectives, so the diagnosis compares only these ranks on it
        self.members = members
        self.seq = 0
        self.p2p_seq = 0
        self.current: _Rec | None = None  # the synchronous call this group is inside
        self.pending: collections.deque[_Rec] = collections.deque(maxlen=_MAX_PENDING)
        #: DDP's own calls that are a collective only sometimes (see `Tracer.call_if_collective`),
        #: numbered apart so that the group's numbers do not depend on them
        self.ddp_seq = 0
        self.ddp_current: _Rec | None = None


class DoneWork:
    """What a skipped collective returns where torch would return a Work: already complete.

    Its future carries what torch's would (the payload tensors, unchanged), so code that reads the
    result, such as a DDP comm hook's `fut.value()[0]`, goes on as after a real collective.
    """

    def __init__(self, result: list[Any] | None = None) -> None:
        self._result = list(result or [])

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list[Any]:
        return list(self._result)

    def get_future(self) -> Any:
        import torch

        fut: Any = torch.futures.Future()
        fut.set_result(list(self._result))
        return fut


class Tracer:
    """Traced-call bookkeeping of one rank process."""

    def __init__(self, rank: int, faults: list[Fault] | None = None, session: Any = None) -> None:
        self.rank = rank
        self.session = session  # api.RankSession: fires kill/raise faults, owns the writer
        self._groups: dict[Any, _Group] = {}
        self.last_done: _Rec | None = None
        self.last_done_main: _Rec | None = None  # the main thread's: where the rank itself last synced
        self.last_failed: _Rec | None = None  # the traced call that raised last
        self.op_stats: dict[str, list[float]] = {}  # op -> [count, seconds of completed calls]
        #: wall time inside completed calls, overlapping calls counted once (DDP's buckets overlap)
        self.busy_seconds = 0.0
        self._covered_until = 0.0
        #: async calls complete on the poll thread or on the backend's callback thread: once
        self._async_done = threading.Lock()
        self.started = time.time()
        self.ddp_stats: Callable[[], dict[str, Any]] | None = None
        self._c10d: Any = None
        self._coalescing: dict[Any, Any] = {}
        self._fired: set[str] = set()
        self._hold_next = False  # a skip fault fired: the next collective never gets issued
        #: completed calls not yet written to the timeline file (see sddoctor.instrument.timeline);
        #: None turns the timeline off (the benchmark's "off" blocks)
        self.recent: collections.deque[_Rec] | None = collections.deque(maxlen=RECENT_MAX)
        self.set_faults(faults or [])

    def set_faults(self, faults: list[Fault]) -> None:
        """Keep the collective-triggered faults that apply to this rank."""
        self._faults = [f for f in faults if f.applies_to(self.rank) and _is_collective_fault(f)]
        self._slow = bool(self._faults) or self._hold_next

    # -- the hot path ---------------------------------------------------------------------------

    def call(
        self, fn: Callable[..., Any], spec: OpSpec, gi: int, ai: int, pi: int, args: tuple, kwargs: dict
    ) -> Any:
        try:
            begun = self._begin(spec, gi, ai, pi, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's collective runs untraced then
            if is_injected(exc):
                raise
            internal_error(f"tracing of {spec.name}", exc)
            return fn(*args, **kwargs)
        if begun[0] == "skip":
            return begun[1]
        _, st, rec, args, kwargs, restore, user_async, on_cuda = begun
        _tls.busy = True
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            rec.t1 = time.time()
            st.current = None
            rec.error = error_text(exc)
            self.last_failed = rec
            raise
        finally:
            _tls.busy = False
        try:
            self._end(st, rec, result, user_async, on_cuda)
        except Exception as exc:  # noqa: BLE001
            internal_error(f"tracing of {spec.name}", exc)
        if restore is not None:
            restore()
        return result

    def _begin(self, spec: OpSpec, gi: int, ai: int, pi: int, args: tuple, kwargs: dict) -> tuple:
        """Number and describe the call; apply faults. ("skip", result) or ("go", ...)."""
        if "group" in kwargs:
            group = kwargs["group"]
        else:
            group = args[gi] if 0 <= gi < len(args) else None
        p2p = spec.p2p
        if spec.kind == "batch":  # batch_isend_irecv: numbered with the p2p ops of its group
            ops = kwargs["p2p_op_list"] if "p2p_op_list" in kwargs else (args[0] if args else None)
            group = getattr(ops[0], "group", None) if ops else None
        st = self._groups.get(group)
        if st is None:
            st = self._new_group(group)
        seq = (st.p2p_seq if p2p else st.seq) + 1
        frame = _caller_frame(sys._getframe(3))
        user_async = spec.kind in ("p2p", "batch") and spec.name not in ("send", "recv")
        if not user_async and ai >= 0:
            user_async = bool(
                kwargs["async_op"] if "async_op" in kwargs else (args[ai] if ai < len(args) else False)
            )
        restore = None
        hold = False
        if self._slow:
            outcome = self._apply_faults(st, seq, spec, args, kwargs, pi, frame, user_async)
            if outcome is not None:
                if outcome[0] == "skip":
                    return outcome
                args, kwargs, restore, hold = outcome[1:]
        rec = _Rec()
        rec.op = spec.name
        rec.key = st.name + ":p2p" if p2p else st.name
        rec.seq = seq
        if p2p:
            st.p2p_seq = seq
            peer = kwargs.get(spec.peer) if spec.peer in kwargs else (args[1] if len(args) > 1 else None)
            rec.peer = peer if isinstance(peer, int) else None
        else:
            st.seq = seq
            rec.peer = None
        payload = None
        if spec.payload is not None:
            payload = (
                kwargs[spec.payload]
                if spec.payload in kwargs
                else (args[pi] if 0 <= pi < len(args) else None)
            )
        rec.shapes, rec.dtypes, on_cuda = _describe(payload, spec.kind)
        position = REDUCE_OP_POSITION.get(spec.name)
        if position is not None:
            rec.reduce = (
                kwargs["op"] if "op" in kwargs else (args[position] if position < len(args) else "SUM")
            )
        else:
            rec.reduce = None
        rec.root = root_of(spec, args, kwargs) if spec.root is not None else None
        if frame is not None:
            rec.file, rec.line = frame.f_code.co_filename, frame.f_lineno
        else:
            rec.file, rec.line = "?", 0
        rec.handle = None
        rec.t1 = None
        rec.deferred = False
        rec.exact_end = False
        rec.user_async = False
        rec.off_main = threading.get_ident() != threading.main_thread().ident
        rec.ddp = (
            "bucket"
            if getattr(_tls, "gradient_bucket", False)
            else ("buffers" if spec is BUFFER_BROADCAST else None)
        )
        rec.t0 = time.time()
        st.current = rec
        if hold:
            self._hold("shape")
        return ("go", st, rec, args, kwargs, restore, user_async, on_cuda)

    def bucket_all_reduce(
        self, fn: Callable[..., Any], buffer: Any, group: Any, caller: tuple[str, int]
    ) -> Any:
        """`fn(buffer, group=group, async_op=True)` recorded as `call` records it, for DDP's gradient
        buckets (sddoctor's comm hook): the same numbering and record, without the generic path's
        argument parsing and frame walk (the caller is the hook's, found once per backward). Only
        used while no collective fault is armed."""
        st = self._groups.get(group)
        if st is None:
            st = self._new_group(group)
        seq = st.seq + 1
        st.seq = seq
        rec = _Rec()
        rec.op, rec.key, rec.seq, rec.peer = "all_reduce", st.name, seq, None
        rec.shapes, rec.dtypes = [buffer.shape], [buffer.dtype]
        rec.file, rec.line = caller
        rec.handle, rec.t1, rec.deferred, rec.exact_end, rec.ddp = None, None, True, False, "bucket"
        rec.reduce = "SUM"  # as the generic path records `fn`'s default op: a rank may take either path
        rec.t0 = time.time()
        _tls.busy = True
        try:
            work = fn(buffer, group=group, async_op=True)
        except BaseException as exc:
            rec.t1 = time.time()
            rec.error = error_text(exc)
            self.last_failed = rec
            raise
        finally:
            _tls.busy = False
        rec.handle = work
        st.pending.append(rec)
        if buffer.device.type != "cuda":
            self._complete_on_callback(rec, work)
        return work

    def call_if_collective(self, fn: Callable[[], Any], spec: OpSpec, group: Any, mark: str) -> Any:
        """`fn()`, a call of DDP's that is a collective only when it returns true (the bucket
        rebuild: torch decides in C++, inside the call, whether to broadcast). While it runs it is
        in flight as the next call of the group's `:ddp` numbering, so a rank that waits there for
        a late peer is seen inside a collective; the number is kept only when the call was one.
        Numbered apart from the group's collectives, which thus stay as they were without it."""
        try:
            st = self._groups.get(group)
            if st is None:
                st = self._new_group(group)
            rec = _Rec()
            rec.op, rec.key, rec.seq = spec.name, st.name + DDP_SUFFIX, st.ddp_seq + 1
            rec.shapes, rec.dtypes, rec.ddp = [], [], mark
            frame = _caller_frame(sys._getframe(2))
            rec.file, rec.line = (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("?", 0)
            rec.t0 = time.time()
            st.ddp_seq, st.ddp_current = rec.seq, rec
        except Exception as exc:  # noqa: BLE001 - the call runs untraced then
            internal_error(f"tracing of {spec.name}", exc)
            return fn()
        _tls.busy = True
        try:
            result = fn()
        except BaseException as exc:
            rec.t1 = time.time()
            st.ddp_current = None
            rec.error = error_text(exc)
            self.last_failed = rec
            raise
        finally:
            _tls.busy = False
        st.ddp_current = None
        if not result and st.ddp_seq == rec.seq:
            st.ddp_seq = rec.seq - 1  # it communicated nothing: its number is not used
        return result

    def _complete_on_callback(self, rec: _Rec, work: Any) -> None:
        """End time of an async call on CPU tensors from its future's callback, run by the backend
        (gloo) when the call completes: the poll thread only sees it up to a second late, and the
        durations, waits and time in collectives would be that late too. On CUDA the future completes
        when the work is enqueued, not done, so CUDA calls stay polled."""

        def done(fut: Any) -> None:
            try:
                error = future_error(fut)
                if error is not None:  # a peer left: the program may catch what wait() raises
                    rec.error = error
                    self.last_failed = rec
                if self._finish_async(rec):
                    rec.exact_end = True  # readers need not treat its end as polled
            except Exception:  # noqa: BLE001 - runs on the backend's thread: never raise there
                pass

        try:
            work.get_future().add_done_callback(BackendCallback(done))
        except Exception:  # noqa: BLE001 - a Work without a future is polled as before
            pass

    def _finish_async(self, rec: _Rec, now: float | None = None) -> bool:
        """Complete an async call once, whichever of the poll and the callback sees it first."""
        with self._async_done:
            if rec.t1 is not None:
                return False
            self._finish(rec, time.time() if now is None else now)
            return True

    def _end(self, st: _Group, rec: _Rec, result: Any, user_async: bool, on_cuda: bool) -> None:
        """The call returned: complete now, or keep its Work / a CUDA event to poll."""
        if user_async:
            st.current = None
            rec.user_async = True
            if result is None:
                self._finish(rec, time.time())
            else:
                rec.handle = result
                rec.deferred = True
                st.pending.append(rec)
                if not on_cuda:
                    self._complete_on_callback(rec, result)
        elif on_cuda and (marker := _cuda_marker()) is not None:
            st.current = None
            rec.handle = marker
            rec.deferred = True
            st.pending.append(rec)
        else:
            rec.t1 = time.time()
            st.current = None
            self._finish(rec, rec.t1)

    def _finish(self, rec: _Rec, t1: float) -> None:
        rec.t1 = t1
        start = max(rec.t0, self._covered_until)
        if t1 > start:
            self.busy_seconds += t1 - start
            self._covered_until = t1
        last = self.last_done
        if last is None or rec.t0 >= last.t0:
            self.last_done = rec
        main = self.last_done_main
        if not rec.off_main and (main is None or rec.t0 >= main.t0):
            self.last_done_main = rec
        stats = self.op_stats.get(rec.op)
        if stats is None:
            stats = self.op_stats[rec.op] = [0, 0.0]
        stats[0] += 1
        stats[1] += t1 - rec.t0
        recent = self.recent
        if recent is not None:
            recent.append(rec)

    def take_recent(self) -> list[_Rec]:
        """Remove and return the completed calls buffered for the timeline, oldest first."""
        out: list[_Rec] = []
        recent = self.recent
        while recent:
            try:
                out.append(recent.popleft())
            except IndexError:  # drained by another thread meanwhile
                break
        return out

    def completed(self) -> int:
        """Completed traced calls since the start (all groups)."""
        return int(sum(v[0] for v in list(self.op_stats.values())))

    def _new_group(self, group: Any) -> _Group:
        c10d = self._c10d
        if group is not None and not _is_world(c10d, group):
            st = self._groups[group] = _Group(group, _group_name(c10d, group), _group_ranks(c10d, group))
            return st
        found = self._groups.get(None)
        if found is not None:
            st = found
        else:
            try:
                pg = c10d._get_default_group()
            except Exception:  # noqa: BLE001 - not initialized: torch raises its own error next
                return _Group(None, "default")
            st = self._groups[None] = _Group(pg, _group_name(c10d, pg))
        if group is not None:
            self._groups[group] = st
        return st

    # -- faults ---------------------------------------------------------------------------------

    def _apply_faults(
        self,
        st: _Group,
        seq: int,
        spec: OpSpec,
        args: tuple,
        kwargs: dict,
        pi: int,
        frame: Any,
        user_async: bool,
    ) -> Any:
        caller = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
        if self._hold_next:
            self._hold(caller)
        key = st.name + ":p2p" if spec.p2p else st.name
        default_name = self._default_name()
        for fault in self._faults:
            want = str(fault.get("pg") or default_name)
            if want not in (key, "*") and not (want == "default" and key == default_name):
                continue
            at = fault.get("seq")
            if fault.kind == "sleep":
                every = fault.get("every")
                if at is None or seq == at or (every and seq >= at and (seq - at) % every == 0):
                    if fault.spec not in self._fired:  # one `fault` event, the first time it fires
                        self._fired.add(fault.spec)
                        self._emit_fault(
                            {"fault": fault.spec, "seq": seq, "pg": key, "op": spec.name, "caller": caller}
                        )
                    time.sleep(float(fault.get("seconds")))
                continue
            if at != seq or fault.spec in self._fired:
                continue
            self._fired.add(fault.spec)
            fields = {"fault": fault.spec, "seq": seq, "pg": key, "op": spec.name, "caller": caller}
            if fault.kind in ("kill", "raise"):
                if self.session is not None:
                    self.session.fire_fault(fault, **fields)
                continue
            if fault.kind == "skip":
                self._emit_fault(fields)
                if getattr(_tls, "gradient_bucket", False):
                    # DDP's reducer issues collectives of its own that are not traced (the map of
                    # used parameters with find_unused_parameters, the bucket rebuild's broadcast at
                    # the next forward): held at the next traced call, one of those would meet the peers'
                    # pending bucket, which gloo aborts on and NCCL mixes up. It stops here instead.
                    self._hold(caller)
                if spec.kind == "object":
                    # the program reads the objects at once (a list left as it was, None where
                    # the peers' objects go) and would fail on them before its next collective,
                    # an error of the fault's making: the rank stops here instead
                    self._hold(caller)
                self._hold_at_ddps_own_collectives()
                self._hold_next = True
                atexit.register(self._hold, "exit")
                return ("skip", _skipped_result(spec, args, kwargs, pi, user_async))
            if fault.kind == "shape":
                changed = _change_shape(spec, args, kwargs, pi)
                if changed is not None:
                    new_args, new_kwargs, restore, shape, on_cuda = changed
                    # gloo aborts the peers (SIGABRT) on a size mismatch before anything can be
                    # recorded; NCCL hangs. On CPU the mismatched call is therefore held, not
                    # sent: the ranks disagree at #seq and wait, which is what NCCL does.
                    hold = not on_cuda
                    fields.update(shape=shape, sent=not hold)
                    self._emit_fault(fields)
                    return ("shape", new_args, new_kwargs, restore, hold)
        return None

    def _emit_fault(self, fields: dict[str, Any]) -> None:
        if self.session is not None:
            self.session.writer.emit(EventKind.FAULT, **fields)
            self.session.writer.flush()

    def _hold_at_ddps_own_collectives(self) -> None:
        """After a skip outside a gradient bucket, also hold the rank before DDP's untraced calls.

        Held only at the next traced collective, the rank would first run DDP's own collectives
        that sddoctor does not see: the bucket rebuild's broadcast at the next forward (after the
        first backward), the used-parameter map's all-reduce at the first gradient of the next
        backward (find_unused_parameters). One of those would meet the peers' pending call, which
        gloo aborts on ("Received data size doesn't match") and NCCL mixes up. So the rank stops
        at the next forward of any DDP model, or at the first gradient of its parameters, when
        either comes before the next traced collective. The hooks stay: the rank never goes on.
        """
        try:
            from sddoctor.instrument import ddp_patch

            for model in ddp_patch.live_models():
                model.register_forward_pre_hook(lambda _module, _args: self._hold("ddp forward"))
                for param in model.parameters():
                    if param.requires_grad:
                        param.register_hook(self._hold_at_gradient)
        except Exception as exc:  # noqa: BLE001 - held at the next traced collective then
            internal_error("skip fault: hold before DDP's own collectives", exc)

    def _hold_at_gradient(self, _grad: Any) -> None:
        self._hold("ddp backward")

    def _hold(self, where: str) -> None:
        """A skip fault fired: this rank never issues another collective (the others wait for it)."""
        if self.session is not None:
            self.session.writer.flush()
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            if where != "exit":
                raise  # as from the collective it stands for (mp.spawn's parent stops workers with SIGINT)
            # Interrupted while holding the exit (atexit): the process was told to stop, so it
            # ends quietly instead of printing a traceback from an atexit callback.

    def _default_name(self) -> str:
        st = self._groups.get(None)
        if st is not None:
            return st.name
        if self._c10d is not None:
            try:
                return _group_name(self._c10d, self._c10d._get_default_group())
            except Exception:  # noqa: BLE001 - not initialized yet
                pass
        return "default"

    # -- off the hot path: heartbeat and snapshot -----------------------------------------------

    def poll(self, now: float | None = None) -> int:
        """Mark finished async works complete. Never blocks. Returns how many finished."""
        now = time.time() if now is None else now
        done = 0
        for st in list(set(self._groups.values())):
            for rec in list(st.pending):
                if rec.t1 is None and _handle_done(rec.handle) and self._finish_async(rec, now):
                    done += 1
            while st.pending and st.pending[0].t1 is not None:
                try:
                    st.pending.popleft().handle = None
                except IndexError:
                    break
        return done

    def snapshot(self) -> dict[str, Any]:
        """The `collectives` field of the state snapshot."""
        now = time.time()
        inflight: list[dict[str, Any]] = []
        issued: dict[str, int] = {}
        members: dict[str, list[int]] = {}
        for st in list(set(self._groups.values())):
            if st.members is not None:
                members[st.name] = st.members
            if st.seq:
                issued[st.name] = st.seq
            if st.p2p_seq:
                issued[st.name + ":p2p"] = st.p2p_seq
            if st.ddp_seq:
                issued[st.name + DDP_SUFFIX] = st.ddp_seq
            for cur in (st.current, st.ddp_current):
                if cur is not None:
                    inflight.append(cur.as_dict(now))
            for rec in list(st.pending):
                if rec.t1 is None:
                    inflight.append(rec.as_dict(now))
        inflight.sort(key=lambda d: d["since"])
        stats = dict(self.op_stats)
        out: dict[str, Any] = {
            "inflight": inflight,
            "issued": issued,
            # wall time inside completed collectives: a straggler waits least
            "totals": {
                "count": int(sum(v[0] for v in stats.values())),
                "seconds": round(self.busy_seconds, 6),
            },
        }
        if members:
            out["groups"] = members
        last = self.last_done
        if last is not None:
            out["last_done"] = last.as_dict()
        main = self.last_done_main
        if main is not None and main is not last:  # a helper thread's call completed last
            out["last_done_main"] = main.as_dict()
        failed = self.last_failed
        if failed is not None:
            out["failed"] = failed.as_dict()
        if self.ddp_stats is not None:
            try:
                out["ddp"] = self.ddp_stats()
            except Exception as exc:  # noqa: BLE001
                out["ddp"] = {"error": repr(exc)}
        return out

    def summary(self) -> dict[str, Any]:
        """Counts and seconds per op since the start (the periodic `collective` event); `seconds`
        is wall time inside them, overlapping calls counted once, each op's the sum of its calls."""
        stats = dict(self.op_stats)
        return {
            "count": int(sum(v[0] for v in stats.values())),
            "seconds": round(self.busy_seconds, 6),
            "ops": {op: {"count": int(v[0]), "seconds": round(v[1], 6)} for op, v in stats.items()},
            "last_seq": {st.name: st.seq for st in set(self._groups.values()) if st.seq},
        }


# -- install / uninstall --------------------------------------------------------------------------


def patch() -> bool:
    """Wrap torch.distributed's collectives (idempotent); they pass through until `install`.

    A process that is not a rank yet (an mp.spawn worker before init_process_group) is patched
    this way at the import of torch.distributed, so that names the user binds later are the
    wrappers. False when this build of torch has no torch.distributed.
    """
    import torch.distributed as dist

    if not dist.is_available():
        return False
    from torch.distributed import distributed_c10d as c10d

    _patch(dist, c10d)
    return True


def install(rank: int, faults: list[Fault] | None = None, session: Any = None) -> Tracer:
    """Wrap torch.distributed's collectives (idempotent) and make a fresh Tracer the active one."""
    global _tracer, _roots
    if not patch():
        raise RuntimeError("torch.distributed is not available in this build of torch")
    from torch.distributed import distributed_c10d as c10d

    _roots = current_roots()
    _code_kind.clear()
    tracer = Tracer(rank, faults, session)
    tracer._c10d = c10d
    state = getattr(c10d, "_world", None)
    tracer._coalescing = getattr(state, "pg_coalesce_state", {}) if state is not None else {}
    _tracer = tracer
    return tracer


def uninstall() -> None:
    """Put the original functions back and forget the tracer."""
    global _tracer
    _tracer = None
    for (module, name), original in list(_originals.items()):
        setattr(module, name, original)
    _originals.clear()


def active() -> Tracer | None:
    return _tracer


def is_traced(fn: Any) -> bool:
    return getattr(fn, "__sddoctor_original__", None) is not None


def _patch(dist: Any, c10d: Any) -> None:
    for spec in _SPECS:
        original = getattr(c10d, spec.name, None)
        if original is None or is_traced(original):
            if original is not None and is_traced(getattr(dist, spec.name, None)):
                continue
        if original is None:
            continue
        original = getattr(original, "__sddoctor_original__", original)
        wrapper = _make_wrapper(original, spec)
        targets = [dist] if spec.name in _NAMESPACE_ONLY else [c10d, dist]
        for module in targets:
            current = getattr(module, spec.name, None)
            if current is original or (module is dist and current is None):
                _originals.setdefault((module, spec.name), original)
                setattr(module, spec.name, wrapper)
    for name in _QUIET:
        original = getattr(c10d, name, None)
        if original is None or is_traced(original):
            continue
        wrapper = _make_quiet(original, on_init=name == "init_process_group")
        for module in (c10d, dist, *_bound_by_name(name, original)):
            if getattr(module, name, None) is original:
                _originals.setdefault((module, name), original)
                setattr(module, name, wrapper)
    _patch_p2p_op(c10d)


def _bound_by_name(name: str, original: Any) -> list[Any]:
    """torch.distributed's own modules, loaded already, that imported `original` by name: the
    device mesh's module calls its own init_process_group and new_group (`init_device_mesh` starts
    the process group itself), which wrapping the attributes of c10d does not reach."""
    return [
        module
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("torch.distributed.")
        and module is not None
        and getattr(module, "__dict__", {}).get(name) is original
    ]


def _patch_p2p_op(c10d: Any) -> None:
    """P2POp must hold torch's own isend/irecv: batch_isend_irecv compares them by identity."""
    check = getattr(c10d, "_check_op", None)
    p2p = getattr(c10d, "P2POp", None)
    if check is None or p2p is None or is_traced(check):
        return

    def _check_op(op: Any) -> Any:
        return check(getattr(op, "__sddoctor_original__", op))

    _check_op.__sddoctor_original__ = check  # type: ignore[attr-defined]
    _originals.setdefault((c10d, "_check_op"), check)
    c10d._check_op = _check_op
    init = p2p.__init__

    @functools.wraps(init)
    def __init__(self: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        init(self, getattr(op, "__sddoctor_original__", op), *args, **kwargs)

    __init__.__sddoctor_original__ = init  # type: ignore[attr-defined]
    _originals.setdefault((p2p, "__init__"), init)
    p2p.__init__ = __init__


def _make_wrapper(fn: Callable[..., Any], spec: OpSpec) -> Callable[..., Any]:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    gi = params.index("group") if "group" in params else -1
    ai = params.index("async_op") if "async_op" in params else -1
    pi = params.index(spec.payload) if spec.payload in params else -1

    def traced(*args: Any, **kwargs: Any) -> Any:
        tracer = _tracer
        if tracer is None or getattr(_tls, "busy", False) or tracer._coalescing:
            return fn(*args, **kwargs)
        return tracer.call(fn, spec, gi, ai, pi, args, kwargs)

    functools.update_wrapper(traced, fn)
    traced.__sddoctor_original__ = fn  # type: ignore[attr-defined]
    return traced


def _make_quiet(fn: Callable[..., Any], on_init: bool) -> Callable[..., Any]:
    try:
        signature: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None

    def quiet(*args: Any, **kwargs: Any) -> Any:
        if on_init:
            _run_callbacks(_before_init, "init_process_group (before)", *_init_rank(signature, args, kwargs))
        before = getattr(_tls, "busy", False)
        _tls.busy = True
        try:
            result = fn(*args, **kwargs)
        finally:
            _tls.busy = before
        if on_init:
            _run_callbacks(_after_init, "init_process_group (after)")
        return result

    functools.update_wrapper(quiet, fn)
    quiet.__sddoctor_original__ = fn  # type: ignore[attr-defined]
    return quiet


def _init_rank(
    signature: inspect.Signature | None, args: tuple, kwargs: dict
) -> tuple[int | None, int | None]:
    """The rank and world size an init_process_group call asks for (its arguments, else RANK and
    WORLD_SIZE from the environment), None where neither says."""
    found: dict[str, Any] = {}
    if signature is not None:
        try:
            found = dict(signature.bind_partial(*args, **kwargs).arguments)
        except TypeError:
            found = dict(kwargs)
    out: list[int | None] = []
    for key, env in (("rank", "RANK"), ("world_size", "WORLD_SIZE")):
        value = found.get(key, -1)
        if not isinstance(value, int) or value < 0:
            try:
                value = int(os.environ[env])
            except (KeyError, ValueError):
                value = None
        out.append(value)
    return out[0], out[1]


def _run_callbacks(callbacks: list[Callable[..., None]], where: str, *args: Any) -> None:
    for callback in list(callbacks):
        try:
            callback(*args)
        except Exception as exc:  # noqa: BLE001 - never break the user's init
            internal_error(where, exc)


#: called with (rank, world_size) when init_process_group is entered (None where unknown yet):
#: a process that is not a rank yet becomes one there
_before_init: list[Callable[[int | None, int | None], None]] = []
#: called after every successful init_process_group (the session learns its rank there)
_after_init: list[Callable[[], None]] = []


# -- helpers ---------------------------------------------------------------------------------------


def _kind_of(code: Any) -> int:
    kind = _code_kind.get(code)
    if kind is None:
        filename = code.co_filename
        roots = _roots or current_roots()
        if roots.is_internal(filename):
            kind = _INTERNAL
        elif roots.is_library(filename):
            kind = _LIBRARY
        else:
            kind = _USER
        _code_kind[code] = kind
    return kind


def _caller_frame(frame: Any, library_fallback: bool = True) -> Any:
    """The innermost frame of the user's own code above `frame`; else (with `library_fallback`) the
    first one outside torch and sddoctor (a library's, e.g. accelerate's); else None. The verdict
    per code object is cached."""
    fallback = None
    while frame is not None:
        kind = _kind_of(frame.f_code)
        if kind == _USER:
            return frame
        if library_fallback and kind == _LIBRARY and fallback is None:
            fallback = frame
        frame = frame.f_back
    return fallback


def root_of(spec: OpSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | str | None:
    """The root a rooted collective was given: its `src`/`dst` (a global rank), else its
    `group_src`/`group_dst` (torch >= 2.6: a rank within the group) as "group rank N"."""
    if spec.root is None:
        return None
    name, position = spec.root
    value = kwargs[name] if name in kwargs else (args[position] if position < len(args) else None)
    if isinstance(value, int):
        return value
    local = kwargs.get(f"group_{name}")
    return f"group rank {local}" if isinstance(local, int) else None


#: DDP's broadcast of its module buffers (BatchNorm's running statistics) from rank 0 before each
#: training forward, which DDP issues from C++ (`_broadcast_coalesced`)
BUFFER_BROADCAST = OpSpec("broadcast", "tensors")


#: DDP's bucket rebuild: once per model, at the first training forward after its buckets' order
#: was recorded (after the first synchronised backward; with static_graph, the second), rank 0
#: broadcasts the new order from C++ (`Reducer._rebuild_buckets`)
BUCKET_REBUILD = OpSpec("broadcast", None)
#: the suffix of a group's key for DDP's own calls numbered apart (`Tracer.call_if_collective`)
DDP_SUFFIX = ":ddp"


def call_if_collective(fn: Callable[[], Any], spec: OpSpec, group: Any, mark: str) -> Any:
    """`fn()` traced as `Tracer.call_if_collective` does, when a tracer is active."""
    tracer = _tracer
    if tracer is None or getattr(_tls, "busy", False) or tracer._coalescing:
        return fn()
    return tracer.call_if_collective(fn, spec, group, mark)


def call_traced(fn: Callable[[Any, Any], Any], spec: OpSpec, group: Any, payload: Any) -> Any:
    """`fn(group, payload)`, a collective torch issues without going through torch.distributed's
    functions, traced as a call of `spec` on `group` (numbered, timed and faulted like the others).
    Without it a rank that waits there for a late peer looks as if it were in no collective."""
    tracer = _tracer
    if tracer is None or getattr(_tls, "busy", False) or tracer._coalescing:
        return fn(group, payload)
    return tracer.call(fn, spec, 0, -1, 1, (group, payload), {})


def bucket_all_reduce(buffer: Any, group: Any, caller: tuple[str, int] | None) -> Any:
    """An async all-reduce of a DDP gradient bucket, traced: the lean path when it can be taken
    (a tracer, no fault armed, `caller` known), else torch.distributed's (traced) all_reduce."""
    import torch.distributed as dist

    tracer = _tracer
    traced = dist.all_reduce
    if tracer is None or caller is None or tracer._slow or tracer._coalescing or getattr(_tls, "busy", False):
        _tls.gradient_bucket = True  # for a skip fault (`_apply_faults`)
        try:
            return traced(buffer, group=group, async_op=True)
        finally:
            _tls.gradient_bucket = False
    return tracer.bucket_all_reduce(getattr(traced, "__sddoctor_original__", traced), buffer, group, caller)


def caller_of_backward() -> tuple[str, int] | None:
    """(file, line) of the user's frame that started this backward (see `_caller_frame`)."""
    frame = _caller_frame(sys._getframe(1))
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else None


def user_caller(library_fallback: bool = True) -> str | None:
    """'file:line' of the innermost user frame of the calling thread (see `_caller_frame`)."""
    frame = _caller_frame(sys._getframe(1), library_fallback)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else None


def _is_collective_fault(fault: Fault) -> bool:
    if fault.kind in ("skip", "shape"):
        return True
    return fault.kind in ("sleep", "kill", "raise") and fault.get("seq") is not None


def _is_world(c10d: Any, group: Any) -> bool:
    try:
        return group is c10d.GroupMember.WORLD
    except Exception:  # noqa: BLE001
        return False


def _group_ranks(c10d: Any, group: Any) -> list[int] | None:
    """The global ranks of a subgroup, as torch lists them (None when it cannot say)."""
    try:
        ranks = c10d.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - an older torch or a group it does not know
        return None
    return sorted(int(r) for r in ranks)


def _group_name(c10d: Any, pg: Any) -> str:
    if c10d is None or pg is None:
        return "default"
    try:
        name = c10d._world.pg_names.get(pg)
    except Exception:  # noqa: BLE001
        name = None
    if not name:
        name = getattr(pg, "group_name", None)
    return str(name) if name else "default"


def dtype_name(dtype: Any) -> str:
    """A recorded dtype as text ("float32"); one already recorded as text stays as it is."""
    if isinstance(dtype, str):
        return dtype
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).replace("torch.", "")
    return name


def _describe(payload: Any, kind: str) -> tuple[list[Any], list[Any], bool]:
    """Shapes and dtypes of the payload, and whether it lives on a CUDA device."""
    if payload is None:
        return [], [], False
    shape = getattr(payload, "shape", None)
    if shape is not None:  # torch.Size and dtype objects: turned into JSON at snapshot time
        return [shape], [payload.dtype], payload.is_cuda
    if kind == "object" and isinstance(payload, list):
        return [[len(payload)]], ["object"], False
    if isinstance(payload, (list, tuple)):
        shapes: list[Any] = []
        dtypes: list[Any] = []
        cuda = False
        for entry in payload[:_MAX_LISTED]:
            tensor: Any = getattr(entry, "tensor", entry)  # P2POp
            shape = getattr(tensor, "shape", None)
            if shape is not None:
                shapes.append(shape)
                dtypes.append(tensor.dtype)
                cuda = cuda or bool(getattr(tensor, "is_cuda", False))
        return shapes, dtypes, cuda
    return [], [], False


def error_text(exc: BaseException) -> str:
    """An exception as a failed call's record keeps it: its type and the start of its message.
    Called where the user's exception is on its way out: nothing may raise here."""
    try:
        return f"{type(exc).__name__}: {exc}"[:500]
    except Exception:  # noqa: BLE001 - an exception whose str() fails: its type says enough
        return type(exc).__name__


def future_error(fut: Any) -> str | None:
    """What a completed future failed with, or None: `value()` returns at once on a done future and
    raises its error."""
    try:
        fut.value()
    except Exception as exc:  # noqa: BLE001 - the error is what is wanted here
        return error_text(exc)
    return None


def _cuda_marker() -> Any:
    """A CUDA event on the current stream: it completes when the collective before it does.

    None while a CUDA graph is being captured (an event recorded there would become part of the
    graph); the call then counts as complete when it returns.
    """
    import torch

    if torch.cuda.is_current_stream_capturing():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _handle_done(handle: Any) -> bool:
    try:
        if isinstance(handle, list):
            return all(_handle_done(h) for h in handle)
        if hasattr(handle, "is_completed"):
            return bool(handle.is_completed())
        if hasattr(handle, "query"):
            return bool(handle.query())
    except Exception:  # noqa: BLE001 - a failed work counts as finished; the exception surfaces in wait()
        return True
    return True


def _skipped_result(spec: OpSpec, args: tuple, kwargs: dict, pi: int, user_async: bool) -> Any:
    if spec.name == "batch_isend_irecv":
        ops = kwargs.get("p2p_op_list", args[0] if args else [])
        return [DoneWork([getattr(op, "tensor", None)]) for op in ops]
    payload = None
    if spec.payload is not None:
        payload = (
            kwargs[spec.payload] if spec.payload in kwargs else (args[pi] if 0 <= pi < len(args) else None)
        )
    result = (
        list(payload) if isinstance(payload, (list, tuple)) else ([payload] if payload is not None else [])
    )
    if spec.name in ("isend", "irecv"):
        return DoneWork(result)
    if spec.name == "recv":
        src = kwargs.get("src", args[1] if len(args) > 1 else None)
        return src if isinstance(src, int) else -1
    if user_async:
        return DoneWork(result)
    return None


def _change_shape(spec: OpSpec, args: tuple, kwargs: dict, pi: int) -> Any:
    """Arguments with the payload tensor one row longer, a restore callback, and the new shape."""
    import torch

    if spec.payload is None:
        return None
    in_kwargs = spec.payload in kwargs
    tensor = kwargs[spec.payload] if in_kwargs else (args[pi] if 0 <= pi < len(args) else None)
    if not isinstance(tensor, torch.Tensor):
        return None
    flat = tensor.reshape(-1) if tensor.dim() == 0 else tensor
    bigger = torch.cat([flat, flat[:1]]).contiguous()
    if in_kwargs:
        kwargs = dict(kwargs, **{spec.payload: bigger})
    else:
        args = (*args[:pi], bigger, *args[pi + 1 :])
    restore = None
    if spec.name in _INPLACE and not kwargs.get("async_op"):

        def restore() -> None:
            tensor.copy_(bigger[: flat.shape[0]].reshape(tensor.shape))

    return args, kwargs, restore, list(bigger.shape), bool(tensor.is_cuda)
