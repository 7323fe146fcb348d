"""`asyncrl view RUN_DIR`: browse a run's trajectories (records.py reads and filters, app.py is the Textual UI)."""
