"""``xronos bench --links``: parsing the sweep, one-line errors before anything runs (and
nothing written), ``crossover.json`` from the runs' ``bench.json``, its markdown table
and its figure (log bandwidth axis, loopback labelled at the right end)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure

from xronos.bench import crossover
from xronos.bench.crossover import parse_links, rate_label
from xronos.cli import build_parser, main
from xronos.emulation.cluster import LinkRequest
from xronos.errors import UserError
from xronos.metrics import plot


def test_links_parse_in_order_with_canonical_names() -> None:
    links = parse_links("loopback, 1Gbit,500Mbit,200Mbit,12.5MB/s")
    assert [link.label for link in links] == ["loopback", "1Gbit", "500Mbit", "200Mbit", "100Mbit"]
    assert [link.bandwidth_bps for link in links] == [None, 1e9, 5e8, 2e8, 1e8]
    assert rate_label(1.25e6) == "1.25Mbit" and rate_label(2.5e9) == "2.5Gbit"
    assert parse_links("LoopBack")[0].label == "loopback"


def test_each_link_asks_what_bandwidth_and_no_network_would() -> None:
    loop, rate = parse_links("loopback,200Mbit")
    assert loop.request() == LinkRequest.from_flags(False, None, None)  # --no-network
    assert rate.request() == LinkRequest.from_flags(None, "200Mbit", None)  # --bandwidth
    # --latency goes to every rated link; a cluster's declared latency stays otherwise
    loop, rate = parse_links("loopback,200Mbit", "2ms")
    assert rate.request() == LinkRequest.from_flags(None, "200Mbit", "2ms")
    assert loop.request() == LinkRequest(False)
    assert rate.request().latency_s == pytest.approx(0.002)


@pytest.mark.parametrize(
    ("text", "latency", "needle"),
    [
        ("loopback,fast", None, "--links: 'fast' is neither loopback nor a rate"),
        ("100Mbps", None, "'Mbps' in '100Mbps' is ambiguous"),
        ("10bit", None, "--links: '10bit' is below 1kbit/s"),
        ("1Gbit,1000Mbit", None, "--links: '1000Mbit' is given twice (as 1Gbit)"),
        ("1Gbit,,loopback", None, "an empty entry"),
        (" , ", None, "--links: none given"),
        ("1Gbit", "2 parsecs", "--latency: unknown unit"),
        ("loopback", "2ms", "--latency applies to the rated links"),
    ],
)
def test_bad_links_get_one_line(text: str, latency: str | None, needle: str) -> None:
    with pytest.raises(UserError) as e:
        parse_links(text, latency)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--links", "loopback,fast"], "'fast' is neither loopback nor a rate"),
        (["--links", "1Gbit", "--bandwidth", "1Gbit"], "drop --bandwidth"),
        (["--links", "1Gbit", "--no-network"], "drop --no-network"),
        (["--links", "1Gbit", "--no-emulation"], "drop --no-emulation"),
        (["--links", "1Gbit", "--strategies", "xronos,nope"], "nope"),
        (["--links", "1Gbit", "--cluster", "no-such-cluster"], "no-such-cluster"),
        (["--links", "1Gbit", "--lora-rank", "-1"], "--lora-rank must be"),
    ],
)
def test_bad_sweep_stops_before_anything_is_written(
    extra: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep"
    code = main(["bench", "--scenario", "smoke", "--out", str(out), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("xronos: error: ") and needle in err
    assert not out.exists()


def test_links_flag_parses() -> None:
    args = build_parser().parse_args(["bench", "--links", "loopback,1Gbit"])
    assert args.links == "loopback,1Gbit"
    assert build_parser().parse_args(["bench"]).links is None


# ----------------------------------------------------------------------------- record


def _bench(single: float, steps: dict[str, float], chosen: str, link: str) -> dict[str, Any]:
    """A ``bench.json`` document with what the crossover reads."""
    strategies: dict[str, Any] = {
        name: {
            "step_time_s": t,
            "speedup_vs_single": single / t,
            "speedup_vs_single_interval": [0.9 * single / t, 1.1 * single / t],
            "predicted_step_time_s": t * 0.9,
        }
        for name, t in steps.items()
    }
    strategies["auto"]["chosen"] = chosen
    strategies["auto"]["auto"] = {"ran": {"strategy": chosen}}
    return {
        "scenario": "ci-2dev",
        "model": "small",
        "strategies": strategies,
        "links": [{"name": "fast", "latency_s": None}, {"name": "slow", "latency_s": 0.001}],
        "emulation": {
            "mechanisms": {"network": "namespaces + veth …", "cpu quota": "cgroup v1"},
            "links": [{"name": "fast", "link": link}, {"name": "slow", "link": link}],
        },
    }


LINKS = parse_links("loopback,1Gbit,200Mbit,100Mbit")
BENCHES = [
    _bench(0.5, {"auto": 0.42, "xronos": 0.40, "single": 0.5}, "xronos", "loopback")
    | {"auto_vs_best_other": {"best_other": "xronos", "ratio": 1.05, "interval": [0.98, 1.1]}},
    _bench(0.5, {"auto": 0.45, "xronos": 0.45, "single": 0.5}, "xronos", "1 Gbit/s (tbf)"),
    _bench(0.5, {"auto": 0.5, "xronos": 0.6, "single": 0.5}, "single", "200 Mbit/s (tbf)"),
    _bench(0.5, {"auto": 0.5, "xronos": 0.8, "single": 0.5}, "single", "100 Mbit/s (tbf)"),
]


def test_crossover_record_has_each_links_ratios_pick_and_mechanisms() -> None:
    doc = crossover.crossover(LINKS, BENCHES, {"cluster": "ci-2dev", "command": "xronos …"})
    assert doc["strategies"] == ["auto", "xronos", "single"] and doc["cluster"] == "ci-2dev"
    first, slow = doc["links"][0], doc["links"][3]
    assert first["link"] == "loopback" and first["bandwidth_bps"] is None
    assert first["strategies"]["xronos"]["step_over_single"] == pytest.approx(0.8)
    assert first["strategies"]["xronos"]["predicted_step_time_s"] == pytest.approx(0.36)
    # the speed-up's interval, turned like the ratio itself into step ÷ single
    interval = first["strategies"]["xronos"]["step_over_single_interval"]
    assert interval == pytest.approx([0.8 / 1.1, 0.8 / 0.9])
    assert first["single_step_time_s"] == pytest.approx(0.5)
    assert slow["strategies"]["xronos"]["step_over_single"] == pytest.approx(1.6)
    assert [e["auto_chosen"] for e in doc["links"]] == ["xronos", "xronos", "single", "single"]
    assert slow["emulation"]["links"] == {"fast": "100 Mbit/s (tbf)", "slow": "100 Mbit/s (tbf)"}
    assert slow["emulation"]["network"].startswith("namespaces")
    assert slow["latency_s"] == {"fast": None, "slow": 0.001}


def test_markdown_table_has_a_row_per_link_and_autos_pick() -> None:
    doc = crossover.crossover(LINKS, BENCHES, {})
    lines = crossover.format_table(doc).splitlines()
    head = (
        "| link | auto | xronos | single | auto's pick | single s/step | auto ÷ best other (95 %) |"
    )
    assert lines[0] == head
    assert lines[1] == "|---|---:|---:|---:|---|---:|---|"
    row = "| loopback | 0.84 | 0.80 | 1.00 | xronos | 0.500 | 1.050 (0.980–1.100) vs xronos |"
    assert lines[2] == row
    # no auto_vs_best_other in that link's bench.json
    assert lines[5] == "| 100Mbit | 1.00 | 1.60 | 1.00 | single | 0.500 | — |"
    assert len(lines) == 6


def test_a_strategy_whose_loss_left_singles_is_marked() -> None:
    benches = [
        dict(b, strategies={k: dict(v) for k, v in b["strategies"].items()}) for b in BENCHES
    ]
    benches[1]["strategies"]["xronos"]["loss_matches_single"] = False
    benches[1]["strategies"]["auto"]["loss_matches_single"] = True
    doc = crossover.crossover(LINKS, benches, {})
    assert doc["links"][1]["strategies"]["xronos"]["loss_matches_single"] is False
    lines = crossover.format_table(doc).splitlines()
    assert lines[3] == "| 1Gbit | 0.90 | 0.90† | 1.00 | xronos | 0.500 | — |"
    assert lines[2].startswith("| loopback | 0.84 | 0.80 | 1.00 |")  # not compared: no mark
    assert lines[-1].startswith("† its loss left single's")


def test_outputs_are_written_and_a_stale_map_is_cleared(tmp_path: Path) -> None:
    doc = crossover.crossover(LINKS, BENCHES, {})
    crossover.write_outputs(tmp_path, doc)
    assert (tmp_path / "crossover.json").stat().st_size > 0
    assert (tmp_path / "crossover.png").read_bytes()[:4] == b"\x89PNG"
    crossover.clear_outputs(tmp_path)
    assert not (tmp_path / "crossover.json").exists() and not (tmp_path / "crossover.png").exists()


def test_figure_puts_loopback_at_the_right_end_of_a_log_axis(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    figures: list[Figure] = []
    monkeypatch.setattr(plot, "_save", lambda fig, path: figures.append(fig))
    plot.plot_crossover(tmp_path / "x.png", crossover.crossover(LINKS, BENCHES, {}))
    ax = figures[0].axes[0]
    assert ax.get_xscale() == "log"
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["100Mbit", "200Mbit", "1Gbit", "loopback"]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert {"auto", "xronos", "single"} <= lines.keys()
    xs = list(lines["xronos"].get_xdata())
    assert xs == sorted(xs) and xs[-1] > 1e9  # loopback beyond the fastest link
    assert list(lines["xronos"].get_ydata()) == pytest.approx([1.6, 1.2, 0.9, 0.8])
    # the horizontal line at 1.0 (across the axes, unlabelled)
    assert any(
        line.get_label().startswith("_") and list(line.get_ydata()) == [1.0, 1.0]
        for line in ax.get_lines()
    )
