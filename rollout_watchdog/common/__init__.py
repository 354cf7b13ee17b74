"""What several layers share, and what depends on none of them: the wire protocol (`protocol`, whose
docstring is the spec), engine states and causes (`states`), the API's errors (`errors`), the
clock, events and deferred replies of the node's core (`clock`, `events`, `replies`), CURVE keys
(`keys`), process limits (`limits`), input validation (`validate`), the command registry with
declared arguments (`commands`), and the weight-update group's construction that the emulator
and the refit bridge both use (`torch_group`).

Nothing here imports another package of `rollout_watchdog` (CI checks it: `lint-imports`).
"""
