"""One training run on Ray: everything that starts, places, watches and stops the run's processes.

Top down: `controller` (the run's life: preflight, warm start, steps, checkpoints, exit status) ->
`fleet` (starts the buffer, engines, rollout workers and the learner group, and restarts them) ->
`supervisor` (health checks, restarts) and `watchdog` (stall detection) -> `learner_group` (the FSDP
ranks as one). The Ray actors are thin: `engine_actor`, `rollout_actor`, `learner_actor`,
`critic_actor` each build one component from its own package and forward calls; no logic of their
own. `preflight` checks a config against the machine before anything starts.
"""
