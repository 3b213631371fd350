"""The multirun's start, as the CLI adds it (``conf/config.yaml`` lists ``sweep_callback.SweepCheck`` before ``SweepCallback``):
every value of every swept key composed and typed as the jobs will be before any job starts, then SIGINT and
SIGTERM forwarded to the jobs (``csframework.sweep.start_forwarding``) until the multirun ends."""
from __future__ import annotations


from omegaconf import DictConfig

from .. import api, hydra_session
from ..config import describe_error, explicit_groups
from ..errors import ConfigError, CsfError

def start_checked(config: DictConfig, config_name: str | None) -> None:
    """The multirun's start (the Hydra callback ``csframework.sweep_callback.SweepCheck``): ``check_sweep``
    (its ``ConfigError`` carried past Hydra's callback guard, which would turn it into a warning, to the CLI's
    one-line report), then the signal forwarding."""
    from . import start_forwarding

    overrides = [*config.hydra.overrides.hydra, *config.hydra.overrides.task]
    config_dir = next((s.path for s in config.hydra.runtime.config_sources
                       if s.provider == "command-line" and s.schema == "file"), None)
    try:
        check_sweep([str(o) for o in overrides], config_dir, config_name or "config")
    except CsfError as e:
        raise hydra_session.CallbackError(e) from e
    start_forwarding()


def sweep_samples(overrides: list[str]) -> list[tuple[list[str], list[str]]]:
    """Jobs of a sweep that together use every value of every swept key (the first job, then one more per
    further value), as Hydra's basic sweeper spells them: ``(overrides, the swept ones among them)``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        choices = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_discrete_sweep()
                   else [f"{o.get_key_element()}={o.get_value_element_as_str()}"]
                   for o in parsed if not o.is_sweep_override() or o.is_discrete_sweep()]
    except HydraException as e:
        raise ConfigError(describe_error(e)) from e
    first = [values[0] for values in choices]
    jobs = [first]
    for i, values in enumerate(choices):
        jobs += [first[:i] + [value] + first[i + 1:] for value in values[1:]]
    swept = [i for i, values in enumerate(choices) if len(values) > 1]
    return [(job, [job[i] for i in swept]) for job in jobs]


def check_sweep(overrides: list[str], config_dir: str | None, config_name: str) -> None:
    """Compose every value of every swept key as the jobs will (``sweep_samples``; a sweeper of the user's
    choice, Optuna's say, picks its own values and is left to itself), raising ``ConfigError`` naming the
    job, then the key or file. The first job's config files may enable plugins (``api.settled``): their
    sections count for every job, and for the jobs Hydra then composes."""
    if any(o.lstrip("+~").startswith(("hydra/sweeper", "hydra.sweeper")) for o in overrides):
        return
    found = api.command_line_composition(overrides)
    for index, (job, swept) in enumerate(sweep_samples(overrides)):
        def composed(found: api.Composition, job: list[str] = job) -> DictConfig:
            return hydra_session.compose_dict(job, config_dir, config_name, sections=found.sections,
                                              disabled=found.disabled)

        try:
            if index == 0:
                found, cfg = api.settled(job, config_dir, config_name, composed, hydra_session.plugin_choices,
                                         found=found)
            else:
                cfg = composed(found)
            api.typed(found, cfg, explicit_groups(job))
        except ConfigError as e:
            raise ConfigError(f"the sweep's job with {' '.join(swept)}: {e}") from e
