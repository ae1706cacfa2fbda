"""The built-in domain data set: smart-home commands -> structured actions.

Each example maps a command in natural, varied phrasing to one action string::

    could you shut off the lounge lamp please    ->  turn_off(device=light, room=living_room)
    dim the hall light to 30 percent             ->  set(device=light, room=hallway, value=30)
    at 7:30 pm, kitchen coffee maker on          ->  schedule(action=turn_on, device=coffee_maker,
                                                              room=kitchen, time=19:30)

The prompt (``command: ...\\naction:``) is masked from the loss; the completion is a space
and the action. Commands vary by template, synonyms ("lounge" = living room, "lamp" =
light), politeness, capitalisation, punctuation and deterministic typos — the typos touch
only filler words ("please", "turn", "the"), so the action stays a function of the words
that carry meaning and a small model can learn it.

**Held-out split.** Whether a command belongs to ``train`` or ``eval`` is decided by a
hash of (intent, template, action): every phrasing of one (template, action) pair lands
in the same split, so no eval command appears in train, not even with other politeness,
synonyms or typos. Eval tests the same intents, rooms and devices in unseen combinations
with the templates. The split does not depend on ``seed``; ``seed`` only picks which
commands are drawn.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from xronos.data.formats import Example, save_jsonl
from xronos.errors import UserError

PROMPT_TEMPLATE = "command: {command}\naction:"
EVAL_PERCENT = 20
"""Share of (intent, template, action) combinations held out for ``eval``."""

ROOMS: dict[str, tuple[str, ...]] = {
    "kitchen": ("kitchen",),
    "living_room": ("living room", "lounge"),
    "bedroom": ("bedroom",),
    "bathroom": ("bathroom",),
    "office": ("office", "study"),
    "hallway": ("hallway", "hall"),
    "dining_room": ("dining room",),
    "kids_room": ("kids room", "nursery"),
    "garage": ("garage",),
}
SWITCHABLE: dict[str, tuple[str, ...]] = {
    "light": ("light", "lights", "lamp"),
    "fan": ("fan", "ceiling fan"),
    "tv": ("tv", "television"),
    "speaker": ("speaker", "music"),
    "heater": ("heater", "radiator"),
    "air_conditioner": ("air conditioner", "ac"),
    "coffee_maker": ("coffee maker", "coffee machine"),
}
LIGHTS = {"light": SWITCHABLE["light"]}
THERMOSTAT = {"thermostat": ("thermostat",)}
AUDIO = {"speaker": ("speaker",), "tv": ("tv", "television")}
OPENABLE = {"blinds": ("blinds", "shades"), "curtains": ("curtains",), "window": ("window",)}
DOORS = {
    "front_door": ("front door",),
    "back_door": ("back door",),
    "side_door": ("side door",),
    "garage_door": ("garage door",),
    "gate": ("gate", "garden gate"),
}

TURN_ON = (
    "turn on the {room} {device}",
    "turn the {device} in the {room} on",
    "switch on the {device} in the {room}",
    "switch the {room} {device} on",
    "power up the {room} {device}",
    "{room} {device} on",
    "i want the {device} on in the {room}",
    "put the {room} {device} on",
)
TURN_OFF = (
    "turn off the {room} {device}",
    "turn the {device} in the {room} off",
    "switch off the {device} in the {room}",
    "shut off the {room} {device}",
    "power down the {device} in the {room}",
    "{room} {device} off",
    "i want the {device} off in the {room}",
    "kill the {room} {device}",
)


@dataclass(frozen=True)
class Intent:
    """One kind of command: its action verb, phrasings and slot values."""

    name: str
    verb: str
    templates: tuple[str, ...]
    devices: Mapping[str, tuple[str, ...]]
    rooms: bool = True
    values: tuple[int, ...] = ()
    weight: float = 1.0


INTENTS = (
    Intent("turn_on", "turn_on", TURN_ON, SWITCHABLE, weight=3),
    Intent("turn_off", "turn_off", TURN_OFF, SWITCHABLE, weight=3),
    Intent(
        "brightness",
        "set",
        (
            "dim the {room} {device} to {value} percent",
            "set the {device} in the {room} to {value}%",
            "{room} {device} at {value} percent",
            "brightness of the {room} {device} to {value}",
            "make the {device} in the {room} {value} percent bright",
        ),
        LIGHTS,
        values=tuple(range(10, 101, 10)),
        weight=1.5,
    ),
    Intent(
        "temperature",
        "set",
        (
            "set the {room} {device} to {value} degrees",
            "make it {value} degrees in the {room}",
            "heat the {room} to {value}",
            "{room} temperature {value}",
            "change the {device} in the {room} to {value}",
            "i want {value} degrees in the {room}",
        ),
        THERMOSTAT,
        values=tuple(range(16, 29)),
        weight=1.5,
    ),
    Intent(
        "volume",
        "set",
        (
            "set the {room} {device} volume to {value}",
            "volume {value} on the {device} in the {room}",
            "turn the {room} {device} to volume {value}",
        ),
        AUDIO,
        values=tuple(range(10, 101, 10)),
    ),
    Intent(
        "open",
        "open",
        (
            "open the {room} {device}",
            "open the {device} in the {room}",
            "open up the {room} {device}",
            "{room} {device} open",
        ),
        OPENABLE,
    ),
    Intent(
        "close",
        "close",
        (
            "close the {room} {device}",
            "close the {device} in the {room}",
            "shut the {room} {device}",
            "{room} {device} closed",
        ),
        OPENABLE,
    ),
    Intent(
        "lock",
        "lock",
        (
            "lock the {device}",
            "make sure the {device} is locked",
            "secure the {device}",
            "lock up the {device}",
            "lock the {device} for the night",
        ),
        DOORS,
        rooms=False,
        weight=0.5,
    ),
    Intent(
        "unlock",
        "unlock",
        (
            "unlock the {device}",
            "open the lock on the {device}",
            "{device} unlock",
            "unbolt the {device}",
            "let me in through the {device}",
        ),
        DOORS,
        rooms=False,
        weight=0.5,
    ),
)
SCHEDULE_WEIGHT = 2.0
SCHEDULE_PLACEMENTS = ("{command} at {time}", "at {time}, {command}", "at {time} {command}")

PREFIXES = (
    "",
    "",
    "",
    "please ",
    "could you ",
    "can you ",
    "would you please ",
    "hey, ",
    "kindly ",
)
#: Prefixes for commands that do not open with a verb ("{room} {device} on", "at 7 pm, ...").
PLAIN_PREFIXES = ("", "", "", "hey, ", "please, ")
SUFFIXES = ("", "", "", " please", " thanks", " now", " for me", " thank you")
VERBS: frozenset[str] = frozenset().union(
    ("turn", "switch", "power", "put", "shut", "kill"),  # on and off
    ("dim", "set", "make", "heat", "change"),  # values
    ("open", "close", "lock", "unlock", "secure", "unbolt", "let"),  # openings and locks
)
#: Filler words that may get a typo: none of them decides the action.
TYPO_WORDS: frozenset[str] = frozenset().union(
    ("please", "could", "would", "kindly", "thanks", "thank"),  # politeness
    ("turn", "switch", "power", "want", "make", "sure", "the", "you"),  # verbs and fillers
)
TYPO_RATE = 0.15


@dataclass(frozen=True)
class Command:
    """One sampled command before its surface variations."""

    text: str
    action: str
    key: str
    """(intent, template, action): decides the split."""
    scheduled: bool = False


def _sample_slots(rng: random.Random, intent: Intent) -> tuple[str, dict[str, str]]:
    """(the action's arguments, the template's fields)."""
    device = rng.choice(sorted(intent.devices))
    kwargs = {"device": rng.choice(intent.devices[device])}
    slots = [f"device={device}"]
    if intent.rooms:
        room = rng.choice(sorted(ROOMS))
        kwargs["room"] = rng.choice(ROOMS[room])
        slots.append(f"room={room}")
    if intent.values:
        value = rng.choice(intent.values)
        kwargs["value"] = str(value)
        slots.append(f"value={value}")
    return ", ".join(slots), kwargs


def _time(rng: random.Random) -> tuple[str, str]:
    """(spoken time, 24-hour ``HH:MM``)."""
    hour, minute, half = rng.randint(1, 12), rng.choice((0, 15, 30, 45)), rng.choice(("am", "pm"))
    h24 = hour % 12 + (12 if half == "pm" else 0)
    if minute:
        spoken = f"{hour}:{minute:02d} {half}"
    else:
        spoken = rng.choice((f"{hour} {half}", f"{hour}{half}", f"{hour}:00 {half}"))
    return spoken, f"{h24:02d}:{minute:02d}"


def sample_command(rng: random.Random) -> Command:
    """Draw one command (intent, template, slots) without surface variations."""
    weights = [i.weight for i in INTENTS] + [SCHEDULE_WEIGHT]
    pick = rng.choices(range(len(INTENTS) + 1), weights)[0]
    scheduled = pick == len(INTENTS)
    intent = INTENTS[rng.randrange(2)] if scheduled else INTENTS[pick]  # turn_on or turn_off
    t = rng.randrange(len(intent.templates))
    slots, kwargs = _sample_slots(rng, intent)
    text = intent.templates[t].format(**kwargs)
    action = f"{intent.verb}({slots})"
    key = f"{intent.name}:{t}"
    if scheduled:
        p = rng.randrange(len(SCHEDULE_PLACEMENTS))
        spoken, hhmm = _time(rng)
        text = SCHEDULE_PLACEMENTS[p].format(command=text, time=spoken)
        action = f"schedule(action={intent.verb}, {slots}, time={hhmm})"
        key = f"schedule:{key}:{p}"
    return Command(text, action, f"{key}|{action}", scheduled)


def split_of(key: str) -> str:
    """``"eval"`` for EVAL_PERCENT % of keys (by a stable hash), else ``"train"``."""
    digest = hashlib.sha256(f"xronos-smarthome|{key}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % 100 < EVAL_PERCENT else "train"


def _typo(rng: random.Random, word: str) -> str:
    i = rng.randrange(len(word) - 1)
    kind = rng.randrange(3)
    if kind == 0:  # swap two neighbours
        return word[:i] + word[i + 1] + word[i] + word[i + 2 :]
    if kind == 1:  # drop one
        return word[:i] + word[i + 1 :]
    return word[: i + 1] + word[i] + word[i + 1 :]  # double one


def vary(rng: random.Random, text: str, suffix: bool = True) -> str:
    """Politeness, a typo in a filler word, capitalisation and punctuation."""
    prefix = rng.choice(PREFIXES if text.split(" ", 1)[0] in VERBS else PLAIN_PREFIXES)
    suffix_text = rng.choice(SUFFIXES) if suffix else ""
    words = f"{prefix}{text}{suffix_text}".split(" ")
    fillers = [i for i, w in enumerate(words) if w in TYPO_WORDS]
    if fillers and rng.random() < TYPO_RATE:
        i = rng.choice(fillers)
        words[i] = _typo(rng, words[i])
    out = " ".join(words)
    if rng.random() < 0.25:
        out = out[0].upper() + out[1:]
    question = prefix.startswith(("could", "can", "would"))
    return out + rng.choice(("", "", "?" if question else ".", "!" if not question else ""))


def example(command: str, action: str, source: str = "") -> Example:
    """The prompt/completion pair for one command."""
    return Example.from_prompt(PROMPT_TEMPLATE.format(command=command), f" {action}", source)


def generate(split: str, n: int, seed: int = 0) -> list[Example]:
    """``n`` distinct examples of ``split`` (``"train"`` or ``"eval"``), deterministic in
    (split, n, seed); the two splits never share a command."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    rng = random.Random(f"xronos-smarthome:{split}:{seed}")
    seen: set[str] = set()
    out: list[Example] = []
    for _ in range(200 * n + 1000):
        if len(out) == n:
            return out
        cmd = sample_command(rng)
        if split_of(cmd.key) != split:
            continue
        text = vary(rng, cmd.text, suffix=not cmd.scheduled)
        if text not in seen:
            seen.add(text)
            out.append(example(text, cmd.action, f"smarthome:{split}:{len(out)}"))
    raise UserError(f"the built-in data set has too few distinct {split} commands for {n}")


def normalize(action: str) -> str:
    """An action string without whitespace (for comparison)."""
    return "".join(action.split())


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Fraction of predictions equal to their reference, ignoring whitespace."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not references:
        raise ValueError("exact_match needs at least one reference")
    hits = sum(normalize(p) == normalize(r) for p, r in zip(predictions, references, strict=True))
    return hits / len(references)


_ACTION = re.compile(r"^\s*(\w+)\((.*)\)\s*$", re.DOTALL)


def parse_action(action: str) -> tuple[str, dict[str, str]] | None:
    """``"set(device=light, value=30)"`` -> ``("set", {"device": "light", "value": "30"})``;
    None when the string is not a well-formed action."""
    m = _ACTION.match(action)
    if m is None:
        return None
    args: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in m.group(2).split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip().isidentifier() or not value.strip():
            return None
        args[key.strip()] = value.strip()
    return m.group(1), args


def write_jsonl(path: str | Path, examples: Sequence[Example]) -> None:
    """Export examples as ``{"prompt", "completion"}`` JSONL (the format users can copy)."""
    save_jsonl(path, examples)
