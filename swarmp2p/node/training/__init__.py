"""Training jobs on the daemon: the job records, the leader's side, every node's stages, inputs, corpus and metrics. No torch."""
