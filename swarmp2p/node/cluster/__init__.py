"""Who is in the swarm: membership, election, hellos, heartbeats, joining, pairing, who may ask what. No torch."""
