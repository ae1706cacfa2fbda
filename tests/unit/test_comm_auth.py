"""Admission of devices by token: the HMAC exchange over a real TCPStore on localhost, one
thread per rank (each with its own store connection, as separate machines would have)."""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from xronos.comm.auth import Identity, Join, admit, local_identity
from xronos.comm.job_token import load_token
from xronos.errors import UserError

TOKEN = b"correct-horse-battery-staple-0123"
WRONG = b"incorrect-horse-battery-staple-99"
TIMEOUT = datetime.timedelta(seconds=20)
JOIN_S = 1.0
"""The join timeout where a refusal makes the others wait it out: every exchange here runs
over a store on this host and takes milliseconds, so one second is still far above it."""


@pytest.fixture
def server() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, TIMEOUT, wait_for_workers=False)
    yield store


def _client(server: dist.TCPStore, prefix: str) -> dist.Store:
    store = dist.TCPStore("127.0.0.1", server.port, 1, False, TIMEOUT)
    return dist.PrefixStore(prefix, store)


def _run(
    server: dist.TCPStore,
    secrets: list[bytes | None],
    *,
    timeout_s: float = 10.0,
    identities: dict[int, Identity] | None = None,
    prefix: str = "job",
    coordinator: int = 0,
) -> tuple[dict[int, BaseException | None], list[str]]:
    """Every rank's admission at once; each rank's exception (None: admitted) and the lines
    the coordinator logged."""
    world, logged = len(secrets), []
    outcome: dict[int, BaseException | None] = {}

    def rank(r: int) -> None:
        join = Join(
            _client(server, prefix),
            r,
            world,
            f"dev{r}",
            secrets[r],
            timeout_s,
            identity=(identities or {}).get(r, local_identity()),
            log=logged.append,
            coordinator=coordinator,
        )
        try:
            admit(join)
            outcome[r] = None
        except BaseException as e:
            outcome[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 15)
        assert not t.is_alive(), "a rank hung past its join timeout"
    return outcome, logged


def test_devices_with_the_token_are_admitted(server: dist.TCPStore) -> None:
    outcome, logged = _run(server, [TOKEN, TOKEN, TOKEN])
    assert outcome == {0: None, 1: None, 2: None}
    assert logged == []


def test_the_coordinator_checks_the_others_whatever_its_rank(server: dist.TCPStore) -> None:
    # torchrun put the coordinator (the device with the options) at rank 2 and a device
    # with a wrong token at rank 0: the coordinator refuses rank 0, not the other way round
    outcome, logged = _run(server, [WRONG, TOKEN, TOKEN], timeout_s=JOIN_S, coordinator=2)
    assert str(outcome[0]).startswith("device 'dev0': the coordinator refused this device's")
    assert "rank 0 ('dev0') was refused: its token does not match" in str(outcome[2])
    assert "waiting for rank 0 ('dev0')" in str(outcome[1])
    assert any("rank 0" in line and "token does not match" in line for line in logged)


def test_a_wrong_token_is_refused_and_the_others_stop_at_the_join_timeout(
    server: dist.TCPStore,
) -> None:
    t0 = time.monotonic()
    outcome, logged = _run(server, [TOKEN, TOKEN, WRONG], timeout_s=JOIN_S)
    took = time.monotonic() - t0
    refused = outcome[2]
    assert isinstance(refused, UserError)
    assert str(refused) == (
        "device 'dev2': the coordinator refused this device's token; "
        "give the job's token via XRONOS_TOKEN or --token-file"
    )
    for r in (0, 1):  # the invited devices stop cleanly, not by a torch error
        assert isinstance(outcome[r], UserError), outcome[r]
        assert "not every device joined within 1 s" in str(outcome[r])
    assert "rank 2 ('dev2') was refused: its token does not match" in str(outcome[0])
    assert "waiting for rank 2 ('dev2')" in str(outcome[1])
    assert any("rank 2" in line and "token does not match" in line for line in logged)
    assert JOIN_S <= took < JOIN_S + 20  # the join timeout, plus start-up on a busy machine


def test_a_missing_token_is_refused(server: dist.TCPStore) -> None:
    outcome, _ = _run(server, [TOKEN, None], timeout_s=JOIN_S)
    assert "refused this device's token" in str(outcome[1])
    assert isinstance(outcome[0], UserError)


def test_a_token_the_coordinator_lacks_is_named(server: dist.TCPStore) -> None:
    outcome, _ = _run(server, [None, TOKEN], timeout_s=JOIN_S)
    assert "the coordinator has no token but this device has one" in str(outcome[1])


def test_without_any_token_devices_join(server: dist.TCPStore) -> None:
    outcome, _ = _run(server, [None, None])
    assert outcome == {0: None, 1: None}


def test_a_refused_rank_can_come_back_with_the_token(server: dist.TCPStore) -> None:
    results: dict[str, BaseException | None] = {}

    def coordinator() -> None:
        join = Join(_client(server, "j"), 0, 2, "hub", TOKEN, 10.0, log=lambda _: None)
        try:
            admit(join)
            results["hub"] = None
        except BaseException as e:
            results["hub"] = e

    t = threading.Thread(target=coordinator, daemon=True)
    t.start()
    with pytest.raises(UserError, match="refused this device's token"):
        admit(Join(_client(server, "j"), 1, 2, "pi", WRONG, 10.0))
    admit(Join(_client(server, "j"), 1, 2, "pi", TOKEN, 10.0))  # a new start at that rank
    t.join(15)
    assert results == {"hub": None}


def test_a_replayed_answer_does_not_fool_the_coordinator(server: dist.TCPStore) -> None:
    # a good exchange that an eavesdropper on the store records
    assert _run(server, [TOKEN, TOKEN], prefix="run1")[0] == {0: None, 1: None}
    old = _client(server, "run1")
    hello, proof = json.loads(old.get("hello/1")), json.loads(old.get("proof/1"))
    first_n0 = json.loads(old.get("challenge/1"))["nonce"]

    # the next run: the eavesdropper replays the recorded hello and proof at rank 1
    results: dict[str, BaseException | None] = {}

    def coordinator() -> None:
        try:
            admit(Join(_client(server, "run2"), 0, 2, "hub", TOKEN, JOIN_S, log=lambda _: None))
            results["hub"] = None
        except BaseException as e:
            results["hub"] = e

    t = threading.Thread(target=coordinator, daemon=True)
    t.start()
    attacker = _client(server, "run2")
    attacker.set("hello/1", json.dumps(hello))
    challenge = json.loads(attacker.get("challenge/1"))  # waits for the coordinator
    assert challenge["echo"] == hello["nonce"]
    assert challenge["nonce"] != first_n0  # a fresh nonce every run
    attacker.set("proof/1", json.dumps({"echo": challenge["nonce"], "mac": proof["mac"]}))
    t.join(15)
    assert isinstance(results["hub"], UserError)
    assert "token does not match" in str(results["hub"])
    assert json.loads(attacker.get("verdict/1"))["state"] == "refused"


def test_a_coordinator_without_the_token_is_not_trusted(server: dist.TCPStore) -> None:
    """Something that answers at rank 0 and then claims the device was admitted."""
    fake = _client(server, "j")

    def impostor() -> None:
        hello = json.loads(fake.get("hello/1"))
        ident = local_identity()
        fake.set(
            "challenge/1",
            json.dumps(
                {
                    "echo": hello["nonce"],
                    "nonce": "00" * 16,
                    "xronos": ident.xronos,
                    "torch": ident.torch,
                    "token": True,
                    "mac": "ab" * 32,
                }
            ),
        )
        fake.get("proof/1")
        fake.set("verdict/1", json.dumps({"echo": hello["nonce"], "state": "admitted"}))

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    with pytest.raises(UserError, match="do not match this device's token; not joining"):
        admit(Join(_client(server, "j"), 1, 2, "pi", TOKEN, 5.0))
    t.join(5)


@pytest.mark.parametrize(
    ("theirs", "named"),
    [
        (Identity("0.0.9", local_identity().torch), "Xronos 0.0.9 (this device) vs "),
        (Identity(local_identity().xronos, "1.13.1"), "torch 1.13.1 (this device) vs "),
    ],
)
def test_a_version_mismatch_is_refused_naming_both(
    server: dist.TCPStore, theirs: Identity, named: str
) -> None:
    outcome, logged = _run(server, [TOKEN, TOKEN], timeout_s=JOIN_S, identities={1: theirs})
    ours = local_identity()
    mine = ours.xronos if named.startswith("Xronos") else ours.torch
    assert isinstance(outcome[1], UserError)
    assert f"{named}{mine} (the coordinator)" in str(outcome[1])
    assert isinstance(outcome[0], UserError)
    line = "\n".join(logged)
    assert "rank 1 ('dev1') was refused: it runs" in line
    assert mine in line and named.split()[1] in line


def test_torch_builds_of_one_release_match() -> None:
    assert Identity("0.1.0", "2.5.1").mismatch(Identity("0.1.0", "2.5.1+cpu")) is None
    assert Identity("0.1.0", "2.5.1").mismatch(Identity("0.1.0", "2.5.0+cpu")) is not None


def test_token_from_the_first_line_of_a_private_file(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("  s3cret-s3cret-s3cret  \nsecond line\n")
    f.chmod(0o600)
    env = {"XRONOS_TOKEN": "from-the-environment-0123"}
    assert load_token(str(f), env) == b"s3cret-s3cret-s3cret"  # the file wins
    assert load_token(None, env) == b"from-the-environment-0123"
    assert load_token(None, {}) is None
    assert load_token(None, {"XRONOS_TOKEN": "  "}) is None


def test_a_token_file_every_user_can_read_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "token"
    f.write_text("s3cret-s3cret-s3cret\n")
    f.chmod(0o644)
    with pytest.raises(UserError, match=r"every user \(mode 644\); restrict it with `chmod 600"):
        load_token(str(f), {})
    f.chmod(0o640)
    assert load_token(str(f), {}) == b"s3cret-s3cret-s3cret"
    assert "can be read by its group (mode 640)" in capsys.readouterr().err


def test_short_empty_and_missing_tokens_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="has 5 characters; use at least 16"):
        load_token(None, {"XRONOS_TOKEN": "short"})
    f = tmp_path / "token"
    f.write_text("\n")
    f.chmod(0o600)
    with pytest.raises(UserError, match="is empty"):
        load_token(str(f), {})
    with pytest.raises(UserError, match="cannot read token file"):
        load_token(str(tmp_path / "nope"), {})


def test_the_device_given_the_options_coordinates() -> None:
    from xronos.comm.roles import coordinator_order

    none, hub = {"lead": False, "options": "x"}, {"lead": True, "options": "abc"}
    assert coordinator_order([none, none, hub]) == [2, 0, 1]
    assert coordinator_order([none, none]) == [0, 1]  # no options anywhere: the defaults
    assert coordinator_order([hub, none, hub]) == [0, 1, 2]  # started alike: the first
    with pytest.raises(UserError, match=r"ranks \[0, 2\] were each started with different"):
        coordinator_order([hub, none, {"lead": True, "options": "other"}])
