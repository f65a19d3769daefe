"""rlbus.reward service."""
