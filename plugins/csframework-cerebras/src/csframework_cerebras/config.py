"""The settings of ``backend=cerebras`` (``backend.*``) and of the cluster (the ``cerebras`` section), and the
rules that refuse, before anything is built, what the bridge cannot map onto cstorch. No torch, no cstorch
imported here: validation stays cheap."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

#: The optimizers with a cstorch.optim equivalent (the built-in names and their torch classes).
OPTIMIZERS = {"torch.optim.SGD": "SGD", "torch.optim.Adam": "Adam", "torch.optim.AdamW": "AdamW"}
#: What cstorch's ClusterConfig accepts as a job priority.
PRIORITIES = ("p1", "p2", "p3")
#: Precisions cstorch's CPU backend runs (its autocast refuses any other half dtype).
CPU_PRECISIONS = ("float32", "bfloat16")


@dataclass
class CerebrasBackendConfig:
    """``backend.*`` of ``backend=cerebras``."""
    name: str = "cerebras"
    """The named backend (``backend=cerebras`` sets it)."""
    type: str = "CSX"
    """cstorch's backend: ``CSX`` (a Wafer-Scale Cluster, or ``compile_only``/``validate_only`` locally) or
    ``CPU`` (cstorch's CPU backend, end to end on any machine)."""
    retrace_every_iteration: bool = False
    """``cstorch.backends.csx.debug.retrace_every_iteration``: trace the step every iteration."""
    compile_only: bool = False
    """CSX: trace and lower the step locally, then compile on the cluster; train nothing."""
    validate_only: bool = False
    """CSX: trace and validate the step locally; train nothing."""
    num_csx: int = 1
    """Systems of the cluster (``ClusterConfig.num_csx``)."""
    num_workers_per_csx: int = 1
    """Input workers per system (``ClusterConfig.num_workers_per_csx``)."""
    compile_dir: Optional[str] = None
    """The compile directory on the cluster (cstorch's default when null)."""


@dataclass
class CerebrasConfig:
    """The ``cerebras`` section: how to reach the cluster (``cstorch.distributed.ClusterConfig``)."""
    mgmt_address: Optional[str] = None
    """``HOST:PORT`` of the cluster's management node; needed for anything that runs on the cluster."""
    mgmt_namespace: Optional[str] = None
    """The cluster namespace of the job (the cluster's default when null)."""
    credentials_path: Optional[str] = None
    """The TLS certificate of the management node."""
    mount_dirs: List[str] = field(default_factory=list)
    """Directories the cluster's workers mount (the code, the data)."""
    python_paths: List[str] = field(default_factory=list)
    """Directories put on the workers' ``PYTHONPATH``."""
    job_labels: List[str] = field(default_factory=list)
    """``key=value`` labels of the cluster job."""
    job_priority: str = "p2"
    """``p1``, ``p2`` or ``p3``."""
    job_time_sec: Optional[int] = None
    """The job's time limit in seconds (none when null)."""


_ADDRESS = re.compile(r".+:[0-9]+$")
_LABEL = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]=([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$")


def rules(config) -> list[str]:
    """Every problem of a ``backend=cerebras`` run, one line each naming the key and the fix."""
    b, c = config.backend, config.cerebras
    problems = []
    if b.type not in ("CPU", "CSX"):
        problems.append(f"backend.type: '{b.type}' is not a cstorch backend; use backend.type=CSX or CPU")
    if b.compile_only and b.validate_only:
        problems.append("backend.compile_only, backend.validate_only: choose one of them")
    if b.type == "CPU" and (b.compile_only or b.validate_only):
        problems.append("backend.compile_only/validate_only: they need backend.type=CSX (the CPU backend "
                        "runs eagerly and compiles nothing)")
    if b.num_csx < 1 or b.num_csx > config.data.batch_size:
        problems.append(f"backend.num_csx: {b.num_csx} must be between 1 and data.batch_size "
                        f"({config.data.batch_size})")
    if b.num_workers_per_csx < 0:
        problems.append(f"backend.num_workers_per_csx: {b.num_workers_per_csx} must be >= 0")
    if c.mgmt_address is not None and not _ADDRESS.match(c.mgmt_address):
        problems.append(f"cerebras.mgmt_address: '{c.mgmt_address}' is not HOST:PORT")
    if c.job_priority not in PRIORITIES:
        problems.append(f"cerebras.job_priority: '{c.job_priority}' is not one of {', '.join(PRIORITIES)}")
    if c.job_time_sec is not None and c.job_time_sec <= 0:
        problems.append(f"cerebras.job_time_sec: {c.job_time_sec} must be > 0 (or null: no limit)")
    problems += [f"cerebras.job_labels: '{label}' is not key=value (letters, digits, - _ .)"
                 for label in c.job_labels if not _LABEL.match(label)]
    # cstorch's ClusterConfig mounts directories of this machine into the workers: it refuses missing ones
    problems += [f"cerebras.{key}: {path} does not exist on this machine (cstorch mounts local directories into "
                 "the cluster's workers); create it or remove it from the list"
                 for key in ("mount_dirs", "python_paths") for path in getattr(c, key) if not Path(path).exists()]
    return problems + run_rules(config)


def run_rules(config) -> list[str]:
    """What a csframework config asks for that the bridge cannot map onto cstorch."""
    problems = []
    opt = config.optimizer
    if opt._target_ and opt._target_ not in OPTIMIZERS:
        problems.append(f"optimizer._target_: {opt._target_} has no cerebras.pytorch.optim equivalent the bridge "
                        f"maps; use optimizer=sgd, adam or adamw ({', '.join(OPTIMIZERS)})")
    if opt.schedule._target_:
        problems.append(f"optimizer.schedule._target_: {opt.schedule._target_} is not mapped onto "
                        "cstorch.optim.lr_scheduler; use optimizer.schedule.name=constant, linear or cosine")
    if config.backend.type == "CPU" and config.precision.name not in CPU_PRECISIONS:
        problems.append(f"precision: {config.precision.name} does not run on cstorch's CPU backend (its mixed "
                        "precision is bfloat16 only); use precision=bfloat16 or float32 there, or "
                        "backend.type=CSX")
    if config.loop.grad_accum_steps != 1:
        problems.append(f"loop.grad_accum_steps: {config.loop.grad_accum_steps} is not mapped (cstorch splits a "
                        "batch into micro-batches on the cluster itself); use loop.grad_accum_steps=1")
    if config.stages:
        problems.append("stages: a multi-stage run is not mapped onto cstorch by the bridge; run the stages as "
                        "separate runs (checkpoint.resume=<path>)")
    return problems
