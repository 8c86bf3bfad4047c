"""Workspace confinement: confined paths, Landlock/seccomp, worker processes."""
