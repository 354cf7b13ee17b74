"""The driver side (DESIGN.md, "Refit bridge"): the coordinator and the client.

The coordinator (`coordinator`, wiring the agent's hub to `fleet`, the fleet view, and `service`,
the refit lock, weight versions and router gating); the driver's client (`client`, `stream`,
`views`: `FleetClient`, which the package root exports; `keyed_client`, one that carries
its CURVE keys for Ray) and its refit (`refit`, with its state
in `refit_state` and its guard thread in `refit_watch`; `group`, `engine_calls`).
"""
