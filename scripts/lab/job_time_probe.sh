#!/usr/bin/env bash
# Where a job's measured time goes beyond its prediction, on the GPU machine: the profile,
# then jobs run as a user runs them (--stats, a lane trace), each also under cProfile
# (the host's functions by cumulative time), and decode_step.py over the 8B int4 plan.
#   bash scripts/lab/job_time_probe.sh OUTDIR
set -u
out=${1:-/tmp/probe}; mkdir -p "$out" /tmp/nvme /tmp/jobs
export PYTHONUNBUFFERED=1
py=python3
t0=$(date +%s)
echo "== profile"; timeout 120 $py -m offload.cli.profile --quick --nvme /tmp/nvme > "$out/profile.json" 2> "$out/profile.err"; echo "profile rc=$? $(( $(date +%s) - t0 )) s"; tail -3 "$out/profile.err"
prof="$out/profile.json"
$py scripts/make_prompts.py 24 /tmp/jobs/p24.jsonl --min-chars 64 --max-chars 256 --seed 1
$py scripts/make_prompts.py 423 /tmp/jobs/p423.jsonl --min-chars 64 --max-chars 256 --seed 2
run() {  # name, prompts, new tokens, flags...
  name=$1; prompts=$2; gen=$3; shift 3
  echo "== $name"; s=$(date +%s)
  timeout 100 $py -m offload.cli.run "$@" --profile "$prof" --dtype float16 --max-tokens "$gen" --ignore-eos \
    -i "$prompts" -o "/tmp/jobs/$name.out.jsonl" --restart --stats "$out/$name.stats.json" --trace "/tmp/jobs/$name.trace.json" --trace-every 50 \
    > "$out/$name.log" 2>&1; echo "rc=$? $(( $(date +%s) - s )) s"; tail -4 "$out/$name.log"
  echo "== $name (cProfile)"; s=$(date +%s)
  timeout 100 $py -m cProfile -o "/tmp/jobs/$name.prof" -m offload.cli.run "$@" --profile "$prof" --dtype float16 --max-tokens "$gen" --ignore-eos \
    -i "$prompts" -o "/tmp/jobs/$name.p.out.jsonl" --restart > /dev/null 2>&1; echo "rc=$? $(( $(date +%s) - s )) s"
  $py -c "import pstats,sys; p=pstats.Stats('/tmp/jobs/$name.prof', stream=open('$out/$name.cprofile.txt','w')); p.sort_stats('cumulative').print_stats(70); p.sort_stats('tottime').print_stats(40)"
}
run l8b-int4-24 /tmp/jobs/p24.jsonl 128 --model llama-3.1-8b --dummy --gpu-mem 8GB --compress int4 --kv-compress int4
$py -c "import json; s=json.load(open('$out/l8b-int4-24.stats.json')); json.dump(s['policy'], open('/tmp/jobs/l8b.policy.json','w'))" && \
  timeout 90 $py scripts/lab/decode_step.py --model llama-3.1-8b --policy /tmp/jobs/l8b.policy.json --compress int4 --kv-compress int4 --prompt-len 200 --out "$out" > "$out/decode_step.txt" 2>&1; tail -30 "$out/decode_step.txt"
$py -c "import json; p=json.load(open('/tmp/jobs/l8b.policy.json')); p['weights']={'gpu':1.0,'cpu':0.0,'disk':0.0}; json.dump(p, open('/tmp/jobs/l8b-gpu.policy.json','w'))" && \
  timeout 90 $py scripts/lab/decode_step.py --model llama-3.1-8b --policy /tmp/jobs/l8b-gpu.policy.json --compress int4 --kv-compress int4 --prompt-len 200 --out "$out" > "$out/decode_step_gpu.txt" 2>&1; tail -30 "$out/decode_step_gpu.txt"
cp /tmp/jobs/l8b-int4-24.trace.json "$out/" 2>/dev/null
echo "== opt67-423"; s=$(date +%s)
timeout 100 $py -m offload.cli.run --model opt-6.7b --dummy --gpu-mem 6GB --profile "$prof" --dtype float16 --max-tokens 8 --ignore-eos \
  -i /tmp/jobs/p423.jsonl -o /tmp/jobs/opt67.out.jsonl --restart --stats "$out/opt67-423.stats.json" > "$out/opt67-423.log" 2>&1; echo "rc=$? $(( $(date +%s) - s )) s"
echo "total $(( $(date +%s) - t0 )) s"
for f in "$out"/*.stats.json; do $py - "$f" <<'PY'
import json, sys
s = json.load(open(sys.argv[1])); sec = s["seconds"]; p = s.get("predicted") or {}
print(sys.argv[1].split("/")[-1], "req", s["requests"], "load", round(sec["loading"],1), "prefill", round(sec["prefill"],1),
      "decode", round(sec["decode"],1), "wall", round(sec["wall"],1), "pred_job", p.get("seconds"), "pred_gen", p.get("generate_seconds"),
      "blocks", p.get("blocks"), "policy", json.dumps(s["policy"])[:300])
PY
done
