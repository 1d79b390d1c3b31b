"""Every timing of the light plane (daemon, CLI, client, network, serving front end) in one
record, each with its unit and why it has its value. Standard library only.

``TIMINGS`` holds the defaults every module reads. The daemon carries its own in
``NodeConfig.timings`` (``swarm up --heartbeat/--failure-timeout`` set two of them), so a test
passes ``Timings(heartbeat_s=0.05, failure_timeout_s=0.2)`` instead of sleeping through the
defaults; a module without a config reads its module-level ``TIMINGS``, which a test replaces
with a smaller one. Names end in their unit (``_s`` seconds, ``_ms`` milliseconds). The
worker processes' own timings are in ``swarmp2p.timings.workers``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TIMINGS", "Timings"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Timings:
    """The light plane's timings; ValueError when they contradict each other."""

    # --- membership (node/cluster, node/config) -----------------------------------------------
    heartbeat_s: float = 0.5
    """Between two heartbeats to each live peer (`swarm up --heartbeat`): a few a second keep
    the views fresh for a handful of LAN nodes at a few hundred bytes each."""
    failure_timeout_s: float = 3.0
    """Silence after which a peer is dead (`--failure-timeout`): six missed heartbeats, so a
    busy peer (a stage loading a model) is not declared dead for one slow answer."""
    forget_after_s: float = 60.0
    """How long a dead (not cleanly stopped) peer stays listed with ``alive: false``."""
    join_reply_s: float = 1.0
    """Added to the hello timeout for a join's reply: one round trip and a CURVE handshake (the
    leader lists the newcomer in the background)."""
    rotate_s: float = 10.0
    """How long `swarm token --rotate` waits for the members to take the new secret."""
    leave_s: float = 2.0
    """How long a stopping member waits for the leader to take it off the members."""
    invite_ttl_s: float = 600.0
    """An invite is valid for 10 minutes: long enough to walk to the other machine."""
    pairing_try_every_s: float = 1.0
    """At most one exchange per invite per source address per second."""
    pairing_session_ttl_s: float = 30.0
    """A started exchange that is not finished within this is dropped."""
    pairing_browse_s: float = 5.0
    """How long `swarm up --code` looks for the inviting node on the LAN."""
    pairing_exchange_s: float = 5.0
    """How long the joiner waits for each SPAKE2 message of the exchange (milliseconds on a
    LAN; the inviter may be a loaded daemon)."""

    # --- the table and the leader (node/table, node/training, node/decide) -------------------
    commit_s: float = 10.0
    """How long a submission waits for a majority to hold it."""
    submit_every_s: float = 2.0
    """Past a burst of ``SUBMIT_BURST`` submissions the leader takes one job per node every
    this many seconds: jobs that fail at once are not waiting, so the waiting caps do not bound
    them, and each is planned and kept in the table (at most 1,800 an hour per node)."""
    progress_every_s: float = 5.0
    """The leader writes a job's progress (step, loss) to the replicated table at most this
    often (and at every snapshot and at the end); the curve stays in its memory."""
    plan_again_s: float = 30.0
    """A waiting job whose planning inputs did not change is planned again at most this often."""
    report_every_s: float = 0.2
    """How often a node sends its workers' new events to the leader (one batch per worker)."""
    snapshot_listed_s: float = 3.0
    """How long a ``job.file_pull`` waits for the table to list the snapshot it names."""
    stage_stop_s: float = 5.0
    """How long the leader waits for a stage node to confirm it stopped a job's workers."""
    shard_copy_s: float = 60.0
    """How long the leader waits for a node to answer a request to copy a trained shard."""
    stage_prepare_s: float = 6 * 3600.0
    """How long the stage nodes may take to fetch their files (a stalled fetch fails sooner:
    each chunk has its own timeout)."""
    corpus_prepare_s: float = 600.0
    """How long a corpus or reslice subprocess (``python -m``) may run."""
    metrics_wanted_s: float = 10.0
    """A follower fetches job metrics from the leader while its status was asked this
    recently."""
    link_timeout_s: float = 30.0
    """How long a training stage waits on a silent neighbour before it fails (the leader stops
    it sooner); carried to the worker in its ``WorkerSpec``."""

    # --- this node's hardware and logs ------------------------------------------------------
    live_memory_every_s: float = 1.0
    """Free memory is re-read at most this often (each heartbeat asks; NVML takes ~1 ms a
    device)."""
    speed_probe_s: float = 600.0
    """A speed probe that takes longer than this (a wedged GPU) is given up; the node stays
    unmeasured."""
    speed_cache_s: float = 86400.0
    """A cached speed older than this is measured again at the daemon's next start: one probe
    taken while the machine was busy would otherwise split every job by it for good."""
    resource_errors_every_s: float = 10.0
    """At most one log line (without its traceback) per this many seconds about running out
    of descriptors or buffers; the ones in between are counted in the next line."""
    refusals_log_every_s: float = 10.0
    """At most one line per this many seconds about refused connections and accept errors: a
    flood must not fill the disk with log lines (issue 15: 84 MB of EMFILE tracebacks)."""

    # --- sockets (net/) ---------------------------------------------------------------------
    rpc_rebind_s: float = 5.0
    """How long a fixed port is tried again while it is still in use: zmq releases a closed
    socket's listener on its I/O thread, after ``close()`` returns, so a server restarted on
    its own port (a re-key) can find the port still held for a moment."""
    zmq_heartbeat_ivl_ms: int = 2000
    """ZMTP heartbeats are sent this often on every CURVE socket."""
    zmq_heartbeat_timeout_ms: int = 6000
    """A peer silent this long (host gone, cable pulled) is disconnected, so the socket
    reconnects instead of queueing into a dead TCP connection."""
    zmq_handshake_ivl_ms: int = 5000
    """A connection that has not finished its CURVE handshake in this long is closed: four
    small messages take milliseconds on a LAN, well under a second on a loaded 2-core box;
    libzmq's default, 30 s, let idle unauthenticated connections hold a descriptor each."""
    zmq_reconnect_ivl_ms: int = 100
    """ZeroMQ reconnect back-off of stage links: the first retry after this long ..."""
    zmq_reconnect_ivl_max_ms: int = 2000
    """... doubling up to this."""
    mdns_resolve_ms: int = 3000
    """How long resolving one mDNS advert's service info may take."""

    # --- workers as the daemon and LocalRing see them (swarmp2p/workers, serve/local.py) ------------
    worker_ready_s: float = 60.0
    """How long a training worker may take to start and say ``ready``."""
    worker_stop_grace_s: float = 3.0
    """Between SIGTERM and SIGKILL for a worker being stopped (and again before giving up)."""
    local_stage_ready_s: float = 300.0
    """How long a one-process serving stage worker may take to load its stage and bind its
    link."""
    local_stage_connect_s: float = 60.0
    """How long a started one-process serving worker may take to dial the next stage and
    report ``serving``."""

    # --- serving on the daemon (node/serving) ------------------------------------------------
    serve_plan_s: float = 30.0
    """How long the issuing node waits for the leader's plan of a ring (``serve.plan``: the
    planner runs in milliseconds; a forwarded call crosses the LAN twice)."""
    serve_stage_start_s: float = 3500.0
    """How long the issuing node waits for a stage to start: fetching the model's files or a
    trained shard to that node first (chunks time out on their own), then loading. Below
    ``serve_start_s`` so the daemon answers `swarm serve` with the reason before it gives up."""
    serve_stage_load_s: float = 120.0
    """How long a stage's node may take to load its slice and bind its link once its files are
    local (a 135M model loads in seconds on a CPU; a 7B slice in tens of seconds)."""
    serve_stage_connect_s: float = 30.0
    """How long a started stage worker may take to dial the next stage and report
    ``serving`` (one CURVE handshake on a LAN; the next stage may still be binding)."""
    serve_step_s: float = 60.0
    """A session of a served ring that gets no token for this long fails (covers a
    re-placement's reload of one stage)."""
    serve_restore_for_s: float = 600.0
    """How long a restarted daemon keeps trying to serve its models in the table again (its
    peers may come back minutes later)."""
    serve_restore_every_s: float = 5.0
    """Between two tries to serve one such model again (a plan and a ring start each)."""
    serve_note_s: float = 10.0
    """How long the leader may take to write one serving event (``serve.note``: a commit by a
    majority, ``commit_s`` at most, is usually milliseconds)."""
    serve_note_retry_s: float = 0.2
    """After a failed ``serve.note`` send, the wait before the next one while `swarm serve
    --stop` waits for its event to be written."""
    file_chunk_s: float = 30.0
    """How long one chunk of a copied model file or shard may take to arrive: a stalled copy
    fails at this (a few MB over 1 GbE take well under a second)."""
    standby_copy_s: float = 3600.0
    """How long one file of a served model's standby copy may take (tens of GB over 1 GbE take
    minutes; chunks time out on their own, ``file_chunk_s``)."""

    # --- the serving front end (serve/) -----------------------------------------------------
    generation_idle_s: float = 600.0
    """A request whose ring sends nothing for this long fails (the ring's own step timeout is
    usually shorter)."""
    ring_poll_s: float = 0.05
    """How often a serving ring client's threads check their stop flag, the step deadlines
    and the queue's waits."""
    ring_send_s: float = 10.0
    """How long a ring client's sender waits for stage 0 to take a message before failing
    its sessions."""
    retry_after_max_s: float = 60.0
    """The longest Retry-After a busy answer gives: past a minute the estimate (the mean
    session time scaled by the queue) says little, and a client polling sooner costs nothing."""
    ring_queue_s: float = 30.0
    """How long a request waits for a session slot of its ring before it fails as busy
    (HTTP 503)."""
    generation_watch_s: float = 0.25
    """How often a waiting request looks whether its client left or the server is stopping."""
    api_shutdown_s: float = 5.0
    """How long closing the API server waits for requests to finish (they are cancelled at
    once)."""
    relay_wait_s: float = 5.0
    """How long the issuing node holds a member's ``serve.relay_next`` open waiting for more of
    the response (an answer goes back at once when text arrives, so this only bounds an idle
    ask: a few per second of CPU prefill cost nothing)."""
    relay_call_s: float = 20.0
    """How long a member waits for the issuing node to answer one relay ask: the hold above
    plus a loaded daemon's round trip over CURVE."""
    relay_idle_s: float = 30.0
    """A relayed request nobody asked about for this long is cancelled on the issuing node (the
    member's client died): its sessions stop, its buffer is freed."""
    api_client_s: float = 600.0
    """How long `swarm generate`/`swarm chat` wait for the API to answer one request (a long
    generation on CPUs)."""

    # --- the CLI and its client side (cli/, client/, models.py, doctor/, demo.py) ------------
    daemon_start_s: float = 30.0
    """How long `swarm up` waits for the daemon it started to answer on its socket."""
    daemon_stop_s: float = 10.0
    """How long `swarm down` waits for the daemon to exit."""
    lan_browse_s: float = 1.5
    """How long `swarm up` on a machine with no swarm looks for swarms on the LAN."""
    no_daemon_grace_s: float = 10.0
    """How long `swarm train` keeps following a job while its daemon does not answer (a
    restart) before it exits 4."""
    register_wait_s: float = 30.0
    """How long `swarm train` waits, once its job completed, for the model to be registered."""
    serve_start_s: float = 3600.0
    """`swarm serve` waits this long for every stage to start: a stage node may first fetch
    the model's files or a trained shard (tens of GB over 1 GbE take minutes), then load. A
    stalled fetch fails sooner: every chunk has its own timeout."""
    embedded_convert_s: float = 900.0
    """How long ``ensure_embedded`` waits for the conversion subprocess (15-60 s normally; it
    may first wait for another process's conversion, ``WorkerTimings.embedded_lock_s``)."""
    doctor_skew_warn_s: float = 1.0
    """Clock skew past which log lines and metric timestamps from two nodes stop lining up."""
    doctor_worker_probe_s: float = 180.0
    """How long `swarm doctor` lets the worker interpreter import torch and report (a cold
    CUDA start takes tens of seconds)."""
    doctor_connect_s: float = 2.0
    """How long `swarm doctor` tries each peer's control port: a LAN answers in milliseconds."""
    dashboard_ticket_s: int = 60
    """How long the one-time link `swarm dashboard --open` gives the browser stays good: long
    enough for a browser to start, short enough that a link seen in ``ps`` is soon useless."""
    demo_start_s: float = 60.0
    """How long the demo's three daemons get to answer and agree on a leader."""
    demo_stop_s: float = 10.0
    """How long the demo waits for each of its daemons to stop."""
    demo_failure_timeout_s: float = 5.0
    """The demo's daemons' failure timeout: three daemons and their workers share one machine
    while models load, so a peer may be slower to answer than on a LAN of idle nodes."""

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.failure_timeout_s:
            raise ValueError(
                f"heartbeat interval {self.heartbeat_s} s must be > 0 and below the failure "
                f"timeout {self.failure_timeout_s} s"
            )
        if not self.relay_wait_s < self.relay_call_s < self.relay_idle_s:
            raise ValueError(
                f"a relay's hold ({self.relay_wait_s} s) must end before its ask times out "
                f"({self.relay_call_s} s), and that before the relay is dropped as idle "
                f"({self.relay_idle_s} s)"
            )
        if not self.serve_stage_start_s < self.serve_start_s:
            raise ValueError(
                f"a served stage's start ({self.serve_stage_start_s} s) must end before "
                f"`swarm serve` stops waiting ({self.serve_start_s} s)"
            )


TIMINGS = Timings()
"""The defaults."""
