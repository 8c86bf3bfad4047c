"""``tak plugins new NAME``: a pip-installable plugin package with a test.

::

    NAME/
      pyproject.toml        the ``tak.plugins`` entry point: NAME = "<package>:plugin"
      README.md
      <package>/__init__.py ``plugin = Plugin("NAME", ...)`` and one typed tool
      tests/test_<package>.py  runs the tool through ``kernel.testing.plugin_harness``
"""

from __future__ import annotations

import keyword
import re
from pathlib import Path

from kernel.errors import UsageError

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")

_PYPROJECT = """\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "A tak plugin: {name}"
requires-python = ">=3.11"
dependencies = ["trio-agent-kernel"]

# How tak finds the plugin once the package is installed.
[project.entry-points."tak.plugins"]
{name} = "{package}:plugin"

[tool.setuptools]
packages = ["{package}"]

[tool.pytest.ini_options]
trio_mode = true
"""

_MODULE = '''\
"""The {name} plugin for tak."""

from __future__ import annotations

from kernel import Plugin, context

# Permissions: what the sandbox lets the tools do. The default is reading the
# workspace; add {{"workspace": "write"}}, {{"network": ["host:443"]}} or
# {{"subprocess": True}} when a tool needs it.
plugin = Plugin("{name}", version="0.1.0", description="Greets people.")


@plugin.tool
def greet(name: str, times: int = 1) -> str:
    """Greet someone.

    Args:
        name: Who to greet.
        times: How many times, 1 to 10.
    """
    context().logger.info("greeting %s", name)
    return " ".join([f"Hello, {{name}}!"] * max(1, min(times, 10)))
'''

_TEST = '''\
"""The plugin's tools, run as tak runs them: through the executor, in a sandbox worker."""

from __future__ import annotations

from pathlib import Path

from kernel.testing import plugin_harness

from {package} import plugin


async def test_greet(tmp_path: Path) -> None:
    async with plugin_harness(plugin, tmp_path) as h:
        observation = await h.call("greet", {{"name": "Ada", "times": 2}})
    assert observation.content == "Hello, Ada! Hello, Ada!"


async def test_bad_arguments_are_an_observation(tmp_path: Path) -> None:
    async with plugin_harness(plugin, tmp_path) as h:
        observation = await h.call("greet", {{"name": 3}})
    assert observation.error is not None and observation.error.kind == "bad_arguments"
'''

_README = """\
# {name}

A plugin for `tak`, the trio-agent-kernel.

With the Python that runs `tak` (in a tak checkout: `.venv/bin/python`, and `tak`
is `.venv/bin/tak`):

```sh
python -m pip install -e .   # registers the `tak.plugins` entry point
tak plugins trust {name}     # approve it: its code hash and permissions, under $TAK_HOME/config
tak plugins ls               # {name} is listed with its tools
tak call greet '{{"name": "Ada"}}'
python -m pytest             # tests/ run the tools in a real sandbox worker
```

Add tools in `{package}/__init__.py` with `@plugin.tool`; type hints become
the JSON Schema the model sees, the docstring its description. See
docs/plugins.md in the tak repository.
"""


def package_name(name: str) -> str:
    """The importable package a plugin called ``name`` lives in."""
    package = name.replace("-", "_").lower()
    return f"{package}_plugin" if keyword.iskeyword(package) else package


def scaffold_plugin(name: str, directory: Path) -> list[Path]:
    """Write a new plugin package for ``name`` into ``directory``; return the files.

    Raises:
        UsageError: a bad name, or ``directory`` exists and is not empty.
    """
    if not _NAME.fullmatch(name):
        raise UsageError(
            f"plugin name {name!r}: start with a letter; letters, digits, '_' and '-' only"
        )
    if directory.exists() and any(directory.iterdir()):
        raise UsageError(f"{directory} already exists and is not empty")
    package = package_name(name)
    fields = {"name": name, "package": package, "dist": name.replace("_", "-")}
    files = {
        "pyproject.toml": _PYPROJECT,
        "README.md": _README,
        f"{package}/__init__.py": _MODULE,
        f"tests/test_{package}.py": _TEST,
    }
    written = []
    for relative, template in files.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**fields))
        written.append(path)
    return written
