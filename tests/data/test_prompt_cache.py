"""The prompt cache (data/cache.py) and duplicate removal: a cached dataset equals the same data read without the cache
(examples, token ids, identity, log lines), is built once per dataset version by one of several processes, is keyed by
everything that decides its content, and a damaged entry is rebuilt."""

import json
import multiprocessing as mp
import os

import pytest

from megatron_dapo.data import PromptDataset
from megatron_dapo.data.cache import PromptCache
from megatron_dapo.data.cache import cache_key
from megatron_dapo.data.dataset import PromptLimit
from megatron_dapo.data.dataset import prompt_token_ids
from megatron_dapo.data.files import write_rows
from megatron_dapo.data.identity import identity_change
from megatron_dapo.dev.tiny import make_tiny_tokenizer


def _row(question: str, answer: str = "2", **extra) -> dict:
    return {
        "data_source": "t",
        "prompt": [{"role": "user", "content": question}],
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"q": question, **extra},
    }


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _rows() -> list[dict]:
    """12 rows: 3 exact repeats, one row that differs from an earlier one only in its answer (kept), one over-long."""
    rows = [_row(f"{i}+{i}=?", str(2 * i)) for i in range(8)]
    rows += [_row("1+1=?", "2"), _row("3+3=?", "6"), _row("1+1=?", "2")]  # repeats of rows 1, 3, 1
    rows[4] = _row("1+" * 60 + "1=?", "61")  # over-long at max_prompt_length 32
    rows.append(_row("0+0=?", "1"))  # same prompt as row 0, another answer: not a duplicate
    return rows


def _load(files, tokenizer, cache_dir=None, **kw):
    lines = []
    kw = {"max_prompt_length": 32, "filter_overlong": True, "drop_duplicates": True, **kw}
    data = PromptDataset(files, tokenizer=tokenizer, cache_dir=cache_dir, log=lines.append, **kw)
    return data, lines


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_cached_equals_uncached_and_drops_duplicates_with_a_count(tmp_path, tokenizer, fmt):
    a = write_rows(_rows()[:7], tmp_path / f"a.{fmt}")
    b = write_rows(_rows()[7:], tmp_path / f"b.{fmt}")
    plain, plain_lines = _load([a, b], tokenizer)
    cached, cached_lines = _load([a, b], tokenizer, tmp_path / "cache")
    build_line = [x for x in cached_lines if x.startswith("prompt cache: reading 2 data file(s)")]
    assert len(build_line) == 1 and [x for x in cached_lines if x not in build_line] == plain_lines
    assert plain_lines[0] == (
        f"dropped 3 duplicate rows of 12 (same prompt and ground truth as an earlier row; data.drop_duplicates; first: "
        f"{b} row 1{' (line 2)' if fmt == 'jsonl' else ''} repeats {a} row 1{' (line 2)' if fmt == 'jsonl' else ''})"
    )
    assert plain_lines[1].startswith("dropped 1 of 9 prompts longer than data.max_prompt_length=32 tokens")
    assert [ex.index for ex in plain] == [0, 1, 2, 3, 5, 6, 7, 11]  # rows keep their index
    assert list(cached.examples) == list(plain.examples) and len(cached) == 8
    assert cached.identity == plain.identity and cached.longest_prompt == plain.longest_prompt
    assert cached.examples[-2:] == plain.examples[-2:] and cached.examples[-1] == plain.examples[7]
    for i, ex in enumerate(plain.examples):
        assert cached.cache.prompt_ids(i) == prompt_token_ids(tokenizer, ex.prompt_messages)
        assert cached.cache.prompt_ids_of_index(ex.index) == cached.cache.prompt_ids(i)
    with pytest.raises(KeyError, match="no kept example has index 4"):
        cached.cache.prompt_ids_of_index(4)
    # a second start reads the entry: the same notes, no build
    again, again_lines = _load([a, b], tokenizer, tmp_path / "cache")
    assert again_lines == plain_lines and list(again.examples) == list(plain.examples)


def test_duplicates_kept_when_asked_and_the_identity_tells_the_two_apart(tmp_path, tokenizer):
    path = write_rows(_rows(), tmp_path / "d.jsonl")
    dedup, _ = _load(path, tokenizer, tmp_path / "c")
    every, lines = _load(path, tokenizer, tmp_path / "c", drop_duplicates=False)
    assert len(every) == len(dedup) + 3 and not any("duplicate rows" in x for x in lines)
    assert dedup.identity["files"] == every.identity["files"]  # every row read, either way
    assert "duplicate removal kept 8 prompts, 11 when" in identity_change(every.identity, dedup.identity)


def test_the_key_changes_with_content_tokenizer_template_limit_and_options(tmp_path, tokenizer):
    path = write_rows(_rows(), tmp_path / "d.jsonl")
    limit = PromptLimit.of(32)
    opts = {"prompt_key": "prompt", "filter_overlong": True, "drop_duplicates": True}
    base = cache_key([path], tokenizer, limit, **opts)
    assert cache_key([path], tokenizer, limit, **opts) == base
    keys = {
        cache_key([path], tokenizer, PromptLimit.of(64), **opts),
        cache_key([path], tokenizer, limit, **{**opts, "drop_duplicates": False}),
        cache_key([path], tokenizer, limit, **{**opts, "filter_overlong": False}),
        cache_key([path], tokenizer, limit, **{**opts, "prompt_key": "question"}),
    }
    template = tokenizer.chat_template
    try:
        tokenizer.chat_template = template + " "
        keys.add(cache_key([path], tokenizer, limit, **opts))
    finally:
        tokenizer.chat_template = template
    moved = tmp_path / "moved.jsonl"  # the same content elsewhere: its examples and notes name the new path
    moved.write_bytes(open(path, "rb").read())
    keys.add(cache_key([str(moved)], tokenizer, limit, **opts))
    with open(path, "a") as f:  # one more row: new content, new entry
        f.write(json.dumps(_row("9+9=?", "18")) + "\n")
    keys.add(cache_key([path], tokenizer, limit, **opts))
    assert base not in keys and len(keys) == 7


def test_a_damaged_entry_is_rebuilt_with_one_line(tmp_path, tokenizer):
    path = write_rows(_rows(), tmp_path / "d.jsonl")
    first, _ = _load(path, tokenizer, tmp_path / "c")
    tokens = first.cache.entry / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-4])  # a torn write
    again, lines = _load(path, tokenizer, tmp_path / "c")
    assert sum("is damaged" in x and "rebuilding it" in x for x in lines) == 1
    assert list(again.examples) == list(first.examples)
    assert again.cache.prompt_ids(len(again) - 1) == prompt_token_ids(tokenizer, again.examples[-1].prompt_messages)


def _same_size_ground_truth_edit(entry) -> int:
    """The probe's edit: every one-digit ground truth of examples.bin changed, the file's size kept. Returns the
    number of rows edited."""
    import numpy as np

    data = bytearray((entry / "examples.bin").read_bytes())
    offsets = np.load(entry / "examples.idx")
    edits = 0
    for start, end in zip(offsets[:-1], offsets[1:], strict=True):
        row = json.loads(bytes(data[start:end]))
        if len(row[1]) == 1 and row[1].isdigit():
            row[1] = str((int(row[1]) + 1) % 10)
            encoded = json.dumps(row, ensure_ascii=False, default=str).encode()
            assert len(encoded) == end - start
            data[start:end] = encoded
            edits += 1
    (entry / "examples.bin").write_bytes(bytes(data))
    return edits


def _damages():
    """(name, damage(entry)): each file of an entry flipped in one byte (same size), torn, or removed, and edits of
    meta.json's content (a note, the identity, its checksum) with the rest kept."""

    def flip(name):
        def damage(entry):
            data = bytearray((entry / name).read_bytes())
            data[len(data) // 2] ^= 0x04
            (entry / name).write_bytes(bytes(data))

        return damage

    def tear(name):
        return lambda entry: (entry / name).write_bytes((entry / name).read_bytes()[:-3])

    def remove(name):
        return lambda entry: (entry / name).unlink()

    def edit_meta(change):
        def damage(entry):
            meta = json.loads((entry / "meta.json").read_text())
            change(meta)
            (entry / "meta.json").write_text(json.dumps(meta, indent=1))

        return damage

    files = ["examples.bin", "examples.idx", "tokens.bin", "tokens.idx", "indices.npy", "meta.json"]
    out = [(f"{how.__name__} {name}", how(name)) for name in files for how in (flip, tear, remove)]
    out += [
        ("a note changed", edit_meta(lambda m: m["notes"].append("x"))),
        ("the longest prompt changed", edit_meta(lambda m: m.update(longest_prompt=m["longest_prompt"] + 1))),
        (
            "the identity changed",
            edit_meta(lambda m: m["identity"].update(num_examples=m["identity"]["num_examples"] + 1)),
        ),
        ("the checksum removed", edit_meta(lambda m: m.pop("checksum"))),
        ("a file's hash changed", edit_meta(lambda m: m["contents"]["tokens.bin"].update(sha256="0" * 64))),
        ("the ground truths edited", _same_size_ground_truth_edit),
    ]
    return out


@pytest.mark.parametrize("name, damage", _damages(), ids=[n for n, _ in _damages()])
def test_every_damage_or_edit_of_an_entry_is_found_and_rebuilt(tmp_path, tokenizer, name, damage):
    """The probe trained on a same-size edit of examples.bin (every one-digit ground truth changed): the entry was
    trusted by its meta.json alone. Now each file's size and sha256 (hashed once when written) and meta.json's own
    checksum are checked at every open; any damage is one line and the entry is rebuilt from the data files."""
    path = write_rows(_rows(), tmp_path / "d.jsonl")
    plain, _ = _load(path, tokenizer)
    first, _ = _load(path, tokenizer, tmp_path / "c")
    if name == "the ground truths edited":
        assert damage(first.cache.entry) >= 5  # the edit reached the ground truths it is about
    else:
        damage(first.cache.entry)
    again, lines = _load(path, tokenizer, tmp_path / "c")
    assert sum("is damaged" in x and "rebuilding it" in x for x in lines) == 1, lines
    assert list(again.examples) == list(plain.examples)
    assert again.identity == plain.identity
    assert [again.cache.prompt_ids(i) for i in range(len(again))] == [
        prompt_token_ids(tokenizer, ex.prompt_messages) for ex in plain.examples
    ]
    _, quiet = _load(path, tokenizer, tmp_path / "c")  # the rebuilt entry verifies
    assert not any("damaged" in x or "prompt cache: reading" in x for x in quiet), quiet


def test_bad_input_is_the_same_one_line_error_with_the_cache(tmp_path, tokenizer):
    rows = _rows()
    rows[5]["reward_model"] = {}
    path = write_rows(rows, tmp_path / "bad.jsonl")
    errors = []
    for cache_dir in (None, tmp_path / "c"):
        with pytest.raises(ValueError) as err:
            _load(path, tokenizer, cache_dir)
        errors.append(str(err.value))
    assert errors[0] == errors[1] == f"{path} row 5 (line 6): field 'reward_model.ground_truth' is missing"
    assert not [p for p in (tmp_path / "c").iterdir() if p.is_dir()]  # nothing half-built is left
    with pytest.raises(FileNotFoundError, match="data file not found: .*missing.jsonl"):
        _load(str(tmp_path / "missing.jsonl"), tokenizer, tmp_path / "c")


def _open_in_child(args):
    path, tok_dir, cache_dir = args
    from transformers import AutoTokenizer

    lines = []
    cache = PromptCache.open(cache_dir, [path], AutoTokenizer.from_pretrained(tok_dir), PromptLimit.of(32),
                             filter_overlong=True, log=lines.append)  # fmt: skip
    return os.getpid(), len(cache.examples), sum(x.startswith("prompt cache: reading") for x in lines)


def test_processes_started_together_build_once_and_read_the_same(tmp_path):
    tok_dir = tmp_path / "tok"
    make_tiny_tokenizer(tok_dir)
    path = write_rows(_rows() * 50, tmp_path / "d.jsonl")
    with mp.get_context("spawn").Pool(3) as pool:
        results = pool.map(_open_in_child, [(path, str(tok_dir), str(tmp_path / "c"))] * 3)
    assert sorted(r[2] for r in results) == [0, 0, 1] and {r[1] for r in results} == {8}
    assert len([p for p in (tmp_path / "c").iterdir() if p.is_dir()]) == 1


def test_an_unwritable_cache_dir_is_one_line_naming_the_field(tmp_path, tokenizer):
    path = write_rows(_rows(), tmp_path / "d.jsonl")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError) as err:
        _load(path, tokenizer, blocker / "cache")
    assert str(err.value).startswith(f"data.cache_dir={blocker / 'cache'}: cannot write there (")
    assert "\n" not in str(err.value)
