"""rollout-watchdog: keeps the SGLang engines of an RL rollout fleet alive."""

__version__ = "0.1.0"
