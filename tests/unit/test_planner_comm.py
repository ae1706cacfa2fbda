"""The communication model: LinkModel fits, the star network, TP traffic, old profiles."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xronos.config import small
from xronos.planner import SEGMENTS, plan_tp, predict
from xronos.planner.comm import LinkModel, Network, pair, ring, star_links, tp_traffic
from xronos.planner.profile import CostCurve, DeviceProfile, network_of

PER_UNIT = {"attn": 0.02, "mlp": 0.004, "vocab": 0.001}

latencies = st.floats(0.0, 0.01, allow_nan=False)
bandwidths = st.floats(1e6, 1e10, allow_nan=False)


def profile(name: str, speed: float, link: LinkModel | None, **kw: object) -> DeviceProfile:
    cfg = small()
    return DeviceProfile(
        name=name,
        segments={s: CostCurve(0.0, PER_UNIT[s] / speed) for s in SEGMENTS},
        replicated_s=0.02 / speed,
        link=link,
        traffic=tp_traffic(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, tokens=512),
        **kw,  # type: ignore[arg-type]
    )


@settings(max_examples=100, deadline=None)
@given(latencies, bandwidths, st.lists(st.integers(1, 10**7), min_size=2, max_size=5, unique=True))
def test_fit_recovers_latency_and_bandwidth_from_exact_points(
    lat: float, bw: float, sizes: list[int]
) -> None:
    fit = LinkModel.fit([(b, lat + b / bw) for b in sizes])
    # Exact points: only floating-point rounding of the least-squares sums separates the
    # fit from the truth; 1e-6 relative (plus 1e-9 s absolute for a ~0 latency) bounds it.
    assert fit.latency_s == pytest.approx(lat, rel=1e-6, abs=1e-9)
    assert fit.bandwidth_bps == pytest.approx(bw, rel=1e-6)


def test_fit_of_noise_stays_physical_and_needs_two_sizes() -> None:
    # A falling line (bytes cost nothing measurable) is an unbounded link, not a negative one.
    flat = LinkModel.fit([(100, 2e-3), (10_000, 1e-3)])
    assert flat.bandwidth_bps == math.inf and flat.latency_s == pytest.approx(1.5e-3)
    # A line through the origin's left (negative intercept) gets latency 0.
    assert LinkModel.fit([(1000, 1e-4), (2000, 3e-4)]).latency_s == 0.0
    with pytest.raises(ValueError, match="two sizes"):
        LinkModel.fit([(100, 1e-3), (100, 2e-3)])
    with pytest.raises(ValueError):
        LinkModel(-1.0, 1e9)


def test_ring_allreduce_is_two_n_minus_one_rounds_of_a_share() -> None:
    link = LinkModel(1e-3, 1e6)
    assert link.allreduce_s(8e6, 1) == 0.0
    # 4 ranks: 6 rounds of 2 MB at 1 MB/s, each with 1 ms latency.
    assert link.allreduce_s(8e6, 4) == pytest.approx(6 * (1e-3 + 2.0))
    a, b = LinkModel(1e-3, 1e9), LinkModel(2e-3, 1e8)
    assert pair(a, b) == LinkModel(3e-3, 1e8)
    assert ring([a, a, b]) == LinkModel(3e-3, 1e8)  # the slow member limits every round


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(latencies, bandwidths), min_size=2, max_size=5))
def test_star_links_predict_every_pair_exactly(devices: list[tuple[float, float]]) -> None:
    true = [LinkModel(lat, bw) for lat, bw in devices]
    n = len(true)
    pairs = {(i, j): pair(true[i], true[j]) for i, j in itertools.combinations(range(n), 2)}
    est = star_links(n, pairs)
    for (i, j), p in pairs.items():
        got = pair(est[i], est[j])
        # The latencies are a linear solve (exact up to rounding, 1e-9 s); bandwidths are
        # picked from the measured pairs, so they are exact.
        assert got.latency_s == pytest.approx(p.latency_s, abs=1e-9)
        assert got.bandwidth_bps == p.bandwidth_bps
    if n >= 3:  # three or more devices pin each device's own latency
        for e, t in zip(est, true, strict=True):
            assert e.latency_s == pytest.approx(t.latency_s, abs=1e-9)


def test_star_links_need_every_pair() -> None:
    with pytest.raises(ValueError, match="missing"):
        star_links(3, {(0, 1): LinkModel(0.0, 1e9)})


def test_network_uses_the_measured_group_and_the_star_for_subsets() -> None:
    links = (LinkModel(1e-4, 1.25e8), LinkModel(1e-4, 1.25e8), LinkModel(1e-4, 1.25e7))
    measured = LinkModel(0.5, 1e3)  # deliberately unlike the star, to see which is used
    net = Network(("a", "b", "c"), links, (("a", "b", "c"), measured))
    assert net.allreduce_s(1e3, ["c", "b", "a"]) == pytest.approx(1.5)
    # a and b only: the star's pair, one exchange of the whole tensor (2 x 0.1 ms latency).
    assert net.allreduce_s(1e6, ["a", "b"]) == pytest.approx(2e-4 + 1e6 / 1.25e8)
    # b and c: the pair at the slower link's rate
    assert net.allreduce_s(1e6, ["b", "c"]) == pytest.approx(2e-4 + 1e6 / 1.25e7)
    assert net.allreduce_s(1e6, ["a"]) == 0.0
    assert net.p2p_s(1e6, "a", "c") == pytest.approx(2e-4 + 1e6 / 1.25e7)
    assert net.p2p_s(1e6, "a", "a") == 0.0


def test_tp_traffic_is_four_activation_allreduces_per_layer() -> None:
    t = tp_traffic(num_layers=3, hidden_size=8, tokens=10, tied_embeddings=True)
    act = 4 * 10 * 8
    assert t["attn"] == [(6, act)] and t["mlp"] == [(6, act)]
    assert (1, act) in t["vocab"] and (1, act) in t["step"]
    assert sum(c for items in t.values() for c, b in items if b == act) == 4 * 3 + 2


def test_profile_links_round_trip_and_old_profiles_load() -> None:
    p = profile("a", 1.0, LinkModel(1e-4, math.inf), allreduce_fit=LinkModel(1e-3, 1e8))
    p = DeviceProfile.from_dict({**p.to_dict(), "allreduce_group": ["a", "b"]})
    back = DeviceProfile.from_dict(p.to_dict())
    assert back == p and back.link == LinkModel(1e-4, math.inf)
    old = {k: v for k, v in p.to_dict().items() if k not in ("link", "allreduce_fit", "traffic")}
    old.pop("allreduce_group")
    legacy = DeviceProfile.from_dict({**old, "allreduce_s": 0.01, "allreduces_per_step": 7})
    assert legacy.link is None and legacy.traffic == {} and legacy.allreduce_s == 0.01
    assert network_of([legacy]) is None


def test_old_profiles_predict_with_the_single_figure() -> None:
    cfg = small()
    old = [
        DeviceProfile.from_dict(
            {
                **profile(n, 1.0, None).to_dict(),
                "traffic": {},
                "allreduce_s": 0.01,
                "allreduces_per_step": 10,
            }
        )
        for n in ("a", "b")
    ]
    pred = predict(plan_tp(cfg, old), old)
    assert pred["transfer_s"] == pytest.approx(0.1)
    assert pred["step_time_s"] == pytest.approx(pred["compute_step_s"] + 0.1)


def test_transfer_enters_the_prediction_per_barrier() -> None:
    cfg = small()
    fast = [profile(n, s, LinkModel(1e-4, 1.25e9)) for n, s in (("a", 1.0), ("b", 0.4))]
    slow = [profile(n, s, LinkModel(1e-4, 1.25e7)) for n, s in (("a", 1.0), ("b", 0.4))]
    plan = plan_tp(cfg, fast)
    pf, ps = predict(plan, fast), predict(plan, slow)
    assert ps["compute_step_s"] == pytest.approx(pf["compute_step_s"])  # same compute
    assert ps["step_time_s"] > pf["step_time_s"] + 0.1  # 100x slower links: much more transfer
    for s in SEGMENTS:
        assert ps["segments"][s]["transfer_s"] > pf["segments"][s]["transfer_s"] > 0
    assert ps["step_time_s"] == pytest.approx(ps["compute_step_s"] + ps["transfer_s"])
    # One device moves nothing, whatever its link.
    solo = predict(plan_tp(cfg, slow[:1]), slow[:1])
    assert solo["transfer_s"] == 0.0


def test_bf16_payloads_halve_the_activation_all_reduces_only() -> None:
    from xronos.planner.profile import CostCurve, DeviceProfile, on_the_wire
    from xronos.run.opening import wire_bytes

    traffic = tp_traffic(num_layers=2, hidden_size=8, tokens=16, tied_embeddings=True)
    p = DeviceProfile(
        name="a",
        segments={s: CostCurve(0, 1) for s in ("attn", "mlp", "vocab")},
        replicated_s=0.0,
        traffic=traffic,
    )
    assert wire_bytes("fp32") == 4 and wire_bytes("bf16") == 2
    (half,) = on_the_wire([p], wire_bytes("bf16"))
    act = 4 * 16 * 8
    assert half.traffic["attn"] == [(4, act // 2)] and half.traffic["mlp"] == [(4, act // 2)]
    # the loss's statistics and the gradient norm keep their size; the embedding's
    # activation all-reduce (tied, vocab-parallel) is halved like the others
    assert half.traffic["vocab"] == [(1, act // 2), (1, 8 * 16)]
    assert half.traffic["step"] == [(1, 4), (1, act // 2)]
    assert on_the_wire([p], 4)[0].traffic == traffic


def test_a_bulk_point_prices_the_bytes_beyond_the_knee() -> None:
    # A shaped link: 64 KB pass at line rate (1 GB/s), the rest at 100 MB/s.
    def true_s(b: float) -> float:
        return 1e-4 + min(b, 65536) / 1e9 + max(0.0, b - 65536) / 1e8

    line = LinkModel.fit([(16384, true_s(16384)), (65536, true_s(65536))])
    big = 4 * 65536
    link = line.with_bulk(65536, big, true_s(big))
    assert link.knee_bytes == 65536 and link.bulk_bps == pytest.approx(1e8)
    for b in (1000.0, 65536.0, 1e6, 16.7e6):  # exact on the line and far beyond the knee
        assert link.p2p_s(b) == pytest.approx(true_s(b), rel=1e-9)
    assert line.p2p_s(16.7e6) < 0.2 * true_s(16.7e6)  # what the line alone would promise
    # a bulk message no slower than the line keeps the line
    assert line.with_bulk(65536, big, line.p2p_s(big)) == line
    assert LinkModel.from_dict(link.to_dict()) == link
    assert LinkModel.from_dict(line.to_dict()) == line


def test_the_narrower_sustained_rate_limits_pairs_rings_and_the_star() -> None:
    a = LinkModel(1e-4, 1e9, 65536, 1e8)
    b = LinkModel(2e-4, 5e8)  # no knee: 500 MB/s at every size
    p = pair(a, b)
    assert p.latency_s == pytest.approx(3e-4)  # the sum of two floats
    assert (p.bandwidth_bps, p.knee_bytes, p.bulk_bps) == (5e8, 65536, 1e8)
    assert ring([a, b, b]).sustained_bps == 1e8
    assert ring([b, b]).knee_bytes == math.inf
    links = star_links(2, {(0, 1): p})
    assert all(x.sustained_bps == 1e8 and x.knee_bytes == 65536 for x in links)
    assert pair(*links).p2p_s(1e7) == pytest.approx(p.p2p_s(1e7))


def test_weight_gradients_hide_the_backward_seams_up_to_their_share() -> None:
    from xronos.planner.comm import OVERLAP_SHARE, overlapped_seams

    cfg = small()
    traffic = tp_traffic(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, tokens=512)
    # One of each layer's two all-reduces at attn and mlp, the LM head's at vocab; never
    # the loss's statistics or the step's collectives.
    seams = overlapped_seams(traffic)
    assert seams == {"attn": 4, "mlp": 4, "vocab": 1}
    act = 4 * 512 * cfg.hidden_size
    capped: dict[float, set[str]] = {}
    for bw in (1.25e9, 1.25e7):  # 10 Gbit/s and 100 Mbit/s
        links = [profile(n, s, LinkModel(1e-4, bw)) for n, s in (("a", 1.0), ("b", 0.4))]
        net = network_of(links)
        assert net is not None
        pred = predict(plan_tp(cfg, links), links)
        one = net.allreduce_s(act, ["a", "b"])
        full = net.traffic_s(traffic, ["a", "b"])
        capped[bw] = set()
        for s, seg in pred["segments"].items():
            n = seams.get(s, 0)
            hidden = full[s] - seg["transfer_s"]
            # what hides: the seams' all-reduces, up to the weight gradients' share
            assert hidden == pytest.approx(min(n * one, OVERLAP_SHARE.get(s, 0) * seg["barrier_s"]))
            if hidden < n * one - 1e-12:
                capped[bw].add(s)
        assert pred["step_time_s"] == pytest.approx(
            pred["compute_step_s"] + pred["transfer_s"] + pred["sync_s"]
        )
    assert capped[1.25e9] == set()  # a fast link hides whole behind the weight gradients
    assert capped[1.25e7] == set(seams)  # a slow one only up to their share


def test_the_measured_overlap_loss_takes_its_share_of_what_the_seams_hide() -> None:
    cfg = small()
    plain = [profile(n, s, LinkModel(1e-4, 1.25e7)) for n, s in (("a", 1.0), ("b", 0.4))]
    base = predict(plan_tp(cfg, plain), plain)
    full = network_of(plain).traffic_s(plain[0].traffic, ["a", "b"])  # type: ignore[union-attr]
    hidden = {s: full[s] - seg["transfer_s"] for s, seg in base["segments"].items()}
    assert sum(hidden.values()) > 0
    for loss in (0.3, 1.0, 1.5):  # the group's, as measured: the largest of its devices'
        lossy = [replace(plain[0], overlap_loss=loss / 2), replace(plain[1], overlap_loss=loss)]
        pred = predict(plan_tp(cfg, lossy), lossy)
        for s, seg in pred["segments"].items():
            # the same barriers (compute is not touched), less of the transfer hidden: at
            # 1 nothing (one after the other), above 1 more than the collectives themselves
            assert seg["barrier_s"] == pytest.approx(base["segments"][s]["barrier_s"])
            assert seg["transfer_s"] == pytest.approx(full[s] - (1 - loss) * hidden[s])
    back = DeviceProfile.from_dict(replace(plain[1], overlap_loss=0.25).to_dict())
    assert back.overlap_loss == 0.25
    old = {k: v for k, v in plain[1].to_dict().items() if k != "overlap_loss"}
    assert DeviceProfile.from_dict(old).overlap_loss == 0.0  # before it was measured: free
