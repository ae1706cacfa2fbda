"""The built-in smart-home data set: determinism, honest held-out split, short and
learnable examples, and the exact-match metric."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from xronos.data import builtin_tokenizer, load_examples, smarthome
from xronos.data.smarthome import ROOMS, exact_match, generate, parse_action


@pytest.fixture(scope="module")
def train() -> list[smarthome.Example]:
    return generate("train", 3000, seed=0)


@pytest.fixture(scope="module")
def held_out() -> list[smarthome.Example]:
    return generate("eval", 800, seed=0)


def command(ex: smarthome.Example) -> str:
    match = re.fullmatch(r"command: (.*)\naction:", ex.prompt)
    assert match, ex.prompt
    return match.group(1)


def test_generation_is_deterministic(train: list[smarthome.Example]) -> None:
    assert generate("train", 3000, seed=0) == train
    assert generate("train", 100, seed=0) == train[:100]
    assert generate("train", 100, seed=1) != train[:100]


def test_train_and_eval_never_share_a_command(
    train: list[smarthome.Example], held_out: list[smarthome.Example]
) -> None:
    def key(ex: smarthome.Example) -> str:
        return " ".join(command(ex).lower().strip(".!?").split())

    assert len({command(ex) for ex in train}) == len(train)  # distinct within a split
    assert not {key(ex) for ex in train} & {key(ex) for ex in generate("eval", 800, seed=7)}
    assert not {key(ex) for ex in held_out} & {key(ex) for ex in generate("train", 3000, seed=9)}


def test_both_splits_cover_every_intent_and_slot_value(
    train: list[smarthome.Example], held_out: list[smarthome.Example]
) -> None:
    def actions(examples: list[smarthome.Example]) -> list[tuple[str, dict[str, str]]]:
        parsed = [parse_action(ex.completion) for ex in examples]
        assert None not in parsed
        return parsed  # type: ignore[return-value]

    verbs = {"turn_on", "turn_off", "set", "open", "close", "lock", "unlock", "schedule"}
    assert {v for v, _ in actions(train)} == {v for v, _ in actions(held_out)} == verbs
    train_slots = {f"{k}={v}" for _, args in actions(train) for k, v in args.items()}
    for _, args in actions(held_out):  # eval recombines slot values seen in training
        assert {f"{k}={v}" for k, v in args.items() if k != "time"} <= train_slots


def test_actions_follow_from_words_in_the_command(train: list[smarthome.Example]) -> None:
    for ex in train:
        text = command(ex).lower()
        parsed = parse_action(ex.completion)
        assert parsed is not None and ex.completion.startswith(" ")
        verb, args = parsed
        if "room" in args:
            assert any(re.search(rf"\b{p}\b", text) for p in ROOMS[args["room"]]), ex
        if "value" in args:
            assert re.search(rf"\b{args['value']}\b", text), ex
        if verb == "schedule":
            hour, minute = map(int, args["time"].split(":"))
            spoken = f"{(hour - 1) % 12 + 1}(:{minute:02d})? ?{'pm' if hour >= 12 else 'am'}"
            assert re.search(rf"\bat {spoken}\b", text), ex


def test_examples_are_short_with_the_builtin_tokenizer(
    train: list[smarthome.Example], held_out: list[smarthome.Example]
) -> None:
    tok = builtin_tokenizer()
    lengths = [len(tok.encode(ex.text)) + 2 for ex in train + held_out]  # + BOS and EOS
    assert max(lengths) <= 56
    assert sum(lengths) / len(lengths) <= 36


def test_builtin_tokenizer_round_trips_every_example(
    train: list[smarthome.Example], held_out: list[smarthome.Example]
) -> None:
    tok = builtin_tokenizer()
    for ex in train + held_out:
        ids = tok.encode(ex.completion)
        assert tok.decode(ids) == ex.completion
        assert tok.backend.token_to_id("<unk>") not in ids
        assert tok.decode(tok.encode(ex.text)) == ex.text


def test_exact_match_ignores_whitespace_only() -> None:
    refs = ["turn_on(device=light, room=kitchen)", "lock(device=front_door)"]
    assert (
        exact_match(["turn_on(device=light,room=kitchen) ", "lock(device=back_door)"], refs) == 0.5
    )
    assert exact_match([" turn_on( device=light, room=kitchen)", refs[1]], refs) == 1.0
    assert exact_match(["Turn_on(device=light, room=kitchen)", ""], refs) == 0.0
    with pytest.raises(ValueError):
        exact_match(["x"], refs)


def test_parse_action() -> None:
    assert parse_action(" set(device=light, room=hall, value=30)") == (
        "set",
        {"device": "light", "room": "hall", "value": "30"},
    )
    assert parse_action("lock()") == ("lock", {})
    for bad in ("set(device=light", "set(device)", "set(=x)", "turn on the light"):
        assert parse_action(bad) is None


def test_write_jsonl_exports_a_loadable_file(
    tmp_path: Path, held_out: list[smarthome.Example]
) -> None:
    path = tmp_path / "smarthome.jsonl"
    smarthome.write_jsonl(path, held_out[:20])
    assert path.read_text().startswith('{"prompt": "command: ')
    loaded = load_examples(path)
    assert [ex.segments for ex in loaded] == [ex.segments for ex in held_out[:20]]
