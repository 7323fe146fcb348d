"""The data that crosses processes: dataset rows in verl's schema (`rows`), datasets read a block at a
time (`dataset`), the wire schema of trajectories, groups and batches (`schema`), training group ids
(`group_ids`) and the typed run state shared by the controller, learner and rollout workers
(`job_state`). Nothing here imports anything of asyncrl above `util`."""
