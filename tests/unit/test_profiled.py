import pytest

from tidal_plan.layout import build_layout
from tidal_plan.profiled import Profile, ProfileError, predict_profiled, profiled_costs


def _profile(cores=0):
    unit = {"forward_s": 1.0, "input_grad_s": 1.0, "weight_grad_s": 0.5,
            "activation_bytes": 100, "param_bytes": 40}
    return Profile.from_dict({
        "units": {str(u): dict(unit) for u in range(4)},
        "micro_batch_size": 2, "p2p": {"bytes": 64, "seconds": 0.1},
        "optimizer_s_per_param_byte": 0.01, "cores": cores, "threads": 1,
    })


def test_stage_costs_sum_units_and_scale_with_micro_batch_size():
    layout = build_layout(num_units=4, workers=2, partition=(3, 1), micro_batch_size=4,
                          num_micro_batches=4)
    costs = profiled_costs(_profile(), layout)
    assert costs.forward == (6.0, 2.0)  # 3 units and 1 unit, at twice the profiled size
    assert costs.weight_grad == (3.0, 1.0)
    assert costs.activation_bytes == (600, 200)
    assert costs.comm == pytest.approx(0.2)


def test_oversubscribed_cores_slow_compute():
    layout = build_layout(num_units=4, workers=4, micro_batch_size=2, num_micro_batches=4)
    assert profiled_costs(_profile(cores=2), layout).forward == (2.0,) * 4
    assert profiled_costs(_profile(cores=8), layout).forward == (1.0,) * 4


def test_prediction_runs_the_schedule():
    one = build_layout(num_units=4, workers=1, micro_batch_size=2, num_micro_batches=4)
    two = build_layout(num_units=4, workers=2, micro_batch_size=2, num_micro_batches=4)
    p1, p2 = predict_profiled(_profile(), one, 16), predict_profiled(_profile(), two, 16)
    assert p1.pipeline_seconds == pytest.approx(4 * 4 * 2.5)  # no bubble on one rank
    assert p2.pipeline_seconds < p1.pipeline_seconds  # two ranks overlap
    assert p2.optimizer_seconds == pytest.approx(0.01 * 80)


def test_profile_errors():
    with pytest.raises(ProfileError, match="profile lacks"):
        Profile.from_dict({"units": {}})
    layout = build_layout(num_units=5, workers=1, micro_batch_size=2, num_micro_batches=4)
    with pytest.raises(ProfileError, match="4 units; the layout 5"):
        profiled_costs(_profile(), layout)
