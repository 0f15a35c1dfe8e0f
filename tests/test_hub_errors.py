"""The hub's typed errors become one line naming the repo and the fix; --revision."""

from __future__ import annotations

import huggingface_hub
import pytest
from huggingface_hub.errors import (
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from offload.cli.run import main
from offload.core.errors import UserError
from offload.models.resolve import resolve_model


def _response(status: int):
    """A response of the HTTP client this huggingface_hub raises with (httpx2 from 2.x,
    httpx in 1.x, requests before)."""
    for name in ("httpx2", "httpx"):
        try:
            http = __import__(name)
        except ImportError:
            continue
        return http.Response(status, request=http.Request("GET", "https://huggingface.co/x"))
    import requests

    response = requests.Response()
    response.status_code = status
    return response


def _hub(monkeypatch, online_error, seen=None):
    def fake(repo_id, revision=None, allow_patterns=None, local_files_only=False):
        if seen is not None:
            seen.append((repo_id, revision, local_files_only))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        raise online_error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)


@pytest.mark.parametrize(
    "error, words",
    [
        (
            GatedRepoError("gated", response=_response(403)),
            "is gated on the hub; accept its terms at https://huggingface.co/someone/model",
        ),
        (
            RepositoryNotFoundError("404", response=_response(404)),
            "is not on the hub (or is private); check the repo id",
        ),
        (
            RevisionNotFoundError("404", response=_response(404)),
            "revision 'v9' of model someone/model does not exist",
        ),
        (
            LocalEntryNotFoundError("offline"),
            "hub cannot be reached (offline); download it on a connected machine (hf download someone/model)",
        ),
    ],
)
def test_typed_hub_errors_name_the_repo_and_the_fix(monkeypatch, error, words):
    seen = []
    _hub(monkeypatch, error, seen)
    with pytest.raises(UserError) as info:
        resolve_model("someone/model", revision="v9")
    assert words in str(info.value) and "\n" not in str(info.value)
    assert seen == [("someone/model", "v9", True), ("someone/model", "v9", False)]


def test_revision_flag_reaches_the_hub_and_errors_are_one_line(monkeypatch, capsys):
    seen = []
    _hub(monkeypatch, RevisionNotFoundError("404", response=_response(404)), seen)
    assert main(["--model", "someone/model", "--revision", "nope", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("offload-run: error: revision 'nope'")
    assert seen[-1] == ("someone/model", "nope", False)
