"""rlbus: RL post-training for LLMs as independent services over NATS."""

__version__ = "0.1.0"
