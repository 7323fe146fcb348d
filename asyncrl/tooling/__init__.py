"""The tool framework: the `Tool` interface and argument checks (`base`), and the loader of tool
configs in verl's YAML shape (`loader`). The concrete tools are plugins in `asyncrl.tools`."""
