"""A call's planner traced once for several target devices: `first_results` runs a traced call up to the
function that plans its kernels (the dispatch's `plan`, the decode or ragged planner) and calls that function
once per target device on the arguments the trace made. The plan-space derivations (`plan_space`,
`decode_space`, `ragged_space`) plan every probe on every target this way.
"""

from __future__ import annotations

import dataclasses
import re


class _Planned(Exception):
    """Stops a traced call once the function whose result is wanted has returned."""


@dataclasses.dataclass(frozen=True)
class _FakeGPU:
    """What the dispatch reads of a device: its platform and compute capability."""

    compute_capability: str
    platform: str = "gpu"


def _device(target: str) -> _FakeGPU:
    from figures import target_limits

    major, minor = re.fullmatch(r"sm_(\d+)(\d)a?", target_limits(target)["arch"]).groups()
    return _FakeGPU(f"{major}.{minor}")


def first_results(fn, specs, owner, name: str, devices: dict) -> dict:
    """For each key of `devices`, what `owner.name` (a module's function, called through the module) returns
    first while `fn` is traced on `specs` with that device as the target device, or None where the call never
    reaches it; the trace stops there (nothing after it decides a kernel). One trace serves every device when
    nothing before `owner.name` read the target device (its arguments then cannot depend on it): `owner.name`
    is called on those arguments once per device. Else `fn` is traced again for each device."""
    import jax
    from probjax_kernels import _backend

    real, real_device = getattr(owner, name), _backend.target_device
    made, state = {}, {}

    def reading():
        state["read"] = True
        return devices[state["key"]]

    def recording(*args, **kwargs):
        for key in (state["key"],) if state["read"] else devices:
            _backend.target_device = lambda device=devices[key]: device
            made[key] = real(*args, **kwargs)
        raise _Planned

    setattr(owner, name, recording)
    # jax filters the traceback of every exception raised through its API (a third of derive()'s time when on).
    filtering = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")
    try:
        for key in devices:
            if key in made:
                continue
            state.update(key=key, read=False)
            _backend.target_device = reading
            try:
                jax.eval_shape(fn, *specs)
            except _Planned:
                pass
            if key not in made and not state["read"]:  # never reached, whatever the device
                return {key: made.get(key) for key in devices}
            made.setdefault(key, None)
    finally:
        setattr(owner, name, real)
        _backend.target_device = real_device
        jax.config.update("jax_traceback_filtering", filtering)
    return made
