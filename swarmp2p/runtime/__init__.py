"""Stage runtimes, resolved by name; importing this package imports no framework."""
