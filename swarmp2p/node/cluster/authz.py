"""Who may send which control request: a pure function of the request, its authenticated
sender and the table. Never imports torch.

Every request on a control port arrives with the public key ZAP admitted for its connection;
the keyring binds that key to one node id, the *sender*. A request that names a node (a hello,
a heartbeat, a leave, a vote request, a table write, a stage report...) must name its sender:
no node speaks, leaves, leads or writes as another (issue 15). Requests that act on the
swarm's state come only from members; commands to a stage's node come only from the leader.

A served model's stages take commands from its issuing node (the node that ran ``swarm
serve``) or the leader only (issue 24): :func:`serve_refusal` is checked by the stage's node
against the issuer it recorded for that serve id, :func:`serve_exit_refusal` by the issuing
node against its ring's plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from swarmp2p.node import messages as m
from swarmp2p.node.cluster import join as jn
from swarmp2p.node.table import events as ev
from swarmp2p.node.table.jobtable import JobTable
from swarmp2p.wire.messages import Message

CLAIMS: Mapping[type, str] = {
    m.NodeHello: "node_id",
    m.Heartbeat: "node_id",
    m.Leave: "node_id",
    m.LeadRequest: "candidate",
    m.TableFetch: "node_id",
    m.TablePush: "node_id",
    m.TableEvents: "leader",
    m.StageReport: "node_id",
    m.ShardCopy: "node_id",
    m.ServeStageExit: "node_id",
    m.ServeStageStart: "issuer",
    m.ServeNote: "issuer",
    m.StageStart: "leader",
}
"""The field of each request that names its sender."""

ANY_ADMITTED = (m.NodeHello, m.Heartbeat, m.Leave, m.TableFetch)
"""Requests a node that joined but is not listed yet may send (to be met, to be listed)."""

FROM_LEADER = (m.StageStart, m.StageStop, jn.SecretPush)
"""Commands only the leader gives. (``job.file_pull`` comes from the leader copying a snapshot
or from a node serving a trained model: any member; the file lands confined to its job's
folder, ``swarmp2p.paths``.)"""

VOTES_AND_WRITES = (m.LeadRequest, m.TablePush, m.TableEvents)
"""Members only, except while no swarm is founded (the first leader founds it with the nodes
that voted for it; replication checks term and leader)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sender:
    """Who sent a request, as this node sees it."""

    node_id: str
    """The node id its key is bound to."""
    member: bool
    """Listed in this node's table."""


def refusal(msg: Message, sender: Sender, table: JobTable, view_leader: str) -> str:
    """Why ``sender`` may not send ``msg`` ("" when it may)."""
    who = sender.node_id
    claim = CLAIMS.get(type(msg))
    if claim is not None and getattr(msg, claim) != who:
        return (
            f"{type(msg).TYPE} claims {claim} {getattr(msg, claim)!r}, but it comes from node {who}"
        )
    if isinstance(msg, ANY_ADMITTED):
        return ""
    if isinstance(msg, VOTES_AND_WRITES):
        return "" if sender.member or not table.members else _not_member(who)
    if not sender.member:
        return _not_member(who)
    if isinstance(msg, FROM_LEADER):
        if who not in (view_leader, table.leader):
            return f"only the leader gives {type(msg).TYPE}; node {who} does not lead"
        return ""
    if isinstance(msg, m.StageReport):
        entry = table.jobs.get(msg.job_id)
        if entry is not None and entry.plan is not None and entry.attempt == msg.attempt:
            r = msg.replica
            stages = entry.plan.replica_stages(r) if r < entry.plan.n_replicas else ()
            if not 0 <= msg.stage < len(stages) or stages[msg.stage].node_id != who:
                where = f"stage {msg.stage}" + (f" of replica {r}" if r else "")
                return f"{where} of job {msg.job_id} does not run on node {who}"
    return ""


SERVE_STAGE_COMMANDS = (m.ServeStageStart, m.ServeStageConnect, m.ServeStageStop)
"""Commands to a served model's stage: from its issuing node, or the leader."""


def serve_refusal(
    msg: Message,
    sender: str,
    issuer: str | None,
    leaders: set[str],
    claimants: frozenset[str] = frozenset(),
) -> str:
    """Why ``sender`` may not send ``msg`` (one of SERVE_STAGE_COMMANDS) to a stage's node
    that runs stages of ``msg.serve_id`` for ``issuer`` (None: nothing of it runs there); ""
    when it may. ``leaders``: the nodes this node counts as leading (its view, its table);
    ``claimants``: the nodes whose last heartbeat says they issue ``msg.serve_id``.

    Only the issuing node of a serve id, or the leader, stops or connects its stages. A
    start names its issuer (``refusal`` checks that it is the sender): it must be the issuer
    of the stages of that serve id already running there, or, before any runs, one of the
    nodes that claim it (when any does), the leader's start included."""
    if not isinstance(msg, SERVE_STAGE_COMMANDS):
        return ""
    kind, serve_id = type(msg).TYPE, msg.serve_id
    if isinstance(msg, m.ServeStageStart):
        owners = {issuer} if issuer is not None else set(claimants)
        if owners and msg.issuer not in owners:
            return f"{kind} for serve {serve_id}: it is issued by node {', '.join(sorted(owners))}, not by node {msg.issuer}"
        return ""
    if issuer is None or sender == issuer or sender in leaders:
        return ""
    lead = ", ".join(sorted(x for x in leaders if x)) or "none"
    return f"{kind} for serve {serve_id}: only its issuing node {issuer} or the leader ({lead}) may send it; node {sender} is neither"


def serve_exit_refusal(msg: m.ServeStageExit, stage_nodes: list[str] | None) -> str:
    """Why the issuing node does not take ``msg`` (its ``node_id`` is the sender, ``refusal``
    checks that) for its live ring, whose stages run on ``stage_nodes`` (None: ``msg`` is not
    about the live ring, it is ignored): only a stage's own node reports its worker's exit."""
    if stage_nodes is None:
        return ""
    if not 0 <= msg.stage < len(stage_nodes) or stage_nodes[msg.stage] != msg.node_id:
        return f"{msg.TYPE}: stage {msg.stage} of serve {msg.serve_id} does not run on node {msg.node_id}"
    return ""


def serve_note_refusal(table: JobTable, event: object, sender: str) -> str:
    """Why the leader does not write serving table event ``event`` for ``sender``; "" when
    it may: only a serving event, and only for a model ``sender`` issues."""
    if not isinstance(event, ev.SERVE_EVENTS):
        return f"serve.note carries {getattr(event, 'NAME', type(event).__name__)}, not a serving event"
    if isinstance(event, ev.ServeRequested):
        issuer = event.issuer
    else:
        record = table.served.get(event.serve_id)
        if record is None:
            return ""  # apply refuses it, naming the unknown serve id
        issuer = record.issuer
    if issuer != sender:
        return f"serve.note for serve {event.serve_id}: it is issued by node {issuer}, not by node {sender}"
    return ""


def _not_member(who: str) -> str:
    return f"node {who} is not a member of this swarm (yet)"


def refusal_code(sender: Sender, why: str) -> str:
    """The error code of a refusal: ``joining`` when the only reason is that the table does
    not list the sender yet (a node the swarm admitted moments ago, whose membership is
    still committing: worth a retry), else ``forbidden``."""
    return "joining" if why == _not_member(sender.node_id) else "forbidden"


__all__ = [
    "CLAIMS",
    "Sender",
    "refusal",
    "refusal_code",
    "serve_exit_refusal",
    "serve_note_refusal",
    "serve_refusal",
]
