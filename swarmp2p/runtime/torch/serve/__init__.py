"""Serving a stage: the stage server, its sessions' cache, prefill queue, sampling, and a trained stage served in place."""
