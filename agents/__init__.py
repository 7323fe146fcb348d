"""Built-in agents, registered through the asyncrl.plugins entry point."""
