"""The training backends: one protocol (:class:`Backend`), one registry (:data:`BACKENDS`).

A backend is what the train step runs the trainer on: ``pytorchjob`` (a Training Operator v1 PyTorchJob; its
older name ``kubeflow`` is still accepted),
``trainjob`` (a Kubeflow Trainer v2 TrainJob) and ``local`` (subprocesses of the step, kfp.local only). Every
place that used to ask "which backend?" reads the registry instead:

* the train step (llmft/components/train.py) calls ``backend_for(job.backend).run(plan, launch)``; a cluster
  backend's ``run`` is :func:`run_on_cluster_or_exit`, which reads the launcher pod once and calls the
  backend's ``attach`` (submit the job or re-attach to it, and wait);
* the sweep (llmft/components/lib/jobs/katib_sweep.py ``sweep_trial_job``) builds its Katib trial as its explicit
  ``katib_trials`` policy says: its own ``trial_job``, another backend's, or none (refused);
* the plan step runs its ``preflight`` on a cluster (llmft/components/lib/plan/step.py) and refuses under kfp.local
  a backend that ``needs_cluster``, on a cluster one that does not (llmft/components/lib/plan/checks.py);
* ``llmft pipeline render-job --backend <render_name>`` (llmft/commands/render_job.py) writes ``build``'s body;
* the run's cleanup (llmft/components/lib/jobs/cleanup.py) deletes by :func:`run_resources`, every backend's
  ``resource`` (its (group, version, plural, kind), written once, llmft/katib/trial_kinds.py) and Katib's
  Experiment; a launcher's SIGTERM deletes the one it runs by the same ``resource``;
* Katib (llmft/katib/, a leaf that never imports this) learns each backend's ``trial_kind`` from
  :func:`register`, which hands it down (``register_trial_kind``);
* ``make image-check`` (tools/image_check.py) renders every backend that has a ``render_name``;
* tests/docs/test_deploy_manifests.py checks that deploy/role.yaml grants every registered ``resource``.

A new backend is one module (its spec, its attach) plus one :func:`register` call here; :func:`register` refuses a
name already taken.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from llmft.components.lib import cluster as cluster_module
from llmft.components.lib.jobs import (
    katib_trial,
    local_train,
    pytorchjob_launch,
    pytorchjob_spec,
    trainjob_launch,
    trainjob_runtime,
    trainjob_spec,
)
from llmft.components.lib.jobs.launcher_pod import read_launcher_pod
from llmft.components.lib.jobs.lifecycle import API_RETRIES, PENDING_EVERY, ClusterRun
from llmft.components.lib.jobs.pytorchjob_spec import JobSpec
from llmft.katib.trial_kinds import (
    EXPERIMENT_RESOURCE,
    PYTORCHJOB,
    TRAINJOB,
    JobResource,
    TrialKind,
    register_trial_kind,
    unregister_trial_kind,
)
from llmft.trainer.errors import ConfigError, LlmftError

JOB_VERBS = ("create", "get", "list", "watch", "patch", "delete")
"""What the launcher does to its backend's jobs: submit, read and wait, (un)mark kept for a retry, delete."""


Attach = Callable[[ClusterRun], dict]
"""A cluster backend's attach: submit the plan's job (``run.job``) or re-attach to the one an earlier attempt of
the task submitted, and wait for its end, through the shared lifecycle (llmft/components/lib/jobs/lifecycle.py
``run_lifecycle`` with the backend's ``JobAdapter``); a summary dict once it succeeded (an LlmftError with the
contract's exit code otherwise). Its one argument, :class:`ClusterRun`, is typed: nothing is swallowed."""


class Preflight(Protocol):
    """What the plan step checks on the cluster for a backend before any GPU is requested (a TrainJob's runtime
    exists and launches torchrun); ConfigError (one line) when the run cannot start."""

    def __call__(self, plan: Any, cluster: Any = None) -> None: ...


OWN_TRIALS = "own"
NO_TRIALS = "none"


class Grant(NamedTuple):
    """One RBAC rule a backend needs: verbs on (group, resource); ``cluster_scoped``: in deploy/cluster-role.yaml
    (a ClusterRole), else in deploy/role.yaml (the pipeline's namespaced Role)."""

    group: str
    resource: str
    verbs: tuple[str, ...]
    cluster_scoped: bool = False


@dataclass(frozen=True)
class Backend:
    """One training backend: what the train step, the sweep, render-job and the cleanup need of it.

    ``build(job, spec)``: the job body (a dict, as the API server receives it) of the plan's ``job`` (JobPlan)
    running ``spec`` (the :class:`JobSpec` every backend starts from: image, resources, Secrets, the
    trainer command). ``trial_job(job, spec, early_stopping)``: the same as a Katib trial template.
    ``attach(run)`` (:data:`Attach`, ``run`` a :class:`ClusterRun`): submit the job or re-attach to it (a retried
    task) and wait for its end; a summary dict. ``run(plan, launch)``:
    the train step's body (the default, for a cluster backend, is :func:`run_on_cluster_or_exit`)."""

    name: str
    """The pipeline's ``training_backend`` value (the plan step accepts exactly the registered names)."""
    aliases: tuple[str, ...] = ()
    """Older ``training_backend`` values users typed for it, still accepted with the same meaning."""
    render_name: str = ""
    """``llmft pipeline render-job --backend`` value; "" = nothing to render (local)."""
    resource: JobResource | None = None
    """The kind it creates (RBAC, cleanup and SIGTERM delete by it); None = it creates nothing (local)."""
    trial_kind: TrialKind | None = None
    """What Katib needs of its trials; None = no Katib trials."""
    build: Callable[[Any, JobSpec], dict] | None = None
    trial_job: Callable[[Any, JobSpec, bool], dict] | None = None
    katib_trials: str = NO_TRIALS
    """Its Katib trial policy, always explicit: ``own`` (``trial_job`` builds its job as a Katib trial), the name of
    another backend (a sweep's trials run as that backend's jobs: ``local``'s are PyTorchJobs, for a run that
    trains here and sweeps on a cluster), or ``none`` (a Katib sweep is refused in one line: never silently swept
    on another kind of job)."""
    attach: Attach | None = None
    preflight: Preflight | None = None
    """The plan step's check on a cluster (llmft/components/lib/plan/step.py), before any GPU is requested."""
    run: Callable[[Any, Any], Any] | None = None
    reads: tuple[Grant, ...] = ()
    """What else its launcher reads (a TrainJob's runtimes), beyond its own kind."""
    needs_cluster: bool = True
    """It creates cluster objects (its pods need the cluster's scheduler and volume): under kfp.local the plan
    step refuses it (llmft/components/lib/plan/checks.py ``check_runs_here``) instead of the train step failing
    after prepare and tokenize."""

    def grants(self) -> tuple[Grant, ...]:
        """The RBAC it needs (tests/docs/test_deploy_manifests.py: deploy/ grants it): its jobs, then ``reads``."""
        own = (Grant(self.resource.group, self.resource.plural, JOB_VERBS),) if self.resource else ()
        return (*own, *self.reads)

    def build_job(self, job, spec: JobSpec) -> dict:
        """:attr:`build`'s body; ConfigError for a backend that creates no job (local)."""
        if self.build is None:
            raise ConfigError(f"training_backend={self.name} creates no cluster job to build")
        return self.build(job, spec)

    def build_trial_job(self, job, spec: JobSpec, early_stopping: bool) -> dict:
        """:attr:`trial_job`'s Katib trial template; ConfigError for a backend without Katib trials."""
        if self.trial_job is None:
            raise ConfigError(f"training_backend={self.name} runs no Katib trials")
        return self.trial_job(job, spec, early_stopping)

    def trials_backend(self) -> Backend:
        """The backend whose job a Katib trial of this backend's run is (:attr:`katib_trials`); ConfigError (one
        line) for a backend whose policy is ``none``."""
        if self.katib_trials == OWN_TRIALS:
            return self
        if self.katib_trials == NO_TRIALS:
            own = ", ".join(b.name for b in BACKENDS.values() if b.katib_trials == OWN_TRIALS)
            raise ConfigError(
                f"training_backend={self.name} has no Katib trials (its trial policy is none): sweep with "
                f"hpo_backend=local, or train on a backend Katib runs trials of ({own})"
            )
        return backend_for(self.katib_trials)

    def check_preflight(self, plan, cluster=None) -> None:
        """:attr:`preflight` when it has one."""
        if self.preflight is not None:
            self.preflight(plan, cluster)

    def run_train_step(self, plan, launch) -> Any:
        """The train step's body for this backend."""
        return (self.run or _run_cluster_step)(plan, launch)


BACKENDS: dict[str, Backend] = {}
"""``training_backend`` value -> its :class:`Backend`, in registration order."""


def register(backend: Backend) -> Backend:
    """Add ``backend`` and hand its trial kind down to Katib. A name (or older name) already registered is refused
    (a second module registering ``pytorchjob`` would silently replace the first), as is a trial policy that names
    no registered backend of its own trials."""
    taken = {n for b in BACKENDS.values() for n in (b.name, *b.aliases)}
    clash = sorted(taken & {backend.name, *backend.aliases})
    if clash:
        raise ValueError(f"training backend {', '.join(clash)} is already registered; unregister it first")
    if backend.katib_trials == OWN_TRIALS and (backend.trial_job is None or backend.trial_kind is None):
        raise ValueError(f"training backend {backend.name}: katib_trials='own' needs trial_job and trial_kind")
    if backend.katib_trials not in (OWN_TRIALS, NO_TRIALS):
        target = BACKENDS.get(backend.katib_trials)
        if target is None or target.katib_trials != OWN_TRIALS:
            raise ValueError(f"training backend {backend.name}: katib_trials={backend.katib_trials!r} runs no trials")
    BACKENDS[backend.name] = backend
    if backend.trial_kind is not None:
        register_trial_kind(backend.trial_kind)
    return backend


def unregister(name: str) -> None:
    """Remove a backend (a test's toy one) and its trial kind."""
    backend = BACKENDS.pop(name)
    if backend.trial_kind is not None:
        unregister_trial_kind(backend.trial_kind)


def is_backend(name: str) -> bool:
    """``name`` is a registered ``training_backend`` value or an older name of one."""
    return any(name == b.name or name in b.aliases for b in BACKENDS.values())


def backend_for(name: str) -> Backend:
    """The backend of a ``training_backend`` value (or an older name of it); ConfigError (one line) for an
    unknown one."""
    for backend in BACKENDS.values():
        if name == backend.name or name in backend.aliases:
            return backend
    raise ConfigError(f"training_backend={name!r} is not a training backend; use one of {', '.join(BACKENDS)}")


def render_names() -> dict[str, str]:
    """``render-job --backend`` value -> ``training_backend`` value, for every backend that renders a job."""
    return {b.render_name: b.name for b in BACKENDS.values() if b.render_name}


def run_resources() -> tuple[JobResource, ...]:
    """Everything a run may start (the run's cleanup): every backend's job kind and Katib's Experiment, in API
    order (group, version, plural), whatever the order of registration."""
    kinds = {b.resource for b in BACKENDS.values() if b.resource is not None} | {EXPERIMENT_RESOURCE}
    return tuple(sorted(kinds))


# --- a cluster backend's train step ---------------------------------------------------------------


def run_on_cluster(
    job,
    launch,
    *,
    poll_s: float = 30.0,
    cluster=None,
    print_fn: Callable[[str], Any] = print,
    api_retries: int = API_RETRIES,
    pending_every: int = PENDING_EVERY,
    owner: dict | None = None,
) -> dict:
    """The plan's job (``job``, a JobPlan) run to its end on its backend as ``launch`` (a TrainerLaunch) says;
    returns the backend's summary once it succeeded. The launcher pod is read before training (a SIGTERM then
    needs one GET); ``owner``: the job's ownerReference (default: the run's Argo Workflow in a KFP pod)."""

    backend = backend_for(job.backend)
    if backend.attach is None:
        raise ConfigError(f"training_backend={job.backend} runs no cluster job; it runs in the step (kfp.local)")
    cluster = cluster or cluster_module.Cluster()
    launcher = read_launcher_pod(cluster, print_fn=print_fn)
    owner = owner if owner is not None else launcher.owner_reference()
    run = ClusterRun(
        job, launch, cluster, launcher, owner, poll_s=poll_s, print_fn=print_fn, api_retries=api_retries,
        pending_every=pending_every,
    )  # fmt: skip
    return backend.attach(run)


def run_on_cluster_or_exit(job, launch, **options) -> dict:
    """:func:`run_on_cluster` for the train step: a failure the project raises on purpose (JobNeverStarts,
    JobTimedOut: 200; JobFailedPermanently: 1; ...) exits with its ``exit_code`` after printing its message
    (its log tail included), instead of the traceback and exit 1 an exception gives a KFP component. KFP's
    launcher then fails the task whatever the code (kubeflow/pipelines 2.4.1 backend/src/v2/cmd/launcher-v2/
    main.go 46-50, glog.Exit), its log saying ``exit status 200``; the task's set_retry retries it."""

    try:
        return run_on_cluster(job, launch, **options)
    except LlmftError as exc:
        print(f"error (exit {exc.exit_code}): {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None


def _run_cluster_step(plan, launch) -> dict:
    return run_on_cluster_or_exit(plan.job, launch)


# --- the registry's entries ----------------------------------------------------------------------


def _build_pytorchjob(job, spec: JobSpec) -> dict:
    return pytorchjob_spec.pytorchjob_to_dict(pytorchjob_spec.build_pytorchjob(spec))


def _trial_pytorchjob(job, spec: JobSpec, early_stopping: bool) -> dict:
    return katib_trial.trial_pytorchjob_dict(spec, early_stopping=early_stopping)


def _build_trainjob(job, spec: JobSpec) -> dict:
    return trainjob_spec.trainjob_to_dict(trainjob_spec.build_trainjob(spec, runtime=job.runtime))


def _trial_trainjob(job, spec: JobSpec, early_stopping: bool) -> dict:
    return trainjob_spec.trial_trainjob_dict(spec, runtime=job.runtime, early_stopping=early_stopping)


register(
    Backend(
        name="pytorchjob",
        aliases=("kubeflow",),  # its name until issue 48: a TrainJob is Kubeflow too
        render_name="pytorchjob",
        resource=pytorchjob_spec.RESOURCE,
        trial_kind=PYTORCHJOB,
        build=_build_pytorchjob,
        trial_job=_trial_pytorchjob,
        katib_trials=OWN_TRIALS,
        attach=pytorchjob_launch.attach_pytorchjob,
    )
)
register(
    Backend(
        name="trainjob",
        render_name="trainjob",
        resource=trainjob_spec.RESOURCE,
        trial_kind=TRAINJOB,
        build=_build_trainjob,
        trial_job=_trial_trainjob,
        katib_trials=OWN_TRIALS,
        attach=trainjob_launch.attach_trainjob,
        preflight=trainjob_runtime.preflight_runtime,
        reads=(  # its runtime, read by the plan step (llmft/components/lib/jobs/trainjob_runtime.py)
            Grant(trainjob_spec.GROUP, "trainingruntimes", trainjob_runtime.RUNTIME_VERBS),
            Grant(trainjob_spec.GROUP, "clustertrainingruntimes", trainjob_runtime.RUNTIME_VERBS, cluster_scoped=True),
        ),
    )
)
register(Backend(name="local", run=local_train.run_local_step, needs_cluster=False, katib_trials="pytorchjob"))
