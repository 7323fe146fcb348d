"""The rollout side: prompt sources, staleness admission control and the rollout worker."""
