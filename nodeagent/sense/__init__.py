"""Sensors: read the kernel's state into frozen snapshots. All I/O of a tick's input is here."""
