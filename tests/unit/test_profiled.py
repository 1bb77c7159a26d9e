import dataclasses

import pytest

from tidal_api.layout import Layout
from tidal_plan.actioncosts import Costs
from tidal_plan.dryrun import plan_step
from tidal_plan.layout import build_layout
from tidal_plan.profiled import Affine, Profile, ProfileError, predict_profiled, profiled_costs


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


# -- calibrated profiles ------------------------------------------------------------------------

KINDS = ("forward", "backward", "input_grad", "weight_grad", "post")


def _calibrated(*, cores=0, actions=None, messages=None, step_parts=None, overhead=0.0,
                world_size=2, collectives=0.0, sharing=None):
    """Four units: F = 1 + 1/sample, B = 2 + 2/sample, I = W = 1 + 1/sample, post 0.5."""
    unit = {
        "forward": {"fixed_s": 1.0, "per_sample_s": 1.0},
        "backward": {"fixed_s": 2.0, "per_sample_s": 2.0},
        "input_grad": {"fixed_s": 1.0, "per_sample_s": 1.0},
        "weight_grad": {"fixed_s": 1.0, "per_sample_s": 1.0},
        "post": {"fixed_s": 0.5, "per_sample_s": 0.0},
    }
    data = {
        "units": {str(u): {"forward_s": 1.0, "input_grad_s": 1.0, "weight_grad_s": 0.5,
                           "activation_bytes": 100, "param_bytes": 40} for u in range(4)},
        "micro_batch_size": 2, "p2p": {"bytes": 64, "seconds": 0.0},
        "cores": cores, "threads": 1,
        "layout": {"dp": 1, "pp": 2, "partition": [2, 2], "micro_batch_size": 2,
                   "num_micro_batches": 4, "schedule": "1f1b", "virtual_stages": 1},
        "calibration": {
            "sizes": [2, 4], "world_size": world_size,
            "action_overhead_s": {k: overhead for k in KINDS},
            "units": {str(u): unit for u in range(4)},
        },
        "collectives_s": collectives,
    }
    if actions is not None:
        data["actions_s"] = actions
    data.update(messages or {})
    if step_parts is not None:
        data["step_parts"] = step_parts
    if sharing is not None:  # the probe's step, as a multiple of its dry run's
        plain = Profile.from_dict(data)
        copies = dataclasses.replace(Layout(**data["layout"]), dp=2)
        predicted = predict_profiled(plain, copies, 16)
        step = predicted.step_seconds - predicted.allreduce_seconds + collectives
        data["sharing"] = {"copies": 2, "steps": [[step * sharing]] * 2,
                           "step_s": step * sharing}
    return Profile.from_dict(data)


def test_calibrated_units_are_affine_in_the_micro_batch_size():
    profile = _calibrated(overhead=0.5)
    for mbs, unit_f in ((2, 3.0), (4, 5.0)):
        layout = build_layout(num_units=4, workers=2, micro_batch_size=mbs, num_micro_batches=4)
        costs = profiled_costs(profile, layout)
        assert costs.forward == pytest.approx((0.5 + 2 * unit_f,) * 2)  # overhead + 2 units
        assert costs.input_grad == pytest.approx((0.5 + 4 * unit_f,) * 2)  # fused B: 2x F
        assert costs.weight_grad == (0.0, 0.0)


def test_split_schedules_use_i_and_w_and_the_first_stage_has_no_input_gradient():
    layout = build_layout(num_units=4, workers=2, micro_batch_size=2, num_micro_batches=4,
                          schedule="zb")
    costs = profiled_costs(_calibrated(), layout)
    assert costs.input_grad == pytest.approx((0.0, 6.0))
    assert costs.weight_grad == pytest.approx((12.0, 6.0))  # stage 0's W is its whole backward


def test_posting_sends_and_receives_counts_on_the_compute_beside_it():
    actions = {"F": 6.0, "B": 12.0, "SEND_F": 0.25, "RECV_F": 0.5, "SEND_B": 1.0, "RECV_B": 2.0}
    layout = build_layout(num_units=4, workers=2, micro_batch_size=2, num_micro_batches=4)
    costs = profiled_costs(_calibrated(actions=actions), layout)
    assert costs.forward == pytest.approx((6.25, 6.5))  # + SEND_F on stage 0, RECV_F on 1
    assert costs.input_grad == pytest.approx((14.0, 13.0))  # + RECV_B on 0, SEND_B on 1


def test_in_run_factor_scales_to_the_runs_own_actions():
    profile = _calibrated(actions={"F": 9.0, "B": 18.0})  # 1.5x the calibrated 6 and 12
    assert profile.calibration.in_run == pytest.approx(1.5)
    layout = build_layout(num_units=4, workers=1, micro_batch_size=2, num_micro_batches=4)
    assert profiled_costs(profile, layout).forward == pytest.approx((1.5 * 12.0,))


def test_message_costs_come_from_the_profile():
    layout = build_layout(num_units=4, workers=2, micro_batch_size=2, num_micro_batches=4,
                          schedule="gpipe")
    quiet = _calibrated(cores=2)
    assert quiet.p2p_seconds == 0.0  # no measured latency: the ping-pong's
    slow = _calibrated(cores=2, messages={"message_latency_s": 0.5, "rendezvous_s": 2.0,
                                          "message_work_s": 0.25})
    assert (slow.p2p_seconds, slow.rendezvous_s, slow.message_work_s) == (0.5, 2.0, 0.25)
    assert (predict_profiled(slow, layout, 16).pipeline_seconds
            > predict_profiled(quiet, layout, 16).pipeline_seconds + 2 * 0.5)


def test_message_delays_stretch_to_the_profiled_pipeline():
    layout = build_layout(num_units=4, workers=2, micro_batch_size=2, num_micro_batches=4)
    messages = {"message_latency_s": 0.5, "rendezvous_s": 1.0}
    timed = predict_profiled(_calibrated(messages=messages), layout, 16).pipeline_seconds
    # A profiled pipeline no slower than the dry run keeps the timed delays.
    same = _calibrated(messages=messages, step_parts={"0": {"pipeline_s": timed - 1.0}})
    assert (same.p2p_seconds, same.rendezvous_s) == (0.5, 1.0)
    # A slower one stretches both by one factor, until the dry run takes as long.
    slow = _calibrated(messages=messages, step_parts={"0": {"pipeline_s": timed + 3.0},
                                                      "1": {"pipeline_s": timed}})
    assert slow.p2p_seconds > 0.5
    assert slow.rendezvous_s == pytest.approx(2 * slow.p2p_seconds)
    assert predict_profiled(slow, layout, 16).pipeline_seconds == pytest.approx(timed + 3.0)


def test_more_busy_ranks_than_cores_share_them():
    layout = build_layout(num_units=4, workers=4, micro_batch_size=2, num_micro_batches=4,
                          schedule="gpipe")
    roomy, crowded = _calibrated(cores=8), _calibrated(cores=2)
    # Costs are work; the dry run stretches them while more ranks than cores compute.
    assert profiled_costs(crowded, layout).forward == pytest.approx((3.0,) * 4)
    fast = predict_profiled(roomy, layout, 16).pipeline_seconds
    slow = predict_profiled(crowded, layout, 16).pipeline_seconds
    assert fast < slow <= 2 * fast  # at most 4 ranks on 2 cores: at worst half speed
    work = sum(Costs(forward=3.0, input_grad=6.0, weight_grad=0.0).time(a)
               for actions in plan_step(layout).values() for a in actions)
    assert slow >= work / 2  # two cores cannot do it faster


def test_the_profile_carries_the_sharing_probe():
    assert _calibrated(cores=2).sharing == 1.0  # no probe: processor sharing alone
    probed = _calibrated(cores=2, sharing=1.25)
    assert probed.sharing == pytest.approx(1.25)  # the copies' step over their dry run
    assert _calibrated(cores=2, sharing=0.9).sharing == 1.0  # processor sharing at best
    assert _calibrated(cores=2, sharing=9.0).sharing == 4.0  # a probe run under load
    assert _calibrated(cores=0, sharing=1.25).sharing == 1.0  # unknown cores: never shared


def test_sharing_slows_layouts_as_their_ranks_outnumber_the_cores():
    plain, probed = _calibrated(cores=2), _calibrated(cores=2, sharing=1.25)
    for workers, slower in ((1, 1.0), (2, 1.0), (3, 1.125), (4, 1.25)):
        layout = build_layout(num_units=4, workers=workers, micro_batch_size=2,
                              num_micro_batches=4)
        a, b = predict_profiled(plain, layout, 16), predict_profiled(probed, layout, 16)
        assert b.pipeline_seconds == pytest.approx(slower * a.pipeline_seconds), workers
        assert b.optimizer_seconds == pytest.approx(slower * a.optimizer_seconds), workers
        assert b.allreduce_seconds == a.allreduce_seconds


def test_post_pipeline_and_all_reduces():
    profile = _calibrated(collectives=1.0, world_size=2)
    one = build_layout(num_units=4, workers=1, micro_batch_size=2, num_micro_batches=4)
    four = build_layout(num_units=4, workers=4, micro_batch_size=2, num_micro_batches=4)
    p1, p4 = predict_profiled(profile, one, 16), predict_profiled(profile, four, 16)
    assert p1.optimizer_seconds == pytest.approx(4 * 0.5)  # one rank updates every unit
    assert p4.optimizer_seconds == pytest.approx(0.5)
    assert (p1.allreduce_seconds, p4.allreduce_seconds) == pytest.approx((0.0, 3.0))
    assert p4.step_seconds == pytest.approx(p4.pipeline_seconds + 0.5 + 3.0)


def test_calibrated_profile_errors():
    data = {"units": {"0": {"forward_s": 1.0, "input_grad_s": 1.0, "weight_grad_s": 0.5,
                            "activation_bytes": 1, "param_bytes": 1}},
            "micro_batch_size": 2, "p2p": {"seconds": 0.0},
            "calibration": {"sizes": [2, 4], "world_size": 1, "action_overhead_s": {}}}
    with pytest.raises(ProfileError, match="profile lacks 'units'"):
        Profile.from_dict(data)
    assert Affine(fixed_s=-2.0, per_sample_s=0.5).at(2) == 0.0


def test_profile_window_skips_a_fresh_process_s_slow_first_steps():
    from tidal_agent.worker_options import profile_window

    assert profile_window(1000) == profile_window(9) == (3, 8)  # hooked 3, plain 4-7
    assert profile_window(8) == (3, 8)
    assert profile_window(5) == (1, 5)  # a short run: from step 1 to its last
    assert profile_window(3) == (1, 3)
    with pytest.raises(ValueError, match="at least 3 steps"):
        profile_window(2)
