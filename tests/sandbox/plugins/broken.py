"""A plugin whose import fails."""

raise RuntimeError("this plugin cannot be imported")
