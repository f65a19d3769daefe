"""rlbus.rollout service."""
