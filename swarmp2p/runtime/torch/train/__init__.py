"""Training a stage: its bundle, the steps of the schedule, the boundary and its compressors, half precision, loss, evaluation, snapshots and re-slicing, export, the worker's runner."""
