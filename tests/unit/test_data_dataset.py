"""Tokenising examples into (input_ids, labels), truncation, splitting and batching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xronos.data import (
    IGNORE_INDEX,
    Batcher,
    Example,
    TokenizedDataset,
    Tokenizer,
    builtin_tokenizer,
    encode_prompt,
    load_examples,
    smarthome,
    split_train_eval,
    tokenize,
)
from xronos.data.formats import chat_example
from xronos.errors import UserError


def test_labels_mask_exactly_the_prompt() -> None:
    tok = builtin_tokenizer()
    examples = smarthome.generate("train", 50)
    ds = tokenize(examples, tok, seq_len=64)
    assert len(ds) == 50
    for ex, ids, labels in zip(examples, ds.input_ids, ds.labels, strict=True):
        prompt = encode_prompt(tok, ex.prompt)  # BOS + prompt tokens
        completion = tok.encode(ex.completion)
        assert ids == [*prompt, *completion, tok.eos_id]
        assert labels == [IGNORE_INDEX] * len(prompt) + [*completion, tok.eos_id]


def test_text_examples_train_on_everything_but_bos() -> None:
    tok = builtin_tokenizer()
    ds = tokenize([Example.from_text("turn on the light")], tok, seq_len=32)
    (ids,), (labels,) = ds.input_ids, ds.labels
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert labels == [IGNORE_INDEX, *ids[1:]]


def test_a_token_straddling_prompt_and_completion_is_trained_on() -> None:
    tok = builtin_tokenizer()
    (labels,) = tokenize([Example.from_prompt("x turn_", "on")], tok, 16).labels
    turn_on = tok.backend.token_to_id("▁turn_on")
    # <bos> "x" "▁turn_on" <eos>: one token that begins in the prompt and ends in the completion.
    ids = [tok.bos_id, *tok.encode("x turn_on"), tok.eos_id]
    assert turn_on in ids
    assert labels == [x if x in (turn_on, tok.eos_id) else IGNORE_INDEX for x in ids]


def test_chat_masks_all_but_assistant_content_and_end_token(tmp_path: Path) -> None:
    tok = builtin_tokenizer()
    path = tmp_path / "chat.jsonl"
    path.write_text(
        '{"messages": [{"role": "user", "content": "hall lights on"}, '
        '{"role": "assistant", "content": "turn_on(device=light)"}, '
        '{"role": "user", "content": "and off"}, {"role": "assistant", "content": "ok"}]}\n'
    )
    ds = tokenize(load_examples(path, tok), tok, seq_len=64)
    (ids,), (labels,) = ds.input_ids, ds.labels
    assert ids.count(1) == 1 and tok.bos_id == 1  # the template's BOS, none added on top
    trained = [x for x in labels if x != IGNORE_INDEX]
    assert tok.decode(trained, skip_special_tokens=False) == " turn_on(device=light)<eos> ok<eos>"
    assert ids[-1] == tok.eos_id  # the template's end-of-turn; no extra EOS appended


def test_chat_gets_no_bos_beyond_what_its_template_writes() -> None:
    builtin = builtin_tokenizer()
    no_bos_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    )
    tok = Tokenizer(
        builtin.backend,
        special_tokens={"bos": "<bos>", "eos": "<eos>"},
        chat_template=no_bos_template,
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    (ids,) = tokenize([chat_example(messages, "x:1", tok)], tok, 32).input_ids
    assert tok.bos_id == 1 and 1 not in ids
    assert ids == tok.encode(tok.apply_chat_template(messages))


def test_truncation_modes_count_what_they_did() -> None:
    tok = builtin_tokenizer()
    examples = smarthome.generate("train", 200)
    lengths = [len(tok.encode(ex.text)) + 2 for ex in examples]  # + BOS and EOS
    seq_len = sorted(lengths)[100]
    too_long = sum(n > seq_len for n in lengths)
    assert 0 < too_long < 200

    cut = tokenize(examples, tok, seq_len, "truncate")
    assert cut.num_truncated == too_long and cut.num_dropped == 0
    assert len(cut) == 200 - cut.num_no_target
    assert max(map(len, cut.input_ids)) == seq_len

    dropped = tokenize(examples, tok, seq_len, "drop")
    assert dropped.num_dropped == too_long and len(dropped) == 200 - too_long
    assert sorted(map(len, dropped.input_ids)) == sorted(n for n in lengths if n <= seq_len)
    assert f"{too_long} dropped as too long" in dropped.summary()

    with pytest.raises(UserError) as info:
        tokenize(examples, tok, seq_len, "error")
    first = next(ex for ex, n in zip(examples, lengths, strict=True) if n > seq_len)
    assert str(info.value).startswith(f"{first.source}: ")
    assert f"longer than --seq-len {seq_len}" in str(info.value)


def test_a_prompt_filling_seq_len_leaves_nothing_to_train() -> None:
    tok = builtin_tokenizer()
    examples = [Example.from_prompt("one two three four five six", " x"), Example.from_text("a")]
    ds = tokenize(examples, tok, seq_len=4)
    assert (len(ds), ds.num_no_target, ds.num_truncated) == (1, 1, 1)


def test_all_dropped_is_a_user_error() -> None:
    tok = builtin_tokenizer()
    examples = smarthome.generate("train", 5)
    with pytest.raises(UserError) as info:
        tokenize(examples, tok, seq_len=8, truncation="drop")
    assert str(info.value) == (
        "all 5 examples are longer than --seq-len 8; raise --seq-len or use --truncation truncate"
    )
    with pytest.raises(UserError, match="--truncation 'cut'"):
        tokenize(examples, tok, 8, truncation="cut")  # type: ignore[arg-type]


# -- split ----------------------------------------------------------------------------------
def test_split_is_deterministic_and_disjoint() -> None:
    items = list(range(100))
    train, held = split_train_eval(items, 0.1, seed=3)
    assert len(held) == 10 and sorted(train + held) == items
    assert split_train_eval(items, 0.1, seed=3) == (train, held)
    assert split_train_eval(items, 0.1, seed=4)[1] != held
    assert split_train_eval(items, 0.0) == (items, [])
    with pytest.raises(UserError, match="too few"):
        split_train_eval([1], 0.5)


def test_split_of_a_tokenized_dataset_keeps_rows_together() -> None:
    ds = toy_dataset(20)
    train, held = split_train_eval(ds, 0.25, seed=0)
    assert (len(train), len(held)) == (15, 5)
    assert all(ids == labels for ids, labels in zip(held.input_ids, held.labels, strict=True))
    assert sorted(r[0] for r in train.input_ids + held.input_ids) == [100 + i for i in range(20)]


# -- batching -------------------------------------------------------------------------------
def toy_dataset(n: int, seq_len: int = 8) -> TokenizedDataset:
    """Example i is [100 + i] * (i % 5 + 2), with equal labels: rows identify examples."""
    rows = [[100 + i] * (i % 5 + 2) for i in range(n)]
    return TokenizedDataset(rows, [list(r) for r in rows], seq_len, num_examples=n)


def example_ids(batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    return [int(x) - 100 for x in batch[0][:, 0]]


def test_batches_pad_to_fixed_or_longest() -> None:
    ds = toy_dataset(6)
    input_ids, labels = Batcher(ds, 3, seed=0, pad_id=7, shuffle=False).next_batch()
    assert input_ids.shape == labels.shape == (3, 8) and input_ids.dtype == torch.long
    assert input_ids[0].tolist() == [100, 100] + [7] * 6
    assert labels[0].tolist() == [100, 100] + [IGNORE_INDEX] * 6
    input_ids, _ = Batcher(ds, 3, pad_to="longest", shuffle=False).next_batch()
    assert input_ids.shape == (3, 4)  # rows of 2, 3 and 4 tokens


def test_an_epoch_visits_every_example_once_in_a_seeded_order() -> None:
    ds = toy_dataset(10)
    batcher = Batcher(ds, 3, seed=1, drop_last=False)
    assert len(batcher) == 4 and len(Batcher(ds, 3)) == 3
    epoch0 = [i for batch in batcher for i in example_ids(batch)]
    epoch1 = [i for batch in batcher for i in example_ids(batch)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1  # reshuffled (10! orders: equal by chance with p < 3e-7)
    again = Batcher(ds, 3, seed=1, drop_last=False)
    assert [i for b in again for i in example_ids(b)] == epoch0
    other = Batcher(ds, 3, seed=2, drop_last=False)
    assert [i for b in other for i in example_ids(b)] != epoch0


def test_resume_yields_the_same_batches() -> None:
    ds = toy_dataset(11)
    first = Batcher(ds, 4, seed=5)
    for _ in range(4):  # 2 batches per epoch: stops in the middle of epoch 1
        first.next_batch()
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    expected = [first.next_batch() for _ in range(5)]

    resumed = Batcher(ds, 4, seed=5)
    resumed.load_state_dict(state)
    for (a_ids, a_labels), (b_ids, b_labels) in zip(
        expected, (resumed.next_batch() for _ in range(5)), strict=True
    ):
        assert torch.equal(a_ids, b_ids) and torch.equal(a_labels, b_labels)


def test_resume_refuses_other_data_or_batch_size() -> None:
    state = Batcher(toy_dataset(11), 4, seed=5).state_dict()
    with pytest.raises(UserError, match="batch_size 4, but this run has 2"):
        Batcher(toy_dataset(11), 2, seed=5).load_state_dict(state)
    with pytest.raises(UserError, match="num_examples"):
        Batcher(toy_dataset(12), 4, seed=5).load_state_dict(state)


def test_too_few_examples_for_a_batch() -> None:
    with pytest.raises(UserError, match="fewer than --batch-size 8"):
        Batcher(toy_dataset(3), 8)
