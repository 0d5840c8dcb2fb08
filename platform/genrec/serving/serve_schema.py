"""What Serve's own config schema (Ray 2.60) defines: Serve accepts a key it does not know and drops it silently
(a typo deploys and does nothing), so genrec checks every key against it; and one deployment's options validated
as Serve will validate them at deploy."""

from __future__ import annotations

import typing

from pydantic import BaseModel

FREE_FORM = {"args", "user_config", "runtime_env", "env_vars", "resources"}  # dicts Serve passes through


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation may hold (through Optional, Union, list, dict values)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def unknown_keys(value, model: type[BaseModel], path: str = "") -> list[str]:
    """Where `value` (a config's dict) has keys `model` (a Serve schema) does not define."""
    if isinstance(value, list):
        return [bad for i, item in enumerate(value) for bad in unknown_keys(item, model, f"{path}[{i}]")]
    if not isinstance(value, dict):
        return []
    fields = {f.alias or name: f for name, f in model.model_fields.items()} | dict(model.model_fields)
    bad = []
    for key, item in value.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            bad.append(where)
        elif key not in FREE_FORM:
            for sub in _models_in(fields[key].annotation):
                bad += unknown_keys(item, sub, where)
    return bad


def deployment_problems(options: dict) -> list[str]:
    """What Serve would drop or refuse in one deployment's options: unknown keys (nested ones too), bad values,
    an autoscaling config that does not hold (min above max...). Each names where it is."""
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import DeploymentSchema

    found = [f"{where}: not an option of a Serve deployment" for where in unknown_keys(options, DeploymentSchema)]
    checks = [(DeploymentSchema, {"name": "check", **options})]
    if isinstance(options.get("autoscaling_config"), dict):
        checks.append((AutoscalingConfig, options["autoscaling_config"]))
    for model, value in checks:
        try:
            model.model_validate(value)
        except ValidationError as err:
            prefix = "autoscaling_config." if model is AutoscalingConfig else ""
            found += [f"{prefix}{'.'.join(map(str, e['loc'])) or '(options)'}: {e['msg']}" for e in err.errors()]
    return found
