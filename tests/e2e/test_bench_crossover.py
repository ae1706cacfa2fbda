"""``xronos bench --links``: one full bench run per link, each in its own directory with the
link in force, then ``crossover.json``, ``crossover.png`` and the markdown table. Where no
network namespaces can be made the rated link is emulated in the communication layer, so
this runs anywhere device emulation does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xronos.cli import main


@pytest.mark.slow
def test_two_link_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    argv = ["bench", "--scenario", "smoke", "--out", str(out), "--links", "loopback,200Mbit"]
    argv += ["--comm-dtype", "fp32"]  # exact payloads: the losses are compared
    # ci-2dev-even: both devices at full speed, so no start-up speed check to wait for
    argv += ["--cluster", "ci-2dev-even", "--strategies", "tp-even,single"]
    argv += ["--steps", "1", "--warmup", "0"]
    assert main(argv) == 0
    stdout = capsys.readouterr().out

    # each link is a whole bench run of its own, with that link in force
    loop = json.loads((out / "loopback" / "bench.json").read_text())
    rated = json.loads((out / "200Mbit" / "bench.json").read_text())
    assert (out / "loopback" / "bench.png").stat().st_size > 0
    assert (out / "200Mbit" / "bench.png").stat().st_size > 0
    assert [d["bandwidth_bps"] for d in loop["links"]] == [None, None]
    assert [link["link"] for link in loop["emulation"]["links"]] == ["loopback", "loopback"]
    assert loop["emulation"]["mechanisms"]["network"].startswith("not requested")
    assert [d["bandwidth_bps"] for d in rated["links"]] == [2e8, 2e8]
    for link in rated["emulation"]["links"]:
        assert link["emulated"] and link["bandwidth_by"] in ("tbf", "communication layer")
    # the same workload on both: same data, same loss up to fp32 reassociation
    assert rated["strategies"]["tp-even"]["losses"] == pytest.approx(
        loop["strategies"]["tp-even"]["losses"], rel=1e-4
    )

    doc = json.loads((out / "crossover.json").read_text())
    assert [e["link"] for e in doc["links"]] == ["loopback", "200Mbit"]
    assert [e["bandwidth_bps"] for e in doc["links"]] == [None, 2e8]
    assert doc["strategies"] == ["tp-even", "single"]
    for entry, bench in zip(doc["links"], (loop, rated), strict=True):
        rows = entry["strategies"]
        assert rows["single"]["step_over_single"] == pytest.approx(1.0)
        tp = bench["strategies"]["tp-even"]
        assert rows["tp-even"]["step_over_single"] == pytest.approx(1 / tp["speedup_vs_single"])
        assert rows["tp-even"]["step_time_s"] == pytest.approx(tp["step_time_s"])
        assert entry["emulation"]["network"] == bench["emulation"]["mechanisms"]["network"]
    assert (out / "crossover.png").read_bytes()[:4] == b"\x89PNG"

    table = [line for line in stdout.splitlines() if line.startswith("|")]
    assert table[0] == "| link | tp-even | single | auto's pick | single s/step |"
    assert [row.split(" | ")[0] for row in table[2:]] == ["| loopback", "| 200Mbit"]
