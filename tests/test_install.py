"""What a new user's install gets: the README's commands are the ones CI runs, and the
package works with exactly what the first command installs (no triton: the CPU torch
wheel does not bring it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from offload.api.llm import LLM
from offload.core.sampling import SamplingParams
from offload.kernels.formats import Compression
from offload.policies.policy import Placement, Policy

ROOT = Path(__file__).resolve().parent.parent
INT4 = Compression(bits=4, group_size=16)
POLICY = Policy(
    gpu_batch_size=2,
    num_gpu_batches=2,
    weights=Placement(0.3, 0.4, 0.3),
    kv_cache=Placement(0.5, 0.5, 0),
    weight_compression=INT4,
    kv_compression=INT4,
)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [20, 21, 22]]

# Run in a child with triton made unimportable, as on a fresh `pip install -e .`
_NO_TRITON = """
import json, sys
sys.modules["triton"] = None  # `import triton` now raises ImportError
from pathlib import Path
from tests.test_install import generate
print(json.dumps(generate(Path(sys.argv[1]), Path(sys.argv[2]))))
"""


def generate(checkpoint: Path, nvme: Path) -> dict[str, list[list[int]]]:
    """Greedy tokens of the plain run and of a compressed, three-tier offloaded run."""
    out = {}
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    for name, policy, folder in (("plain", None, None), ("int4-offloaded", POLICY, nvme)):
        with LLM(str(checkpoint), policy=policy, offload_folder=folder) as llm:
            outs = llm.generate(prompts, SamplingParams(max_tokens=6))
            out[name] = [o.outputs[0].token_ids for o in outs]
    return out


def test_package_runs_without_triton(tiny_checkpoints, tmp_path):
    checkpoint = tiny_checkpoints["llama-gqa"][0]
    child = subprocess.run(
        [sys.executable, "-c", _NO_TRITON, str(checkpoint), str(tmp_path / "child")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    without = json.loads(child.stdout.strip().splitlines()[-1])
    assert without == generate(checkpoint, tmp_path / "parent")


def _quickstart_commands() -> list[str]:
    """The shell lines of the README's quickstart code blocks."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    lines = [ln.strip() for block in blocks for ln in block.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def test_ci_runs_the_readme_quickstart_verbatim():
    commands = _quickstart_commands()
    assert len(commands) == 2, commands
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in commands:
        assert any(ln.startswith(command) for ln in ci), f"{command!r} is not in .ci/run"
    # CI makes a new virtual environment before them (today's newest allowed versions)
    assert any(ln.startswith("python3 -m venv") for ln in ci)


def test_a_wheel_ships_the_c_kernels_sources(tmp_path):
    """The C kernels' sources are package data (`native.source` reads them beside
    `native.py`): an editable install finds them in the tree, and a wheel holds them."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "offload", src / "offload", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("offload-*.whl")
    sources = {f"offload/kernels/{c.name}" for c in (ROOT / "offload" / "kernels").glob("*.c")}
    assert sources, "no C kernel sources in offload/kernels"
    missing = sources - set(zipfile.ZipFile(wheel).namelist())
    assert not missing, f"the wheel lacks {sorted(missing)}"
