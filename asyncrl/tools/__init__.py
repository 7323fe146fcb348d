"""Tools: the `Tool` interface and argument checks (`base`), the loader of tool configs in verl's YAML
shape (`loader`), and the built-in tools beside them (`calculator`, `python`, `search`; registered by
`builtin`, through the `asyncrl.plugins` entry point like a user's)."""
