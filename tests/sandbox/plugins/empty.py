"""A plugin without tools."""

VALUE = 1
