"""What each rank's own record of calls says about a hang: where a rank is blocked, which ranks
belong to a process group, the call sites ranks parted at, a rank that left its own routine, and
who waits for whom in point-to-point calls.

A call site is (op, caller): the same op called from the same user line. Pure functions over
`RankState`s (their sightings and snapshots); no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from sddoctor.supervise.state import RankState, RunState
from sddoctor.telemetry.snapshot import Collective

#: (op, caller "file:line")
Site = tuple[str | None, str | None]

_SENDS = ("send", "isend")
_RECVS = ("recv", "irecv")


def site_of(call: Collective) -> Site:
    return (call.op, call.caller)


def site_text(site: Site) -> str:
    return f"{site[0]} at {site[1] or 'an unknown line'}"


def is_p2p(call: Collective) -> bool:
    return call.pg.endswith(":p2p")


def blocked_call(rank: RankState) -> Collective | None:
    """The call a rank is blocked in: of its calls in flight, one that holds the rank (its main
    thread's, or DDP's within its step: `Collective.holds_the_rank`) before one that does not (a
    helper thread's, a Work left pending), a synchronous one before an async one, then the latest.
    A thread waits in one call at a time; async works still open on other groups (DDP's buckets,
    an isend) are not where it is, and a helper thread's call, issued every fraction of a second
    while the main thread waits elsewhere, is not where the rank is."""
    inflight = rank.snapshot.inflight
    if not inflight:
        return None
    return max(inflight, key=lambda c: (c.holds_the_rank, not c.is_async, c.since or 0.0, c.seq or 0))


def group_members(state: RunState, pg: str, everyone: list[int]) -> list[int]:
    """The ranks that issue `pg`'s calls: a subgroup's members as a rank that used it recorded them,
    else every rank (the default group, or telemetry that does not record members)."""
    # a group's point-to-point calls and DDP's own calls numbered apart (":ddp") have its members
    name = pg.removesuffix(":p2p").removesuffix(":ddp")
    for rank in state.ranks.values():
        members = rank.snapshot.groups.get(name)
        if members:
            return sorted(members)
    return everyone


def _history(rank: RankState) -> list[tuple[float, Site]]:
    """The rank's calls on every group (p2p included) in the order it issued them."""
    calls = [
        (arrival.enqueue, (arrival.op, arrival.caller))
        for sightings in rank.arrivals.values()
        for arrival in sightings.values()
    ]
    return sorted(calls, key=lambda call: call[0])


def sites_used(rank: RankState) -> set[Site]:
    """Every call site the rank is known to have called, on any group."""
    used = {site for _, site in _history(rank)}
    return used | {site_of(c) for c in rank.snapshot.inflight}


@dataclass(frozen=True)
class Departure:
    """A rank's call that broke its routine: every earlier time it called `previous`, its next
    call was `usual` (or one of a few sites), never `current`."""

    previous: Site
    current: Site
    #: the one site that always came next before, if there was only one
    usual: Site | None

    def to_dict(self) -> dict[str, dict[str, str | None] | None]:
        """The three sites as {op, caller} (for a verdict's details)."""

        def one(site: Site | None) -> dict[str, str | None] | None:
            return None if site is None else {"op": site[0], "caller": site[1]}

        return {"previous": one(self.previous), "current": one(self.current), "usual": one(self.usual)}


def left_routine(rank: RankState, call: Collective, min_repeats: int = 2) -> Departure | None:
    """Whether `call` broke the rank's own routine: the call before it was made at least
    `min_repeats` times earlier and was never followed by `call`'s site. A rank that skipped a
    collective, or called one its routine does not have, shows it; a rank that only waits does not."""
    since = call.enqueued
    if since is None:
        return None
    before = [site for t, site in _history(rank) if t < since]
    if len(before) < 2:
        return None
    previous, current = before[-1], site_of(call)
    followers = [before[i + 1] for i in range(len(before) - 2) if before[i] == previous]
    if len(followers) < min_repeats or current in followers:
        return None
    usual = followers[0] if len(set(followers)) == 1 else None
    return Departure(previous, current, usual)


@dataclass(frozen=True)
class PartedSites:
    """Where ranks' calls on one group stopped matching: the seq of the first call of the last
    stretch of disagreeing calls, each rank's site there, and the ranks whose site another rank
    never calls (the ones that took a path the others do not have)."""

    seq: int
    sites: dict[int, Site]
    #: per odd rank, the ranks that never call its site
    odd: dict[int, list[int]]


def _sites_by_seq(rank: RankState, pg: str, extra: Collective | None) -> dict[int, Site]:
    table = {seq: (a.op, a.caller) for seq, a in rank.arrivals.get(pg, {}).items()}
    for c in (*rank.snapshot.inflight, extra):
        if c is not None and c.pg == pg and c.seq is not None:
            table.setdefault(c.seq, site_of(c))
    return table


def parted_sites(
    state: RunState, pg: str, ranks: list[int], calls: dict[int, Collective]
) -> PartedSites | None:
    """Walk back from the latest call of `ranks` on `pg` while their call sites differ; at the first
    call of that stretch, name the ranks whose site some other rank never calls at all. None when
    the sites agree at the latest call known from two ranks (a shape change at one call site is
    no parting)."""
    tables = {r: _sites_by_seq(state.ranks[r], pg, calls.get(r)) for r in ranks if r in state.ranks}
    seqs = sorted({seq for table in tables.values() for seq in table}, reverse=True)
    first: tuple[int, dict[int, Site]] | None = None
    for seq in seqs:
        at = {r: table[seq] for r, table in tables.items() if seq in table}
        if len(at) < 2:
            continue
        if len(set(at.values())) == 1:
            break
        first = (seq, at)
    if first is None:
        return None
    seq, at = first
    used = {r: sites_used(state.ranks[r]) for r in at}
    never = {r: [q for q in sorted(at) if q != r and site not in used[q]] for r, site in at.items()}
    return PartedSites(seq, at, {r: others for r, others in sorted(never.items()) if others})


@dataclass(frozen=True)
class PeerWait:
    """Who waits for whom in point-to-point calls, followed from one rank: a `cycle` of ranks each
    waiting for the next (a deadlock), or a chain ending at `blocker`, a rank not in a p2p call
    towards it (computing, in a collective, exited)."""

    chain: list[int]
    cycle: list[int]
    blocker: int | None


def _matched(a: Collective, b: Collective) -> bool:
    """A send and a recv that name each other: the pair itself should complete."""
    return (a.op in _SENDS and b.op in _RECVS) or (a.op in _RECVS and b.op in _SENDS)


def peer_waits(calls: dict[int, Collective]) -> list[PeerWait]:
    """Follow each blocked p2p call to its peer until a cycle closes or the chain leaves p2p;
    chains that end in a matched send/recv pair are left out (nobody waits on a missing call)."""
    waits_on = {r: c.peer for r, c in calls.items() if is_p2p(c) and c.peer is not None}
    found: list[PeerWait] = []
    for start in sorted(waits_on):
        chain = [start]
        while True:
            here, there = chain[-1], waits_on[chain[-1]]
            if there in chain:
                found.append(PeerWait(chain, chain[chain.index(there) :], None))
                break
            if there not in waits_on:
                found.append(PeerWait(chain, [], there))
                break
            if waits_on[there] == here and _matched(calls[here], calls[there]):
                break
            chain.append(there)
    return found
