"""Built-in envs, registered through the asyncrl.plugins entry point."""
