"""A device description whose efficiency a run measured, rather than guessed.

The built-in descriptions (``tidal_plan.devices``) guess what fraction of its peak FLOP/s
training reaches (``mfu``). A run's online profile (``tidal_agent.profiler``) times every
placement unit's forward, input-gradient and weight-gradient work on the device, in the run's
own steps, and the cost model counts the same units' FLOPs (``tidal_plan.costmodel``): the
seconds the units would take at the device's peak over the seconds they took is the ``mfu``
the run reached. Where the profile also has each rank's peak allocated GPU memory, what the
fullest rank held beyond the model's count for the profiled layout becomes the device's
``memory_overhead_bytes`` (CUDA's workspaces, allocator rounding; never negative: a model
that counts more stays as it is).

``tidal run --write-device FILE`` writes the result (``devices.write_device``); ``tidal plan
--device FILE`` plans with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tidal_api.layout import Layout
from tidal_plan.costmodel import layout_unit_costs, predict
from tidal_plan.devices import Device
from tidal_plan.modelshape import ModelShape
from tidal_plan.profiled import ProfileError

_TIMED = ("forward_s", "input_grad_s", "weight_grad_s")


def measured_seconds(profile: Mapping[str, Any], num_units: int) -> float:
    """The profile's forward, input-gradient and weight-gradient seconds, over every unit."""
    units = profile["units"]
    return sum(units[str(u)][kind] for u in range(num_units) for kind in _TIMED)


def measured_device(profile: Mapping[str, Any], shape: ModelShape, base: Device, *,
                    name: str | None = None) -> Device:
    """``base`` with the efficiency the run of ``profile`` (the JSON of a run's profile, of a
    model of ``shape``) reached: its ``mfu`` and, where the profile has GPU peaks, its
    ``memory_overhead_bytes``; named ``name`` (default: ``<base>-measured``).

    Give ``base`` the job's precision (``planner.job_device``): the memory it predicts
    depends on it. A run faster than ``base``'s peak allows (an ``mfu`` over 1: the peak is
    too low, as a CPU core's rough one can be) raises ``peak_flops`` to what it reached.
    """
    try:
        layout = Layout(**profile["layout"])
        if layout.num_units != shape.num_units:
            raise ProfileError(f"the profile's layout has {layout.num_units} units; the model "
                               f"{shape.num_units}: profile a run of this job")
        seconds = measured_seconds(profile, shape.num_units)
        ranks = list(profile.get("ranks", {}).values())
    except (KeyError, TypeError) as err:
        raise ProfileError(f"profile lacks {err}: write it with tidal run --profile") from None
    if not seconds > 0:
        raise ProfileError("the profile's units took no time: profile a run of some steps")
    at_peak = dataclasses.replace(base, mfu=1.0, memory_overhead_bytes=0.0)
    reached = sum(u.seconds for u in layout_unit_costs(shape, layout, at_peak)) / seconds
    device = dataclasses.replace(
        base, name=name or f"{base.name}-measured", mfu=min(1.0, reached),
        peak_flops=base.peak_flops * max(1.0, reached), memory_overhead_bytes=0.0)
    peaks = [(r["pp_rank"], r["peak_gpu_bytes"]) for r in ranks
             if r.get("peak_gpu_bytes") is not None]
    if not peaks:  # a CPU's profile: no allocator's peak to compare with
        return dataclasses.replace(device, memory_overhead_bytes=base.memory_overhead_bytes)
    predicted = predict(shape, layout, device).peak_memory_bytes
    beyond = max(peak - predicted[pp_rank] for pp_rank, peak in peaks)
    return dataclasses.replace(device, memory_overhead_bytes=max(0.0, float(beyond)))
