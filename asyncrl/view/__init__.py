"""Browsing a run's trajectories: `records.py` reads and filters them (pure), `app.py` is the Textual
UI; the command is asyncrl/commands/view.py (`asyncrl view RUN_DIR`)."""
