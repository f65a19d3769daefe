"""rlbus.learner service."""
