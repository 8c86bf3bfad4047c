"""Loaded by every Python the tests start (tests/conftest.py puts this folder on
PYTHONPATH): the ``tak`` subprocesses see no installed ``tak.plugins`` entry points,
as the test process itself does not (tests/entry_points_kit.py says why)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import entry_points_kit
finally:
    del sys.path[0]
entry_points_kit.hide_installed_entry_points()
