"""``[store] request_timeout_s`` bounds a batch run's PostgreSQL calls too.

A ``tak batch worker``/``run --store``/``show --store`` talks to PostgreSQL through
its ledger and (for workers) a session store; both must take the home's deadline,
or a frozen database hangs them for the library's default instead of the user's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import kernel.batch
import kernel.batch._postgres
from kernel.cli import main


class Opened(Exception):
    pass


def _home(tmp_path: Path, timeout: float) -> Path:
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "tak.toml").write_text(f"[store]\nrequest_timeout_s = {timeout}\n")
    return home


@pytest.mark.parametrize(
    "argv",
    [
        ["batch", "worker", "--run", "r1", "--store", "postgresql://127.0.0.1:9/x"],
        ["batch", "show", "r1", "--store", "postgresql://127.0.0.1:9/x"],
    ],
    ids=["worker", "show"],
)
def test_the_ledger_takes_the_homes_request_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    seen: dict[str, Any] = {}

    def opened(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise Opened

    monkeypatch.setattr(kernel.batch, "open_postgres_ledger", opened)
    # show reads the run through kernel.batch.read_postgres_run, beside the ledger
    monkeypatch.setattr(kernel.batch._postgres, "open_postgres_ledger", opened)
    home = _home(tmp_path, 1.5)
    main(["--home", str(home), *argv])  # the fake refuses to open: the run ends there
    assert seen.get("request_timeout_s") == 1.5
