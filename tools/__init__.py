"""Built-in tools, registered through the asyncrl.plugins entry point."""
