"""The node watchdog: launches, probes, kills, restarts and adopts the engines of one node."""
