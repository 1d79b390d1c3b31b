"""The node daemon (`swarm up`): membership, the replicated table, jobs, serving. No torch.

Import from the submodule that defines a name (``swarmp2p.node.daemon``, ``.api``, ...):
this package imports nothing, so the CLI's client (``node.api``, ``node.control``,
``node.job_commands``) loads none of the daemon."""
