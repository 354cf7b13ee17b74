"""``python -m rollout_watchdog.emulator``."""

from rollout_watchdog.emulator import main

if __name__ == "__main__":  # the spawn start method may import this module in the child
    raise SystemExit(main())
