"""Built-in plugins and plugin discovery (see docs/plugins.md once it exists)."""
