"""rlbus.ref service."""
