"""offload-run sizes its plan for the job, before the model loads.

    measure: every request encoded with the model's tokenizer and chat template (the
             front: no weights) -> the job's prompt lengths and generation budgets
    plan_for_job: --prompt-len, else the job's longest prompt -> `planning.plan`
             (search and fit checks) -> the plan, or a one-line refusal

So a job whose prompts are longer than the plan allows is refused in seconds, not after
a load of minutes. A prompt past the model's context, or longer than any plan fits in
the memory caps, stops the run unless --skip-invalid, which records it as an error
result (`job_loop.run_job`) and runs the rest.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from offload.api.args import EngineArgs
from offload.api.front import ModelFront
from offload.api.planning import Plan, PlanRequest, plan
from offload.core.errors import BadTokenIds, PromptTooLong, UserError
from offload.jobs import job, job_loop
from offload.models.tokenizer import BYTE_TOKENS
from offload.policies.caps import Machine
from offload.policies.job import Job
from offload.policies.node import Layout

log = logging.getLogger("offload")

SKIP_HINT = "or pass --skip-invalid to record such requests as errors and go on"


@dataclass
class JobShape:
    """The prompt lengths of the requests a job generates for: for each length, the
    largest generation budget among its requests and one request's id (for messages)."""

    context: int
    by_length: dict[int, tuple[int, str]] = field(default_factory=dict)
    counts: Counter[int] = field(default_factory=Counter)  # requests of each length
    # every sequence's prompt tokens and budget, in the job's order (`policies.job`)
    order: list[tuple[int, int]] = field(default_factory=list)

    def add(self, prompt_tokens: int, budget: int, request_id: str, samples: int = 1) -> None:
        known_budget, known_id = self.by_length.get(prompt_tokens, (0, request_id))
        self.by_length[prompt_tokens] = (max(known_budget, budget), known_id)
        self.counts[prompt_tokens] += 1
        self.order += [(prompt_tokens, budget)] * samples

    def job(self, longest: int | None = None) -> Job | None:
        """The sequences a plan for prompts of up to `longest` tokens runs (None: all);
        None where there are none."""
        kept = [(n, b) for n, b in self.order if longest is None or n <= longest]
        if not kept:
            return None
        return Job([n for n, _ in kept], [b for _, b in kept])

    @property
    def longest(self) -> int | None:
        return max(self.by_length, default=None)

    def lengths(self) -> list[int]:
        return sorted(self.by_length)

    def request_id(self, prompt_tokens: int) -> str:
        return self.by_length[prompt_tokens][1]

    def gen_len(self, prompt_tokens: int) -> int:
        """The largest budget among prompts of up to `prompt_tokens` tokens, within the
        context after such a prompt: the search plans only lengths that fit the context.
        (A block that holds the longest prompt and a shorter one's larger budget goes
        past that; `LLM.generate_ids` still checks each block as it comes.)"""
        budget = max(b for n, (b, _) in self.by_length.items() if n <= prompt_tokens)
        return max(1, min(budget, self.context - prompt_tokens))


def measure(
    front: ModelFront, requests: Iterable[job.JobRequest], from_flags: bool, skip_invalid: bool
) -> JobShape:
    """Encode every valid request the way `job_loop.run_job` will (`job_loop.encode_request`,
    `ModelFront.check_prompt`) and record its length and budget.

    Token ids are not kept: run_job encodes each request again as it goes, so memory
    stays flat however long the job. Requests an earlier run finished are measured too:
    the job is judged the same on every run, before the result log is opened. A bad
    command-line prompt stops the run (as before); in a file, a prompt past the context
    or with token ids outside the vocabulary stops it unless skip_invalid, and other bad
    requests are left to run_job, which records them as error results."""
    shape = JobShape(front.config.max_position_embeddings)
    for req in requests:
        if req.error is not None:
            continue
        try:
            ids = job_loop.encode_request(front, req)
            front.check_prompt(ids)
        except (PromptTooLong, BadTokenIds) as exc:
            if from_flags:
                raise
            if not skip_invalid:
                raise UserError(f"request {req.id}: {exc}, {SKIP_HINT}") from None
            continue
        except UserError:
            if from_flags:
                raise
            continue
        assert req.params is not None
        shape.add(len(ids), req.params.budget(len(ids), shape.context), req.id, req.params.n)
    return shape


@dataclass(frozen=True)
class SizedPlan:
    """The engine's args with the prompt length planned, the plan, and the longest prompt
    it runs (None: every prompt the context holds; longer ones become error results)."""

    engine: EngineArgs
    plan: Plan
    prompt_limit: int | None = None


def plan_for_job(
    front: ModelFront,
    engine: EngineArgs,
    shape: JobShape,
    gen_len: int | None,
    skip_invalid: bool,
    layout: Layout | None = None,
    explain: bool = False,
    machine: Machine | None = None,
) -> SizedPlan:
    """The plan for the job's prompts: --prompt-len when given (never below the job's
    longest prompt), else the job's longest. gen_len: new tokens to plan for when the
    job has nothing to generate; layout: the plan of one rank of a parallel job;
    explain: rank the plan's neighbours; machine: the one planned for (None: this one;
    `planning.plan`)."""

    def planned(sized: EngineArgs, gen: int | None, job: Job | None) -> Plan:
        return plan(PlanRequest.build(front, sized, None, gen, layout, job, explain, machine))

    longest = shape.longest
    if longest is None:  # nothing to generate: the flags' lengths, or the defaults
        return SizedPlan(engine, planned(engine, gen_len, None))
    if engine.prompt_len is not None:
        if engine.prompt_len < longest:
            raise UserError(
                f"request {shape.request_id(longest)} has a prompt of {longest} tokens but "
                f"--prompt-len is {engine.prompt_len}; raise --prompt-len to {longest} or "
                "omit it (the plan is then sized for the job's longest prompt)"
            )
        found = planned(engine, shape.gen_len(engine.prompt_len), shape.job())
        _log_sizing(found, f"--prompt-len; the job's longest prompt has {longest}", front)
        return SizedPlan(engine, found)
    sized = engine.replace(prompt_len=longest)
    try:
        found = planned(sized, shape.gen_len(longest), shape.job())
    except UserError as exc:
        return _plan_what_fits(shape, skip_invalid, exc, lambda n: _attempt(planned, engine, shape, n), front)  # fmt: skip
    _log_sizing(found, "the job's longest", front)
    return SizedPlan(sized, found)


def _attempt(planned, engine: EngineArgs, shape: JobShape, prompt_tokens: int) -> SizedPlan | None:
    """The plan for the job's prompts of up to `prompt_tokens` tokens (None: none fits)."""
    sized = engine.replace(prompt_len=prompt_tokens)
    try:
        found = planned(sized, shape.gen_len(prompt_tokens), shape.job(prompt_tokens))
    except UserError:
        return None
    return SizedPlan(sized, found, prompt_tokens)


def _plan_what_fits(
    shape: JobShape, skip_invalid: bool, error: UserError, attempt, front: ModelFront
) -> SizedPlan:
    """The job's longest prompt has no plan: find the longest of its prompts that has
    one (`attempt`: a plan search or fit check a try, halving), and refuse the longer
    ones, or with skip_invalid plan for it and leave the longer ones to run_job as error
    results. Nothing fits: the longest prompt's error, as it came."""
    lengths = shape.lengths()

    fitting = attempt(lengths[0])
    if fitting is None:
        raise error
    low, high = 0, len(lengths) - 1  # lengths[low] has a plan, lengths[high] has none
    while high - low > 1:
        middle = (low + high) // 2
        found = attempt(lengths[middle])
        if found is None:
            high = middle
        else:
            low, fitting = middle, found
    fits, longest = lengths[low], lengths[-1]
    if not skip_invalid:
        raise UserError(
            f"request {shape.request_id(longest)} has a prompt of {longest} tokens, longer "
            f"than any plan fits in the memory caps (of this job's prompts, those up to {fits} "
            f"tokens fit); shorten it, raise the caps, {SKIP_HINT}"
        )
    longer = sum(count for n, count in shape.counts.items() if n > fits)
    log.warning(
        "%d request(s) with prompts of more than %d tokens (up to %d) do not fit the memory "
        "caps; they are recorded as errors (--skip-invalid)",
        longer,
        fits,
        longest,
    )
    _log_sizing(fitting.plan, "the longest that fits the caps", front)
    return fitting


def _log_sizing(plan: Plan, why: str, front: ModelFront) -> None:
    """The lengths the plan was sized for and, where there is one, the job's predicted
    time (a model with no tokenizer counts UTF-8 bytes as tokens: said beside them)."""
    if plan.policy is not None:  # without a policy nothing is sized
        unit = f"; {BYTE_TOKENS}" if front.spec.byte_tokens else ""
        log.info(
            "plan sized for prompts of %d tokens (%s%s) and %d new tokens",
            plan.prompt_len,
            why,
            unit,
            plan.gen_len,
        )
    if plan.prediction is not None:
        log.info("%s", plan.prediction.summary())
