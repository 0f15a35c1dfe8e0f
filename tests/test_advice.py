"""The mission's command typed as it is: the int4 formats weighed among what would help,
warned about before a load where they are 3x faster, named in a refusal for want of
disk (CPU, invented profile)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from offload.cli.plan import main as plan_main
from offload.io.layout import store_bytes
from offload.policies.advice import INT4, WARN_SPEEDUP, format_hint
from offload.policies.caps import Caps
from offload.policies.search import search
from tests.test_policies import PROFILE, cfg_of

GB = 10**9
F16 = torch.float16
NONE = (None,)


def _hint(name: str, caps: Caps):
    cfg = cfg_of(name)
    best = search(cfg, F16, 512, 32, PROFILE, caps)
    return best, format_hint(cfg, F16, 512, 32, PROFILE, caps, best, NONE, NONE)


def test_the_formats_are_urged_for_a_disk_bound_plan_and_not_for_one_bound_by_pcie():
    """BLOOM in float16 at 24 GB of GPU and 100 GB of CPU streams most weights from
    disk: int4 weights and KV fit in memory, far more than 3x faster. Llama-2-70B at 24
    GB and 200 GB streams float16 weights over PCIe: int4 is faster, not 3x."""
    disk_bound, urged = _hint("bloom", Caps(24 * GB, 100 * GB, True))
    assert disk_bound.bottleneck == "disk"
    assert urged is not None and urged.speedup >= WARN_SPEEDUP
    assert urged.flags == "--compress int4 --kv-compress int4"
    assert urged.text().endswith("outputs change slightly, see docs/compression.md")
    pcie_bound, weighed = _hint("llama-2-70b", Caps(24 * GB, 200 * GB, False))
    assert pcie_bound.bottleneck == "h2d"
    assert weighed is not None and 1 < weighed.speedup < WARN_SPEEDUP
    # flags that allow int4 already are advised only on what they leave out
    cfg, caps = cfg_of("bloom"), Caps(24 * GB, 100 * GB, True)
    allowed = format_hint(cfg, F16, 512, 32, PROFILE, caps, disk_bound, (INT4,), (INT4,))
    assert allowed is None
    weights_only = format_hint(cfg, F16, 512, 32, PROFILE, caps, disk_bound, (INT4,), NONE)
    assert weights_only is None or weights_only.flags == "--kv-compress int4"


def test_offload_plan_weighs_the_formats_among_what_would_help(tmp_path, capsys):
    profile = tmp_path / "hw.json"  # a machine of 256 GB (offload-plan plans for the profile's)
    profile.write_text(dataclasses.replace(PROFILE, cpu_mem_bytes=256 * GB).to_json())
    argv = ["--model", "llama-2-70b", "--gpu-mem", "24GB", "--cpu-mem", "200GB"]
    assert plan_main([*argv, "--dtype", "float16", "--profile", str(profile)]) == 0
    out = capsys.readouterr().out
    helps = next(line for line in out.splitlines() if line.startswith("what would help:"))
    assert "--compress int4 --kv-compress int4 -> " in helps and "see docs/compression.md" in helps
    assert "prompt 512 (tokens are UTF-8 bytes: the model ships no tokenizer)" in out


def test_a_store_larger_than_the_free_disk_is_a_problem_named_with_the_formats(tmp_path, capsys):
    """The mission's command as typed (on the invented machine): BLOOM's float16 weight
    store does not fit the directory's free space: offload-plan refuses it as offload-run
    does before its load, in the same words, naming the int4 formats."""
    need = store_bytes(cfg_of("bloom"), F16, None)
    if shutil.disk_usage(tmp_path).free > need:
        pytest.skip("this disk holds BLOOM's whole float16 store")
    profile = tmp_path / "hw.json"
    profile.write_text(PROFILE.to_json())
    argv = ["--model", "bigscience/bloom", "--gpu-mem", "24GB", "--nvme", str(tmp_path / "nvme")]
    assert plan_main([*argv, "--dtype", "float16", "--profile", str(profile)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("offload-plan: error: ")
    assert "free space or choose another --nvme directory; or --compress int4" in err
    assert err.endswith("see docs/compression.md")
