"""The plugin's tools, run as tak runs them: through the executor, in a sandbox worker."""

from __future__ import annotations

from pathlib import Path

from hello_plugin import plugin

from kernel.testing import plugin_harness


async def test_greet(tmp_path: Path) -> None:
    async with plugin_harness(plugin, tmp_path) as h:
        observation = await h.call("greet", {"name": "Ada", "times": 2})
    assert observation.content == "Hello, Ada! Hello, Ada!"


async def test_bad_arguments_are_an_observation(tmp_path: Path) -> None:
    async with plugin_harness(plugin, tmp_path) as h:
        observation = await h.call("greet", {"name": 3})
    assert observation.error is not None and observation.error.kind == "bad_arguments"


async def test_word_count_reads_the_workspace(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("one two three\nfour\n")
    async with plugin_harness(plugin, tmp_path) as h:
        words, lines, missing = await h.call_many(
            [
                ("word_count", {"path": "notes.txt"}),
                ("word_count", {"path": "notes.txt", "unit": "lines"}),
                ("word_count", {"path": "nope.txt"}),
            ]
        )
    assert words.content == '{"path": "notes.txt", "words": 4}'
    assert lines.content == '{"path": "notes.txt", "lines": 2}'
    assert missing.is_error and "no such file" in missing.content


async def test_the_workspace_is_read_only_for_this_plugin(tmp_path: Path) -> None:
    async with plugin_harness(plugin, tmp_path) as h:
        assert h.plugin.permissions.workspace == "read"
        assert "worker" in h.plugin.isolation
