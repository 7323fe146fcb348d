"""A model used outside a training run, through the agent loops: one engine on a checkpoint, a run
directory or a Hugging Face directory (`session.py`, `checkpoints.py`), and the scores as pure
functions (`scores.py`). The commands built on it are asyncrl/commands/eval.py (`asyncrl eval`) and
asyncrl/commands/generate.py (`asyncrl generate`)."""
