"""The replicated job table: its events, the pure apply, the registry and its replication across the members. No torch."""
