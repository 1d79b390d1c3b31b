"""The shared planner: pure functions over plain data, standard library only."""
