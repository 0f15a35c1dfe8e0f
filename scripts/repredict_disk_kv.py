"""The disk-KV validation runs re-predicted under three rules for a layer's time.

    python scripts/repredict_disk_kv.py [--out benchmarks/results]

Every `validate_cost_model_*.json` run of a policy with KV rows on disk and attention
on the GPU, and weights off the disk, whose profile has the graph-path chain figures (`disk_kv_graph_s`, the
executor since the eleventh session) is predicted again with the committed model and
its own call's profile. A layer takes:
- max: the busiest lane (h2d, disk, compute, host), the model before c111;
- sum: the disk lane after the compute lane (each layer's disk-home chain serial with
  its compute), the model since (`cost.estimate`);
- chain on compute: the disk homes' chains on the compute lane, their bytes on the disk
  lane.
Prints measured against each rule's prediction and writes the table as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import time
from pathlib import Path

import torch

from offload.models.resolve import resolve_model
from offload.policies.cost import _offgpu_chain_s, estimate
from offload.policies.hardware import HardwareProfile
from offload.policies.memory import micro_batch_sizes, row_splits
from offload.policies.policy import Policy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    fields = {f.name for f in dataclasses.fields(HardwareProfile)}
    rows = []
    for path in sorted(glob.glob(str(args.out / "validate_cost_model_*.json"))):
        res = json.loads(Path(path).read_text())
        prof = res.get("profile")
        if not prof or "disk_kv_graph_s" not in prof:
            continue
        hw = HardwareProfile(**{k: v for k, v in prof.items() if k in fields})
        cfg = resolve_model(res["model"], dummy=True).config
        for name, run in res["runs"].items():
            pol = run.get("policy")
            if not pol or "measured" not in run or not pol["kv_cache"].get("disk"):
                continue
            if pol["attention_on_cpu"] or pol["weights"].get("disk"):
                continue  # (the disk lane is then the KV homes' alone)
            policy = Policy.from_dict(pol)
            gen = run.get("gen_len") or 32
            est = estimate(cfg, policy, torch.float16, 512, gen, hw)
            layers = cfg.num_layers
            lane = {k: v / layers for k, v in est.lanes_decode_s.items()}
            splits = row_splits(policy.kv_cache, micro_batch_sizes(policy, policy.block_size))
            homes = sum(1 for _, _, d in splits if d)
            chain = homes * _offgpu_chain_s(policy, hw, 1, disk=True)
            # the committed rule (`cost.estimate`): the disk homes' chain after the compute
            committed = max(lane["h2d"], lane["disk"], lane["compute"] + lane["disk"], lane["host"])
            rules = {
                "max": max(lane["h2d"], lane["disk"], lane["compute"], lane["host"]),
                "sum": max(lane["h2d"], lane["disk"] + lane["compute"], lane["host"]),
                "chain on compute": max(
                    lane["h2d"], lane["disk"] - chain, lane["compute"] + chain, lane["host"]
                ),
            }
            measured = run["measured"]["total_tok_s"]
            errors = {}
            for rule, layer in rules.items():
                step = est.decode_step_s + layers * (layer - committed)
                tok_s = policy.block_size * gen / (est.prefill_s + (gen - 1) * step)
                errors[rule] = measured / tok_s - 1
            rows.append(
                {
                    "file": Path(path).name,
                    "model": res["model"],
                    "policy": name,
                    "measured_tok_s": measured,
                    "measured_step_ms": run["measured"]["decode_step_s"] * 1e3,
                    "lanes_ms_a_layer": {k: v * 1e3 for k, v in lane.items()},
                    "chain_ms_a_layer": chain * 1e3,
                    "error": errors,
                }
            )
    for row in rows:
        errs = "  ".join(f"{rule} {e * 100:+5.0f}%" for rule, e in row["error"].items())
        print(f"{row['file'][20:35]} {row['model']:13s} {row['policy'][:31]:31s} {errs}")
    for rule in ("max", "sum", "chain on compute"):
        mean = sum(abs(r["error"][rule]) for r in rows) / max(len(rows), 1)
        print(f"mean |error| {rule}: {mean * 100:.1f}% over {len(rows)} runs")
    stamp = time.strftime("%Y%m%d-%H%M")
    (args.out / f"diskkv_rules_repredicted_{stamp}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
