"""`swarm serve` on the daemon: the served model, the issuing node's ring, every node's stages, standby copies, model files. No torch."""
