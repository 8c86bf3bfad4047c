"""tak.toml as a ``Config`` record: read once, every setting checked, errors point into the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel import UsageError, open_kernel
from kernel.home import Config, SandboxConfig, StoreConfig, TakHome, WorkspaceConfig
from tests.cli_kit import one_line, tak

FILE = "/h/tak.toml"


def home_with(tmp_path: Path, toml: str) -> TakHome:
    home = TakHome(tmp_path).ensure()
    home.config_file.write_text(toml)
    return home


def test_no_file_is_the_defaults(tmp_path: Path) -> None:
    assert TakHome(tmp_path).read_config() == Config()
    assert Config().to_toml() == {}  # a setting at its default is left out


def test_every_section_is_read_into_its_record(tmp_path: Path) -> None:
    home = home_with(
        tmp_path,
        "[sandbox]\nallow_unsandboxed = true\n"
        '[store]\nurl = "postgresql://tak@db/tak"\n'
        "[workspace]\nmax_bytes = 1000\n"
        '[plugins.web]\nallow_hosts = ["example.org"]\n',
    )
    config = home.read_config()
    assert config == Config(
        sandbox=SandboxConfig(allow_unsandboxed=True),
        store=StoreConfig(url="postgresql://tak@db/tak"),
        workspace=WorkspaceConfig(max_bytes=1000),
        plugins={"web": {"allow_hosts": ["example.org"]}},
    )
    # What code that takes the parsed mapping is given: the file as it was.
    assert config.to_toml() == home.load_config()
    overridden = config.with_plugin_settings({"web": {"allow_hosts": []}, "notes": {}})
    assert overridden.plugins == {"web": {"allow_hosts": []}, "notes": {}}


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (
            {"sandbox": {"allow_unsandboxed": "yes"}},
            '$.sandbox.allow_unsandboxed: expected a boolean, got "yes"',
        ),
        ({"sandbox": "on"}, '$.sandbox: expected a table, got "on"'),
        (
            {"sandox": {}},
            "$: unknown setting 'sandox' (known: sandbox, store, workspace, model, mcp, plugins, budget)",
        ),
        (
            {"sandbox": {"allow": True}},
            "$.sandbox: unknown setting 'allow' (known: allow_unsandboxed)",
        ),
        ({"store": {"url": 5}}, "$.store.url: expected a string, got 5"),
        (
            {"store": {"url": "mysql://root:secret@db/x"}},
            '$.store.url: expected a postgresql:// URL, got "mysql://..."',  # no password
        ),
        (
            {"store": {"path": "x"}},
            "$.store: unknown setting 'path' (known: url, request_timeout_s)",
        ),
        (
            {"workspace": {"max_bytes": 0}},
            "$.workspace.max_bytes: expected a positive whole number of bytes, got 0",
        ),
        (
            {"workspace": {"max_bytes": 1.5}},
            "$.workspace.max_bytes: expected a whole number, got 1.5",
        ),
        (
            {"workspace": {"max_bytes": True}},
            "$.workspace.max_bytes: expected a whole number, got true",
        ),
        ({"plugins": {"web": 3}}, "$.plugins['web']: expected a table, got 3"),
        ({"plugins": "web"}, "$.plugins: expected a table"),
    ],
)
def test_a_wrong_setting_is_one_line_naming_the_file_and_its_path(
    data: dict[str, object], error: str
) -> None:
    with pytest.raises(UsageError) as caught:
        Config.from_toml(data, source=FILE)
    assert str(caught.value) == f"{FILE}: {error}"


def test_every_wrong_setting_is_named(tmp_path: Path) -> None:
    home = home_with(
        tmp_path, '[sandbox]\nallow_unsandboxed = "yes"\n[workspace]\nmax_bytes = -1\n'
    )
    with pytest.raises(UsageError) as caught:
        home.read_config()
    assert str(caught.value) == (
        f'{home.config_file}: $.sandbox.allow_unsandboxed: expected a boolean, got "yes"; '
        "$.workspace.max_bytes: expected a positive whole number of bytes, got -1"
    )


def test_not_toml_names_the_file_and_line(tmp_path: Path) -> None:
    home = home_with(tmp_path, "[sandbox\n")
    with pytest.raises(UsageError, match=rf"^{home.config_file}: .*line 1"):
        home.read_config()


def test_records_made_in_code_are_checked_too() -> None:
    with pytest.raises(UsageError, match=r"^WorkspaceConfig.max_bytes: expected a positive"):
        WorkspaceConfig(max_bytes=0)
    with pytest.raises(UsageError, match=r"^StoreConfig.url: expected a postgresql:// URL"):
        StoreConfig(url="sqlite:///x")


async def test_open_kernel_refuses_a_wrong_setting_at_start(tmp_path: Path) -> None:
    home_with(tmp_path, "[sandbox]\nallow_unsandboxed = 1\n")
    with pytest.raises(UsageError, match=r"\$\.sandbox\.allow_unsandboxed: expected a boolean"):
        async with open_kernel(home=tmp_path, plugins=[]):
            pass


async def test_the_kernel_holds_the_settings_in_force(tmp_path: Path) -> None:
    home_with(tmp_path, "[sandbox]\nallow_unsandboxed = true\n[plugins.web]\nallow_hosts = []\n")
    async with open_kernel(
        home=tmp_path, plugins=[], plugin_config={"notes": {"x": 1}}, allow_unsandboxed=False
    ) as k:
        assert k.config.sandbox.allow_unsandboxed is False
        assert k.config.plugins == {"web": {"allow_hosts": []}, "notes": {"x": 1}}
        assert k.plugins.plugin_config("notes") == {"x": 1}


def test_budget_providers_are_resolve_models_but_scripted() -> None:
    from kernel.home import BUDGET_PROVIDERS
    from kernel.models._resolve import PROVIDERS

    assert set(BUDGET_PROVIDERS) == set(PROVIDERS) - {"scripted"}


async def test_each_part_is_given_its_typed_section(tmp_path: Path) -> None:
    """The store and the plugin host take the checked record's sections; the mapping
    they took before is checked as tak.toml is, with the same one-line errors."""
    from kernel.store import FileStore, PostgresStore, open_store
    from plugins import open_plugin_host

    home = TakHome(tmp_path / "home").ensure()
    url = "postgresql://tak@db.example/tak"
    store = open_store(home, StoreConfig(url=url, request_timeout_s=4.5))
    assert isinstance(store, PostgresStore) and store._request_timeout_s == 4.5
    assert isinstance(open_store(home, Config().store), FileStore)
    assert isinstance(open_store(home), FileStore)  # None: the home's own tak.toml
    with pytest.raises(UsageError, match=r"tak.toml: \$.store.request_timeout_s: expected"):
        open_store(home, {"store": {"url": url, "request_timeout_s": 0}})

    workspace = tmp_path / "w"
    workspace.mkdir()
    config = Config(workspace=WorkspaceConfig(max_bytes=12345), plugins={"fs": {"x": 1}})
    async with open_plugin_host(workspace, plugins=["fs"], config=config, home=home) as host:
        assert host.workspace.max_bytes == 12345
        assert host.plugin_config("fs") == {"x": 1}
        host.configure_plugin("fs", {"x": 2})
        assert host.plugin_config("fs") == {"x": 2} and host.config.plugins["fs"] == {"x": 2}
    with pytest.raises(UsageError, match=r"\$.workspace.max_bytes: expected"):
        async with open_plugin_host(workspace, plugins=[], config={"workspace": {"max_bytes": 0}}):
            pass


def test_no_source_turns_the_checked_config_back_into_a_mapping() -> None:
    root = Path(__file__).resolve().parents[1]
    callers = [
        str(path.relative_to(root))
        for package in ("kernel", "plugins", "sandbox")
        for path in (root / package).rglob("*.py")
        if ".to_toml()" in path.read_text()
    ]
    assert callers == []


@pytest.mark.parametrize(
    ("section", "value", "read"),
    [
        ("workspace", {"max_bytes": 0}, "workspace_max_bytes"),
        ("workspace", {"max_files": True}, "workspace_max_files"),
        ("store", {"url": "sqlite:///x"}, "store_url"),
        ("store", {"request_timeout_s": "5"}, "store_request_timeout_s"),
        ("store", {"colour": 1}, "store_url"),
    ],
    ids=["max_bytes", "max_files", "url", "request_timeout_s", "unknown"],
)
def test_the_older_readers_are_held_to_configs_rule(
    section: str, value: object, read: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rule, one wording: a reader of the parsed mapping refuses what ``Config``
    refuses, saying it the same way."""
    import kernel.home

    monkeypatch.delenv("TAK_STORE_URL", raising=False)
    data = {section: value}
    with pytest.raises(UsageError) as checked:
        Config.from_toml(data, source=FILE)
    with pytest.raises(UsageError) as older:
        getattr(kernel.home, read)(data, FILE)
    assert str(older.value) == str(checked.value)


def write_config(home: Path, text: str) -> None:
    (home / "config").mkdir(parents=True, exist_ok=True)
    (home / "config" / "tak.toml").write_text(text)


BUDGET_TYPO = "[budget.openai]\nmax_connections = 50\nrequests_per_minut = 500\n"


def test_a_budget_typo_is_refused_by_tak_run_in_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_config(home, BUDGET_TYPO)
    ran = tak("--plugin", "demo", "run", "hi", "--model", "scripted:demo", home=home)
    assert ran.returncode == 2
    assert "requests_per_minut" in one_line(ran)


@pytest.mark.parametrize("command", [["tools"], ["mcp", "ls"], ["call", "echo", '{"text": "x"}']])
def test_a_budget_typo_is_refused_where_other_tak_toml_typos_are(
    tmp_path: Path, command: list[str]
) -> None:
    home = tmp_path / "home"
    write_config(home, "[model.settings]\ntemperatur = 1\n")
    assert tak("--plugin", "demo", *command, home=home).returncode == 2  # as every other typo
    write_config(home, BUDGET_TYPO)
    refused = tak("--plugin", "demo", *command, home=home)
    assert refused.returncode == 2
    assert "requests_per_minut" in one_line(refused)


def test_a_bad_budget_value_says_what_tak_toml_can_hold(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_config(home, "[budget.openai]\nmax_connections = 0\n")
    ran = tak("--plugin", "demo", "run", "hi", "--model", "scripted:demo", home=home)
    assert ran.returncode == 2
    line = one_line(ran)
    assert "max_connections" in line
    assert "none" not in line
