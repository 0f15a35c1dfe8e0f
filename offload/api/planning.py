"""`plan_run`: the policy a run will use, and the proof that it fits, before any load.

    --policy FILE, or the plan search (caps or --nvme), or none (one device, no
    offloading) -> the weights fit the caps -> a full block of the planned prompt and
    generation lengths fits the caps

Every step needs only the model's config (`ModelFront`), never its weights, so a plan
that cannot run is refused in seconds, not after a long load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from offload.api.args import EngineArgs, compression_text, resolve_device
from offload.api.front import ModelFront
from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.kernels.formats import Compression
from offload.parallel.shard import rank_config
from offload.policies import paths
from offload.policies.caps import (
    Baseline,
    Caps,
    check_block_fits,
    check_caps_within_machine,
    check_weights_fit,
    cpu_only_caps,
)
from offload.policies.hardware import HardwareProfile
from offload.policies.job import Job, JobEstimate
from offload.policies.node import Layout
from offload.policies.policy import Policy

if TYPE_CHECKING:
    from offload.parallel.comm import TensorParallel

log = logging.getLogger(__name__)

# generation tokens a plan is sized for when neither the caller nor the model says
PLAN_GEN_LEN = 256
VERIFY_TOP = 3  # plans --verify-plan probes


@dataclass(frozen=True)
class Plan:
    """Where a run's weights and KV cache live (None: one device, no offloading), the
    caps and baseline it was checked against, and the lengths it was sized for."""

    policy: Policy | None
    caps: Caps
    baseline: Baseline
    batch_size: int
    prompt_len: int
    gen_len: int
    # the job's predicted wall time (`policies.job`), where a job was given and a
    # hardware profile is known
    prediction: JobEstimate | None = None


def plan_run(
    front: ModelFront,
    args: EngineArgs,
    policy: Policy | None = None,
    gen_len: int | None = None,
    layout: Layout | None = None,
    job: Job | None = None,
) -> Plan:
    """The run's plan for prompts of `args.planned_prompt_len` tokens and `gen_len` new
    tokens; `UserError` when it cannot fit. policy: one chosen already; layout: this
    process is one rank of a parallel job on this node (its caps are a rank's): the plan
    is rank 0's shard's (the largest), searched with the rank's share of the node;
    job: the requests it runs (the search plans for them, and their time is predicted)."""
    cfg = front.config if layout is None else rank_config(front.config, layout.tp, 0)
    if layout is not None and layout.dp > 1 and job is not None:  # group 0's requests
        job = Job(job.prompt_lens[:: layout.dp], job.gen_lens[:: layout.dp])
    prompt_len = args.planned_prompt_len
    gen_len = gen_len or front.get_default_sampling_params().max_tokens or PLAN_GEN_LEN
    if args.policy is not None:
        policy = Policy.from_file(args.policy)
    weight_formats = checkpoint_formats(front, args, policy, layout is not None and layout.tp > 1)
    if policy is None and not args.wants_search:
        _refuse_compression_without_a_plan(args)
    shared = layout.dp if layout is not None else 1
    caps = Caps(args.gpu_bytes, args.cpu_bytes, args.nvme is not None, shared_weights=shared)
    check_caps_within_machine(caps, front.device)
    if front.device.type == "cpu" and caps.gpu_bytes is None and caps.cpu_bytes is not None:
        # one memory: the device's and the host's tiers share the CPU cap
        split = cpu_only_caps(caps.cpu_bytes, Baseline.measure(front.device))
        caps = Caps(*split, nvme=caps.nvme, shared_weights=shared)
    # what the process holds before any weights: the baseline of the one accounting,
    # which the search counts too
    baseline = Baseline.measure(front.device)
    hw = None
    if policy is None and args.wants_search:
        policy, hw = _search(
            front, args, (caps, baseline), cfg, (prompt_len, gen_len), weight_formats,
            layout or Layout(), job,
        )  # fmt: skip
    if layout is not None and policy is None:
        policy = Policy(gpu_batch_size=args.batch_size, num_gpu_batches=1)
    if policy is not None:
        if (ruled_out := paths.ruled_out(cfg, policy)) is not None:
            raise UserError(f"{cfg.model_type} cannot run {ruled_out}; change the policy")
        check_weights_fit(cfg, policy, front.dtype, front.device, caps, baseline)
        # the block as planned (prompt_len + gen_len) fits, before anything loads
        check_block_fits(
            cfg, policy, front.dtype, front.device, caps, baseline, prompt_len, gen_len
        )
    batch_size = policy.block_size if policy else args.batch_size
    prediction = None
    if policy is not None and job is not None and layout is None:
        prediction = _predict(front, args, cfg, policy, job, hw)
    return Plan(policy, caps, baseline, batch_size, prompt_len, gen_len, prediction)


def checkpoint_formats(
    front: ModelFront, args: EngineArgs, policy: Policy | None, tensor_parallel: bool
) -> tuple[Compression | None, ...]:
    """The weight formats a search may choose: --compress's, or a pre-quantized
    checkpoint's own (`models.prequant`), whose matrices stay as they are; a --compress
    or --policy asking for another format is refused then."""
    fixed = front.spec.weight_format()
    formats = weight_formats(fixed, args.compress, args.compressions())
    if fixed is None:
        return formats
    if tensor_parallel:
        raise UserError(
            f"--tp with a pre-quantized ({compression_text(fixed)}) checkpoint is not "
            "supported; run it on one GPU with offloading (--gpu-mem, --cpu-mem, --nvme)"
        )
    if policy is not None and policy.weight_compression != fixed:
        raise UserError(
            f"the policy's weight_compression {policy.weight_compression} is not the "
            f"pre-quantized checkpoint's; set it to {fixed.__dict__}"
        )
    return formats


def weight_formats(
    fixed: Compression | None, compress: str, requested: tuple[Compression | None, ...]
) -> tuple[Compression | None, ...]:
    """The weight formats a plan may use: --compress's (`requested`), or a pre-quantized
    checkpoint's own (`fixed`), refusing a --compress that names another."""
    if fixed is None:
        return requested
    text = compression_text(fixed)
    if compress not in ("none", "auto", text):
        raise UserError(
            f"--compress {compress}: the checkpoint is already quantized ({text}) "
            "and runs in its own format; drop --compress"
        )
    return (fixed,)


def _refuse_compression_without_a_plan(args: EngineArgs) -> None:
    """--compress and --kv-compress choose the formats of a plan's policy: with no caps,
    no --nvme and no --policy the model runs whole on one device, uncompressed, and the
    flags would be ignored."""
    flags = [f"--{name} {value}" for name, value in
             (("compress", args.compress), ("kv-compress", args.kv_compress)) if value != "none"]  # fmt: skip
    if flags:
        raise UserError(
            f"{' and '.join(flags)} take effect through a memory plan, and this run has none "
            "(the model runs whole on one device): add --gpu-mem, --cpu-mem or --nvme, or a "
            "--policy with the formats"
        )


def _search(
    front: ModelFront,
    args: EngineArgs,
    limits: tuple[Caps, Baseline],
    cfg: ModelConfig,
    lengths: tuple[int, int],
    weight_formats: tuple[Compression | None, ...],
    layout: Layout,
    job: Job | None,
) -> tuple[Policy, HardwareProfile]:
    """The searched policy (for the job where there is one) and the profile it was
    searched on; the formats' advice and the store's room judged before any load."""
    from offload.executor.probe import measure_profile, verify
    from offload.policies.choose import choose_policy

    prompt_len, gen_len = lengths
    caps, baseline = limits

    choice = choose_policy(
        cfg,
        front.dtype,
        caps.gpu_bytes,
        caps.cpu_bytes,
        args.nvme,
        prompt_len,
        gen_len,
        args.profile,
        compressions=weight_formats,
        kv_compressions=args.kv_compressions(),
        measure_machine=measure_profile,
        top=VERIFY_TOP if args.verify_plan else 1,
        tp=layout.tp,
        dp=layout.dp,
        job=job,
        baseline=baseline,
    )
    best = choice.best
    log.info(
        "searched policy: predicted %.1f tok/s, bottleneck %s", best.total_tok_s, best.bottleneck
    )
    if args.verify_plan:
        probed = verify(
            cfg, choice.ranked, front.dtype, front.device, prompt_len, gen_len, args.nvme
        )
        for est, probe in probed:
            log.info(
                "probed %d x %d: predicted %.1f tok/s, measured %.1f tok/s (%.1f s)",
                est.policy.num_gpu_batches,
                est.policy.gpu_batch_size,
                est.total_tok_s,
                probe.total_tok_s,
                probe.seconds_spent,
            )
        best = probed[0][0]
    _advise(args, cfg, choice, best, (prompt_len, gen_len), weight_formats, job)
    return best.policy, choice.profile


def _advise(args, cfg, choice, best, lengths, weight_formats, job) -> None:
    """Before the load: a warning where int4 formats the flags left out would run the job
    `advice.WARN_SPEEDUP` times faster or more, and a refusal where the plan's weight
    store needs more disk than is free (with the formats' advice, where they help)."""
    from offload.policies.advice import WARN_SPEEDUP, format_hint

    hint = format_hint(
        cfg, choice.dtype, *lengths, choice.profile, choice.caps, best,
        weight_formats, args.kv_compressions(), job,
    )  # fmt: skip
    problem = _store_space_problem(args, cfg, choice.dtype, best.policy)
    if problem:
        raise UserError(problem + (f"; or {hint.text()}" if hint else ""))
    if hint is not None and hint.speedup >= WARN_SPEEDUP:
        log.warning("this plan predicts %.1f tok/s; %s", hint.tok_s / hint.speedup, hint.text())


def _store_space_problem(args: EngineArgs, cfg: ModelConfig, dtype, policy: Policy) -> str | None:
    """Why the weight store the plan needs will not fit under --nvme (None: it fits, or
    a store there holds it, or a build there resumes: its own check counts what is left)."""
    from offload.io.layout import store_bytes
    from offload.io.store import find_store, space_problem, store_dir

    nvme, compression, placement = args.nvme, policy.weight_compression, policy.weights
    if nvme is None or placement.disk <= 0:
        return None
    if find_store(nvme, cfg, dtype, compression, placement)[0] is not None:
        return None
    directory = store_dir(nvme, cfg, dtype, compression)
    if directory.with_name(directory.name + ".partial").exists():
        return None
    return space_problem(nvme, store_bytes(cfg, dtype, compression, placement))


def _predict(front, args: EngineArgs, cfg, policy: Policy, job: Job, hw) -> JobEstimate | None:
    """The job's predicted time under the plan, on the profile searched with or, for a
    given policy, the known one (None where there is none: nothing is measured for it)."""
    from offload.policies.choose import known_profile
    from offload.policies.job import predict_job

    hw = hw or known_profile(args.profile)
    if hw is None:
        return None
    spec = front.spec
    checkpoint = 0 if spec.kind == "dummy" else spec.checkpoint_bytes()
    return predict_job(cfg, policy, front.dtype, job, hw, args.nvme, checkpoint)


def holds_allocator(args: EngineArgs, plan: Plan, device, tensor_parallel: bool) -> bool:
    """Whether the engine holds the GPU's caching allocator to the GPU cap: as
    --hold-gpu-mem / --no-hold-gpu-mem say, else wherever there is a GPU cap on a GPU,
    except a tensor-parallel rank's (its NCCL buffers grow outside the allocator after
    the plan), which says so."""
    if args.hold_gpu_mem is not None:
        return args.hold_gpu_mem
    capped = device.type == "cuda" and plan.caps.gpu_bytes is not None
    if capped and tensor_parallel:
        log.warning(
            "the GPU's allocator is not held to --gpu-mem under tensor parallelism (not "
            "supported): its reserved bytes may pass the cap where its allocated bytes do not"
        )
    return capped and not tensor_parallel


def front_and_plan(
    args: EngineArgs,
    policy: Policy | None,
    gen_len: int | None,
    parallel: TensorParallel | None,
) -> tuple[ModelFront, Plan]:
    """The model's front (config, tokenizer; no weights) and the run's checked plan.
    parallel: this process is one tensor-parallel rank: the executor runs over the rank's
    shard, memory is planned and checked for it, and caps and nvme are the rank's own."""
    device = resolve_device(args.device) if parallel is None else parallel.device
    front = ModelFront(args, device)
    return front, plan_run(
        front, args, policy, gen_len, None if parallel is None else parallel.layout
    )
