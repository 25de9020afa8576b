"""The prediction's arithmetic (mindzero.core.fit, pure): the bilinear fit of rehearsed replicas, the batch terms
taken from another configuration, the largest depth, the recommendation, sizes and accumulation choices."""
import pytest

from mindzero.core.fit import (GIB, MIB, Fit, Measurement, Prediction, accumulation_choices, config_label,
                               fit_bilinear, fit_depth, parse_bytes, recommend, table, transient_bytes,
                               with_batch_terms)

TRUE = Fit(c0=300e6, c1=50e6, a0=2e6, a1=3e6, t0=1e6, t1=4e6)


def _measure(fit, depth, batch, **kw):
    return Measurement(depth, batch, int(fit.peak(depth, batch)), traffic=fit.traffic(depth), **kw)


def test_four_replicas_recover_the_bilinear_model_and_predict_the_full_depth():
    ms = [_measure(TRUE, d, b) for b in (4, 2) for d in (1, 2)]
    fit, base = fit_bilinear(ms)
    assert base == 4
    for name in ("c0", "c1", "a0", "a1", "t0", "t1"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-9), name
    assert fit.peak(24, 4) == pytest.approx(TRUE.peak(24, 4))
    assert fit.activations(24, 4) == pytest.approx(4 * (2e6 + 3e6 * 24))


def test_a_fit_needs_two_depths_at_two_batches():
    with pytest.raises(ValueError, match="two depths at each of two batches"):
        fit_bilinear([_measure(TRUE, 1, 2), _measure(TRUE, 2, 2), _measure(TRUE, 1, 1)])
    with pytest.raises(ValueError, match="same point"):
        fit_depth(_measure(TRUE, 2, 2), _measure(TRUE, 2, 2))
    with pytest.raises(ValueError, match="one batch"):
        fit_depth(_measure(TRUE, 1, 2), _measure(TRUE, 2, 1))


def test_batch_terms_from_another_configuration_keep_the_fit_at_the_base_batch():
    own = Fit(c0=200e6, c1=80e6, a0=0, a1=0)  # a stage-3 run measured at batch 2 only
    stage0 = [_measure(TRUE, d, b) for b in (2, 1) for d in (1, 2)]
    lo, hi = [_measure(own, d, 2) for d in (1, 2)]
    fit = with_batch_terms(fit_depth(lo, hi), 2, (stage0[0], stage0[1]), (stage0[2], stage0[3]))
    assert (fit.a0, fit.a1) == pytest.approx((TRUE.a0, TRUE.a1))
    for d in (1, 2, 7):  # unchanged where it was measured, and along the depth at that batch
        assert fit.peak(d, 2) == pytest.approx(own.peak(d, 2))
    assert fit.peak(7, 1) == pytest.approx(own.peak(7, 2) - TRUE.activations(7, 1))


def test_a_negative_batch_slope_is_noise_and_counts_no_activations():
    noisy = [Measurement(1, 2, 500), Measurement(2, 2, 600), Measurement(1, 1, 510), Measurement(2, 1, 590)]
    fit, _ = fit_bilinear(noisy)
    # at depth 1 the larger batch measured less (noise): no activations there; at depth 2, 10 bytes per sample
    assert fit.activations(1, 2) == pytest.approx(0) and fit.activations(2, 2) == pytest.approx(20)
    assert fit.peak(1, 2) == pytest.approx(500) and fit.peak(2, 2) == pytest.approx(600)


def test_largest_depth_is_the_last_block_count_under_the_budget():
    budget = TRUE.peak(10, 4) + 1
    assert TRUE.largest_depth(budget, 4) == 10
    assert TRUE.peak(TRUE.largest_depth(budget, 4) + 1, 4) > budget
    assert TRUE.largest_depth(TRUE.peak(0, 4) - 1, 4) == 0
    with pytest.raises(ValueError, match="nothing per block"):
        Fit(1.0, 0.0, 0.0, 0.0).largest_depth(10.0, 1)


def _pred(stage, peak_mib, wire_mib, **opts):
    return Prediction({"zero_stage": stage, **opts}, 4, 12, 2, 1, peak_mib * MIB, {}, wire_mib * MIB)


def test_the_recommendation_is_the_least_traffic_that_fits_and_says_what_was_given_up():
    preds = [_pred(0, 9000, 400), _pred(2, 5000, 400), _pred(3, 3000, 600), _pred(3, 2000, 900, stage3_regather=False)]
    best, why = recommend(preds, 6000 * MIB)
    assert best is preds[1], "stage 0 sends as little but does not fit; stage 2 does"
    assert "400 MiB" in why
    best, why = recommend(preds, 3500 * MIB)
    assert best is preds[2]
    assert "stage 2 sends less (400 MiB) but needs 4.88 GiB" in why


def test_equal_traffic_goes_to_the_lower_stage_whatever_the_peaks():
    # stage 2 and stage 3 without the backward re-gather send the same bytes; their rehearsed peaks differ by noise
    preds = [_pred(3, 231, 1, stage3_regather=False), _pred(2, 237, 1)]
    best, _ = recommend(preds, 4000 * MIB)
    assert best is preds[1]
    best, _ = recommend(preds, 234 * MIB)  # only stage 3 fits
    assert best is preds[0]


def test_nothing_fits_names_the_smallest_peak_and_its_configuration():
    preds = [_pred(0, 9000, 400), _pred(3, 3000, 600, gather_quantization="int8")]
    with pytest.raises(ValueError, match=r"budget=1.00 GiB per rank: no configuration fits; the smallest predicted "
                                         r"peak is 2.93 GiB \(stage 3, int8 gathers\)"):
        recommend(preds, GIB)
    with pytest.raises(ValueError, match="no configuration"):
        recommend([], GIB)


def test_table_has_a_row_per_prediction_and_says_which_fit():
    text = table([_pred(0, 9000, 400), _pred(3, 3000, 600)], 6000 * MIB)
    lines = text.splitlines()
    assert len(lines) == 4 and lines[2].startswith("| stage 0 | 9000 |") and lines[2].endswith("no |")
    assert lines[3].endswith("yes |")


def test_labels_name_every_option_the_plan_varies():
    assert config_label({"zero_stage": 3, "param_dtype": "float16", "gather_quantization": "int8",
                         "gather_units": "blocks.*", "stage3_regather": False, "recompute": True}, 4) == \
        "stage 3, float16 params, int8 gathers, a gather per block, no regather, recompute, accumulate 4"
    assert config_label({"zero_stage": 1}) == "stage 1"


@pytest.mark.parametrize("text,expected", [("22GiB", 22 * GIB), ("22G", 22 * GIB), ("800MiB", 800 * MIB),
                                           ("1.5gib", int(1.5 * GIB)), ("4096", 4096), (1e9, 10 ** 9), ("2k", 2048)])
def test_sizes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1GiB", 0, "0"])
def test_bad_sizes_name_the_argument(bad):
    with pytest.raises(ValueError, match="budget="):
        parse_bytes(bad)


def test_accumulation_choices_split_the_batch_evenly():
    assert accumulation_choices(8) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert accumulation_choices(6, max_steps=3) == [(1, 6), (2, 3), (3, 2)]
    with pytest.raises(ValueError, match="global_batch=0"):
        accumulation_choices(0)


def test_transient_follows_the_stage():
    full, block = 400, 30
    assert transient_bytes(full, 0, block) == 400, "stage 0: every gradient of the step at once"
    assert transient_bytes(full, 1, block) == 30 == transient_bytes(full, 2, block), "stages 1-2: reduced where produced"
    assert transient_bytes(full, 3, block) == 90 and transient_bytes(full, 3, block, regather=False) == 60
