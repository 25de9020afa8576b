"""The shaped link's pure parts: rates and delays as tc writes them, the qdisc each shape asks for, the refusals,
and the calibration's arithmetic (benchmarks/link_calibration.py) checked by hand (docs/launch.md, "A shaped
link")."""
import importlib.util
from pathlib import Path

import pytest

from mindzero.launch.link import LinkShape, parse_delay, parse_rate
from mindzero.launch.local import LaunchOptions, main


@pytest.mark.parametrize("text,bits", [("200mbit", 200_000_000), ("1gbit", 10 ** 9), ("1.5Mbit", 1_500_000),
                                       ("64kbit", 64_000), ("25mbps", 200_000_000), ("8000bit", 8000)])
def test_rates_in_tc_units(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text,rule", [("200", "one of tc's units"), ("200mb", "one of tc's units"),
                                       ("fast", "one of tc's units"), ("1kbit", "at least 8kbit")])
def test_bad_rates_are_refused_naming_the_value_and_rule(text, rule):
    with pytest.raises(ValueError, match=rule) as err:
        parse_rate(text)
    assert repr(text) in str(err.value)


def test_delays():
    assert parse_delay("1ms") == 1.0 and parse_delay("250us") == 0.25 and parse_delay("0.5s") == 500.0
    with pytest.raises(ValueError, match="'1 min'"):
        parse_delay("1 min")


def test_a_rate_alone_is_a_token_bucket_holding_two_loopback_packets_at_least():
    q = LinkShape.parse("200mbit").qdisc()
    assert q[:3] == ["tbf", "rate", "200000000bit"]
    assert int(q[q.index("burst") + 1]) == 250_000  # 10 ms of 25 MB/s
    slow = LinkShape.parse("8mbit").qdisc()
    assert int(slow[slow.index("burst") + 1]) == 2 * 65536  # 10 ms would be 10 kB: below one 64 KiB packet


def test_a_delay_asks_for_netem():
    q = LinkShape.parse("100mbit", "2ms").qdisc()
    assert q[:3] == ["netem", "delay", "2.0ms"] and "rate" in q and q[q.index("rate") + 1] == "100000000bit"


def test_shape_rules():
    with pytest.raises(ValueError, match="rate=1000"):
        LinkShape(1000)
    with pytest.raises(ValueError, match="delay_ms=-1"):
        LinkShape(10 ** 6, -1)
    with pytest.raises(TypeError, match="link='200mbit'.*LinkShape.parse"):
        LaunchOptions(link="200mbit")


def test_a_delay_without_a_rate_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--link-delay", "1ms", "script.py"])
    assert "--link-delay 1ms: needs --link-rate" in capsys.readouterr().err


def _calibration():
    """benchmarks/link_calibration.py, the calibration's one user and home (a script, loaded by path)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "link_calibration.py"
    spec = importlib.util.spec_from_file_location("link_calibration", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_calibration_arithmetic_by_hand():
    cal_module = _calibration()
    Cluster, calibrate = cal_module.Cluster, cal_module.calibrate
    # a device of 100 TFLOP/s at MFU 0.5 (50 TFLOP/s achieved) with a 100 Gbit/s link; here one rank does
    # 10 GFLOP in 2 s (5 GFLOP/s): 10,000x slower, so 10 Mbit/s per rank, 40 Mbit/s shared by 4 ranks
    cluster = Cluster("test", 100e12, 100e9, mfu=0.5)
    cal = calibrate(10e9, 2.0, 4, cluster)
    assert cal.here_flops == pytest.approx(5e9) and cal.slowdown == pytest.approx(1e4)
    assert cal.per_rank_bits == pytest.approx(10e6) and cal.rate == 40_000_000
    text = cal.explain()
    assert "10,000x slower" in text and "--link-rate 40000kbit" in text


def test_named_clusters_and_refusals():
    cal_module = _calibration()
    CLUSTERS, calibrate = cal_module.CLUSTERS, cal_module.calibrate
    cal = calibrate(81e9, 16.4, 4, "dgx-a100")  # the 105M GPT's step at 4 ranks here (docs/performance.md)
    assert cal.cluster is CLUSTERS["dgx-a100"]
    assert cal.rate == int(4 * 200e9 / (312e12 * 0.4 / (81e9 / 16.4)))
    with pytest.raises(ValueError, match="cluster='tpu'"):
        calibrate(1e9, 1.0, 2, "tpu")
    with pytest.raises(ValueError, match="step_seconds=0"):
        calibrate(1e9, 0, 2)
    with pytest.raises(ValueError, match="world_size=0"):
        calibrate(1e9, 1.0, 0)
