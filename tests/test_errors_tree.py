"""Every public exception of the project is in the one tree, drawn where it is
(kernel/errors.py's docstring), under the parent the drawing gives it."""

from __future__ import annotations

import re

import kernel.errors
from kernel.errors import KernelError
from tests.modules_kit import imported_modules

# The drawing is the block indented under "::"; a class's depth is where its name
# starts, four columns a level ("├── " or "│   " before it).
_NAME = re.compile(r"[A-Z]\w*")


def exception_classes() -> dict[str, type[BaseException]]:
    """The exception classes the project's modules define, by name, private ones left out."""
    found: dict[str, type[BaseException]] = {}
    for module in imported_modules():
        for name, value in vars(module).items():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not name.startswith("_")
            ):
                assert name not in found, f"two exceptions named {name}: the drawing is by name"
                found[name] = value
    return found


def drawn_tree() -> dict[str, str | None]:
    """Each class the drawing names, and the parent it is drawn under (``None``: the root)."""
    doc = kernel.errors.__doc__
    assert doc is not None
    block = doc.split("::\n\n", 1)[1]
    parents: dict[str, str | None] = {}
    path: list[str] = []
    for line in block.split("\n\n", 1)[0].splitlines():
        match = _NAME.search(line)
        assert match is not None and line.startswith("    "), f"not a line of the drawing: {line!r}"
        depth = (match.start() - 4) // 4
        del path[depth:]
        name = match[0]
        assert name not in parents, f"{name} is drawn twice"
        assert len(path) == depth, f"{name} is drawn under no class"
        parents[name] = path[-1] if path else None
        path.append(name)
    return parents


def test_the_drawing_is_read_as_a_tree() -> None:
    parents = drawn_tree()
    assert parents["KernelError"] is None
    assert parents["UsageError"] == "KernelError"
    assert parents["CorruptTranscript"] == "StoreError"


def test_every_public_exception_is_a_kernel_error() -> None:
    outside = sorted(
        n for n, cls in exception_classes().items() if not issubclass(cls, KernelError)
    )
    assert not outside, f"not under KernelError: {', '.join(outside)}"


def test_every_public_exception_is_drawn_under_its_parent() -> None:
    classes = exception_classes()
    parents = drawn_tree()
    undrawn = sorted(set(classes) - set(parents))
    assert not undrawn, f"not in kernel/errors.py's drawing: {', '.join(undrawn)}"
    stale = sorted(set(parents) - set(classes))
    assert not stale, f"drawn, but no such exception: {', '.join(stale)}"
    misdrawn = [
        f"{name} (drawn under {parent})"
        for name, parent in parents.items()
        if parent is not None and not issubclass(classes[name], classes[parent])
    ]
    assert not misdrawn, "not a subclass of the class drawn above it: " + ", ".join(misdrawn)
