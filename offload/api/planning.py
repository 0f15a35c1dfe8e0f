"""`plan`: the policy a run will use, and the proof that it fits, before any load.

    PlanRequest (built once: the model's front, the caps as given, the formats allowed,
    the job, the rank layout) -> --policy, or the plan search (caps, --nvme or a format
    asked for), or the whole model on the device where this machine holds it (else
    searched within this machine's memory) -> the weights fit the caps -> a full block of
    the planned prompt and generation lengths fits the caps -> the job's prediction

Every caller goes through `plan`: offload-run (`cli.sizing`), its ranks under --tp and
--dp (`cli.parallel`), `LLM(...)`, offload-plan and offload-plan --gpus, so offload-plan
prints the plan the run will use. Every step needs only the model's config
(`ModelFront`), never its weights, so a plan that cannot run is refused in seconds, not
after a long load.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from offload.api.args import EngineArgs, resolve_device
from offload.api.front import ModelFront
from offload.api.plan_formats import checkpoint_formats
from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.kernels.formats import Compression
from offload.parallel.rank import rank_nvme
from offload.parallel.shard import rank_config
from offload.policies import paths
from offload.policies.caps import (
    Baseline,
    Caps,
    Machine,
    check_block_fits,
    check_caps_within_machine,
    check_weights_fit,
    default_cpu_bytes,
    whole_problem,
)
from offload.policies.explain import Candidate
from offload.policies.hardware import HardwareProfile
from offload.policies.job import Job, JobEstimate
from offload.policies.latent import check_latent_policy
from offload.policies.memory_limit import node_memory_limit, rank_cpu_bytes
from offload.policies.node import Layout
from offload.policies.policy import Policy
from offload.policies.search import kv_formats

if TYPE_CHECKING:
    from offload.parallel.comm import TensorParallel

log = logging.getLogger(__name__)

# generation tokens a plan is sized for when neither the caller nor the model says
PLAN_GEN_LEN = 256
VERIFY_TOP = 3  # plans --verify-plan probes


@dataclass(frozen=True)
class PlanRequest:
    """Everything a plan is made from, built once (`PlanRequest.build`) by every caller:
    offload-run (one process or a rank of --tp/--dp), `LLM(...)`, offload-plan and
    offload-plan --gpus. `args` holds the caps as given, the formats allowed, --policy,
    --profile and --nvme; the job is the requests the run will generate for (None: full
    blocks at the lengths); layout: the plan is one rank's of a parallel job on this
    node; policy: one chosen by the caller; explain: rank the chosen plan's neighbours
    (`policies.explain`) for offload-plan --explain and --stats."""

    front: ModelFront
    args: EngineArgs
    prompt_len: int
    gen_len: int
    job: Job | None = None
    layout: Layout | None = None
    policy: Policy | None = None
    explain: bool = False
    # the machine the plan is for (None: this process's, measured when planning)
    machine: Machine | None = None

    @classmethod
    def build(
        cls,
        front: ModelFront,
        args: EngineArgs,
        policy: Policy | None = None,
        gen_len: int | None = None,
        layout: Layout | None = None,
        job: Job | None = None,
        explain: bool = False,
        machine: Machine | None = None,
    ) -> PlanRequest:
        """The request for prompts of `args.planned_prompt_len` tokens and `gen_len` new
        tokens (default: the model's generation_config, else PLAN_GEN_LEN); a
        data-parallel group plans for its share of the job's requests."""
        if layout is not None and layout.dp > 1 and job is not None:  # group 0's requests
            job = Job(job.prompt_lens[:: layout.dp], job.gen_lens[:: layout.dp])
        if args.policy is not None:
            policy = Policy.from_file(args.policy)
        gen_len = gen_len or front.get_default_sampling_params().max_tokens or PLAN_GEN_LEN
        lengths = (args.planned_prompt_len, gen_len)
        return cls(front, args, *lengths, job, layout, policy, explain, machine)

    @property
    def config(self) -> ModelConfig:
        """The model's config, or a rank's shard of it under tensor parallelism."""
        if self.layout is None:
            return self.front.config
        return rank_config(self.front.config, self.layout.tp, 0)

    @property
    def searches(self) -> bool:
        """The plan search chooses the policy: caps, --nvme or a compressed format were
        asked for, and no policy was given."""
        args = self.args
        return self.policy is None and (args.wants_search or _formats_asked(args))


@dataclass(frozen=True)
class Plan:
    """Where a run's weights and KV cache live (None: the whole model on one device, no
    offloading), the caps it was checked against (resolved: the flags', else this
    machine's), the baseline, the lengths it was sized for, and how it was made."""

    policy: Policy | None
    caps: Caps
    baseline: Baseline
    batch_size: int
    prompt_len: int
    gen_len: int
    # the job's predicted wall time (`policies.job`), where a job was given and a
    # hardware profile is known
    prediction: JobEstimate | None = None
    # "searched", "given" (--policy or the caller's) or "whole" (one device, no caps)
    made: str = "whole"
    profile: HardwareProfile | None = None
    # the chosen plan and its ranked neighbours (`policies.explain`), where asked for
    candidates: tuple[Candidate, ...] = ()


def plan(request: PlanRequest) -> Plan:
    """The run's plan; `UserError` when none fits, before anything loads.

    --policy or the caller's policy -> checked against the caps; caps, --nvme or a
    format asked for -> the plan search (`policies.choose`) for the job; nothing asked
    for -> the whole model on the device, checked against this machine's memory, and
    where it does not fit, searched within this machine's memory on a GPU or refused
    with the fix on a CPU. So every run is planned and checked, and a model the machine
    cannot hold is refused here, never killed by the kernel mid-load."""
    front, args, layout = request.front, request.args, request.layout
    machine = request.machine or Machine.here(front.device)
    weight_formats = checkpoint_formats(
        front, args, request.policy, layout is not None and layout.tp > 1
    )
    # a format the model's attention cannot read is refused by name (`search.kv_formats`)
    kv_formats(request.config, (request.policy.kv_compression,) if request.policy else args.kv_compressions())  # fmt: skip
    given = Caps(args.gpu_bytes, args.cpu_bytes, args.nvme is not None, _shared(layout))
    check_caps_within_machine(given, machine.device, machine)
    policy, hw, made, caps = request.policy, None, "given", given
    if policy is None and request.searches:
        policy, hw, caps = _search(request, machine, given, weight_formats)
        made = "searched"
    elif policy is None:
        policy, hw, caps = _whole_or_search(request, machine, weight_formats)
        made = "whole" if policy is None else "searched"
    if layout is not None and policy is None:
        policy = Policy(gpu_batch_size=args.batch_size, num_gpu_batches=1)
        made = "given"
    if made == "given":
        caps = _filled(given, machine)
    cfg, dtype, base = request.config, front.dtype, machine.baseline
    if policy is not None:
        check_latent_policy(cfg, policy)
        if (ruled_out := paths.ruled_out(cfg, policy)) is not None:
            raise UserError(f"{cfg.model_type} cannot run {ruled_out}; change the policy")
        check_weights_fit(cfg, policy, dtype, machine.device, caps, base, machine.limits)
        # the block as planned (prompt_len + gen_len) fits, before anything loads
        check_block_fits(
            cfg, policy, dtype, machine.device, caps, base,
            request.prompt_len, request.gen_len, machine.limits,
        )  # fmt: skip
    prediction = candidates = None
    if policy is not None and request.job is not None and request.layout is None:
        hw = hw or _known_profile(args)  # (a prediction is not worth a measurement)
    if policy is not None and request.job is not None and hw is not None:
        prediction = _predict(request, policy, hw)
        if request.explain:
            candidates = _explain(request, policy, hw, caps, weight_formats)
    batch_size = policy.block_size if policy else args.batch_size
    return Plan(
        policy, caps, base, batch_size, request.prompt_len, request.gen_len, prediction,
        made, hw, tuple(candidates or ()),
    )  # fmt: skip


def _shared(layout: Layout | None) -> int:
    return layout.dp if layout is not None else 1


def _formats_asked(args: EngineArgs) -> bool:
    return args.compress != "none" or args.kv_compress != "none"


def _filled(caps: Caps, machine: Machine) -> Caps:
    """The caps as given, each one not given the machine's."""
    gpu, cpu = machine.limits
    return dataclasses.replace(
        caps,
        gpu_bytes=caps.gpu_bytes if caps.gpu_bytes is not None else gpu,
        cpu_bytes=caps.cpu_bytes if caps.cpu_bytes is not None else cpu,
    )


def _known_profile(args: EngineArgs) -> HardwareProfile | None:
    from offload.policies.choose import known_profile

    return known_profile(args.profile)


def _search(
    request: PlanRequest,
    machine: Machine,
    caps: Caps,
    weight_formats: tuple[Compression | None, ...],
) -> tuple[Policy, HardwareProfile, Caps]:
    """The searched policy (for the job where there is one), the profile it was searched
    on and the caps it was searched within (resolved); the formats' advice and the
    store's room judged before any load."""
    from offload.executor.probe import measure_profile, verify
    from offload.policies.choose import choose_policy

    front, args, layout = request.front, request.args, request.layout or Layout()
    cfg, prompt_len, gen_len = request.config, request.prompt_len, request.gen_len
    # (on the CPU device without a GPU cap, the search splits the CPU cap between the
    # device's tier and the host's by the profile's baseline: `caps.cpu_only_caps`)
    if machine.device.type == "cuda" and caps.gpu_bytes is None:  # the whole card
        caps = dataclasses.replace(caps, gpu_bytes=machine.limits[0])
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
        job=request.job,
        baseline=machine.baseline,
    )
    best = choice.best
    log.info(
        "searched policy: predicted %.1f tok/s, bottleneck %s", best.total_tok_s, best.bottleneck
    )
    if args.verify_plan:
        probed = verify(
            cfg, choice.ranked, front.dtype, machine.device, prompt_len, gen_len, args.nvme
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
    _advise(args, cfg, choice, best, (prompt_len, gen_len), weight_formats, request.job)
    return best.policy, choice.profile, choice.caps


def _whole_or_search(
    request: PlanRequest, machine: Machine, weight_formats: tuple[Compression | None, ...]
) -> tuple[Policy | None, HardwareProfile | None, Caps]:
    """No caps, no --nvme, no format and no policy: the whole model on the device (None)
    where it fits this machine's memory with a full block; else, on a GPU, the plan
    search within the GPU's memory and this machine's RAM (no disk); on a CPU, nothing
    can be moved off the device: refused with the fix."""
    front, args = request.front, request.args
    caps = Caps(*machine.limits, nvme=False, shared_weights=_shared(request.layout))
    whole = Policy(gpu_batch_size=args.batch_size, num_gpu_batches=1)
    problem = whole_problem(
        request.config, whole, front.dtype, machine.device, caps, machine.baseline,
        request.prompt_len, request.gen_len,
    )  # fmt: skip
    if problem is None:
        return None, None, caps
    if machine.device.type != "cuda":
        raise UserError(
            f"{front.spec.name} does not fit this machine whole ({problem}); give --nvme DIR "
            "and --cpu-mem to stream its weights from disk, or a smaller format (--compress "
            "int8 or int4, --dtype bfloat16)"
        )
    log.info("the model does not fit the GPU whole (%s): planning within this machine's memory", problem)  # fmt: skip
    searched = dataclasses.replace(caps, cpu_bytes=default_cpu_bytes())
    try:
        return _search(request, machine, searched, weight_formats)
    except UserError as exc:
        raise UserError(f"{exc}; give --nvme DIR to stream weights from disk") from None


def _predict(request: PlanRequest, policy: Policy, hw: HardwareProfile) -> JobEstimate | None:
    """The job's predicted time under the plan on `hw` (one process's: a rank's plan of
    a parallel job is predicted by the layouts' comparison, not here)."""
    from offload.policies.job import predict_job

    if request.layout is not None or request.job is None:
        return None
    spec = request.front.spec
    checkpoint = 0 if spec.kind == "dummy" else spec.checkpoint_bytes()
    return predict_job(
        request.config, policy, request.front.dtype, request.job, hw, request.args.nvme,
        checkpoint,
    )  # fmt: skip


def _explain(
    request: PlanRequest,
    policy: Policy,
    hw: HardwareProfile,
    caps: Caps,
    weight_formats: tuple[Compression | None, ...],
) -> list[Candidate]:
    """The chosen plan and its ranked neighbours (`policies.explain`)."""
    from offload.policies.explain import neighbours

    spec = request.front.spec
    assert request.job is not None
    return neighbours(
        request.config, request.front.dtype, policy, request.job, hw, caps,
        (request.prompt_len, request.gen_len), weight_formats, request.args.kv_compressions(),
        nvme=request.args.nvme, checkpoint_bytes=0 if spec.kind == "dummy" else spec.checkpoint_bytes(),
    )  # fmt: skip


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


def rank_engine(engine: EngineArgs, local_ranks: int, rank: int) -> tuple[EngineArgs, str]:
    """One rank's EngineArgs of a job of `local_ranks` on this node (offload-run's ranks
    and offload-plan --tp/--dp alike): --gpu-mem per GPU, --cpu-mem (default: the node's,
    less the tenth the OS keeps, `caps.default_cpu_bytes`) shared by the node's ranks,
    the rank's own --nvme directory. And where the CPU cap came from."""
    nvme = rank_nvme(engine.nvme, rank)
    if not (engine.wants_search or engine.policy is not None):  # one block on each GPU
        return engine.replace(nvme=nvme), "no cap"
    if engine.cpu_bytes is not None:
        node_cpu, where = engine.cpu_bytes, "--cpu-mem"
    else:
        node_cpu, where = default_cpu_bytes(), f"{node_memory_limit()[1]}, less a tenth"
    cpu_bytes = rank_cpu_bytes(node_cpu, local_ranks)
    return engine.replace(cpu_mem=f"{cpu_bytes}B", nvme=nvme), where


def holds_allocator(args: EngineArgs, plan: Plan, device, tensor_parallel: bool) -> bool:
    """Whether the engine holds the GPU's caching allocator to the GPU cap: as
    --hold-gpu-mem / --no-hold-gpu-mem say, else wherever there is a GPU cap on a GPU,
    except a tensor-parallel rank's (its NCCL buffers grow outside the allocator after
    the plan), which says so."""
    if args.hold_gpu_mem is not None:
        return args.hold_gpu_mem
    capped = device.type == "cuda" and args.gpu_bytes is not None
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
    layout = None if parallel is None else parallel.layout
    return front, plan(PlanRequest.build(front, args, policy, gen_len, layout))
