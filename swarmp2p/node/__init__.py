"""The node daemon (`swarm up`): membership, election, the job table, workers. No torch."""
