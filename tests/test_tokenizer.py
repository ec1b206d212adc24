"""Tests of engine/tokenizer.py and modelmaker/tiny_tokenizer.py, with transformers as the oracle.

Ids must equal transformers' on GPT-2's real vocabulary and real prompts, OPT's "</s>" BOS must be prepended
like AutoTokenizer does, every loading path must agree, streaming must never break a character, and training
the tiny tokenizer must give the same bytes every time. All on CPU.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers  # a test requirement (requirements-test.txt)
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engine.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
from modelmaker.tiny_tokenizer import SPECIAL_TOKENS, train_tiny_tokenizer, train_word_tokenizer

REPO = Path(__file__).resolve().parents[1]
GPT2_BPE = REPO / "tests" / "data" / "gpt2-bpe"  # GPT-2's real files, shipped (its README: source, licence)
CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")
TINY_FILES = ("tokenizer.json", "vocab.json", "merges.txt", *CONFIGS)
MULTIBYTE_TEXT = "Café naïve — 你好，世界。東京 🙂👍🏽 👩‍💻 Привет ✓ done."
NUM_PROMPTS = 400
# Text GPT-2's pre-tokenizer treats specially: contractions, digits, whitespace runs before words and at the end,
# tabs, CRLF, code, markup, scripts other than Latin.
EDGE_PROMPTS = [
    "I'm sure they'll say it's what we'd've done, isn't it? DON'T SHOUT'S",
    "Price: $1,234.56 on 2026-12-01 at 21:46:37 (+0.5%), 10x faster, 3.14159e-10",
    "    four spaces, then\ttab\t\tand two; trailing   ",
    "line one\r\nline two\r\n\r\n\n\nafter blank lines   \n   ",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "<div class=\"x\">&amp; &lt;tag&gt; ✓</div>\n| col | col |\n|---|---|",
    "Ünïcödé façade, smörgåsbord, Ελληνικά, עברית, العربية, हिन्दी, 日本語のテキスト、한국어 문장.",
    "emoji 🙂👍🏽👩‍💻🇫🇷 and zero\u200bwidth and combining e\u0301",
    "",
    " ",
    "\n",
]


def copy_files(src: Path, dst: Path, names: tuple[str, ...]) -> Path:
    """Copy the files `names` from src into a new directory dst."""
    dst.mkdir(parents=True)
    for name in names:
        shutil.copy(src / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def real_prompts() -> list[str]:
    """Real text shipped with the repository: the paragraphs of its README, docs (prose, tables, commands, numbers,
    dashes and other non-ASCII) and the engine's source (code, indentation), then EDGE_PROMPTS."""
    paragraphs = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "engine").glob("*.py"))]:
        paragraphs += [p for p in doc.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    assert len(paragraphs) >= NUM_PROMPTS
    return paragraphs[:NUM_PROMPTS] + EDGE_PROMPTS


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPT-2's real BPE files, renamed to the Hugging Face layout."""
    model_dir = tmp_path_factory.mktemp("gpt2")
    shutil.copy(GPT2_BPE / "encoder.json", model_dir / "vocab.json")
    shutil.copy(GPT2_BPE / "vocab.bpe", model_dir / "merges.txt")
    return model_dir


@pytest.fixture(scope="module")
def gpt2(gpt2_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(gpt2_dir)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    train_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_dir)


# --- ids against transformers ------------------------------------------------------------------------


def test_gpt2_ids_match_transformers_on_real_prompts(gpt2: Tokenizer, gpt2_dir: Path, real_prompts):
    hf = transformers.GPT2Tokenizer.from_pretrained(gpt2_dir)
    for add_special in (False, True):  # GPT-2's vocab has no "</s>": no BOS either way, as in transformers
        ours = gpt2.encode_batch(real_prompts, add_special_tokens=add_special)
        assert ours == hf(real_prompts, add_special_tokens=add_special)["input_ids"]
    assert [gpt2.encode(p, add_special_tokens=False) for p in real_prompts[:20]] == ours[:20]
    assert [gpt2.decode(ids) for ids in ours] == real_prompts
    assert gpt2.vocab_size == len(hf) == 50257
    assert gpt2.eos_token_id == hf.eos_token_id == 50256 and not gpt2.add_bos


def test_tiny_tokenizer_prepends_opt_bos_like_transformers(tiny: Tokenizer, tiny_dir: Path, real_prompts):
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    texts = real_prompts[:100] + [MULTIBYTE_TEXT, "", " leading space", "a</s>b<pad>c"]
    ours = tiny.encode_batch(texts)
    assert ours == hf(texts)["input_ids"]
    assert all(ids[0] == tiny.bos_token_id == 2 for ids in ours)
    assert tiny.encode_batch(texts, add_special_tokens=False) == [ids[1:] for ids in ours]
    assert [tiny.decode(ids) for ids in ours] == hf.batch_decode(ours, skip_special_tokens=True)
    assert tiny.decode(ours[-1], skip_special_tokens=False) == hf.decode(ours[-1]) == "</s>a</s>b<pad>c"


def test_tiny_tokenizer_has_opt_special_ids(tiny: Tokenizer, tiny_dir: Path):
    vocab = json.loads((tiny_dir / "vocab.json").read_text(encoding="utf-8"))
    assert [vocab[t] for t in ("<s>", "<pad>", "</s>", "<unk>")] == [0, 1, 2, 3]
    assert (tiny.bos_token_id, tiny.eos_token_id, tiny.pad_token_id, tiny.unk_token_id) == (2, 2, 1, 3)
    assert tiny.add_bos and tiny.vocab_size == 4096 and tiny.all_special_ids == {0, 1, 2, 3}
    assert tiny.id_to_token(2) == "</s>" and tiny.id_to_token(tiny.vocab_size) is None


def test_opt_checkpoint_layout_matches_transformers(tiny_dir: Path, tmp_path: Path, real_prompts):
    """facebook/opt-* ship no tokenizer.json: vocab.json + merges.txt + configs with AddedToken dicts."""
    opt_dir = copy_files(tiny_dir, tmp_path / "opt", ("vocab.json", "merges.txt"))
    flags = {"lstrip": False, "normalized": True, "rstrip": False, "single_word": False}
    names = {"bos_token": "</s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "</s>"}
    special = {key: {"content": token, **flags} for key, token in names.items()}
    config = {**special, "add_bos_token": True, "add_prefix_space": False, "tokenizer_class": "GPT2Tokenizer"}
    (opt_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (opt_dir / "special_tokens_map.json").write_text(json.dumps(special))
    model_config = {"model_type": "opt", "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1}
    (opt_dir / "config.json").write_text(json.dumps(model_config))
    ours, hf = Tokenizer.from_pretrained(opt_dir), transformers.AutoTokenizer.from_pretrained(opt_dir)
    texts = real_prompts[:50] + [MULTIBYTE_TEXT]
    assert ours.encode_batch(texts) == hf(texts)["input_ids"]
    assert ours.add_bos and ours.all_special_ids == set(hf.all_special_ids) == {1, 2}
    assert ours.decode([0, 2, 40, 1]) == hf.decode([0, 2, 40, 1], skip_special_tokens=True) == "<s>E"


# --- loading paths and errors ------------------------------------------------------------------------


def test_tokenizer_json_and_vocab_merges_give_same_ids(tiny_dir: Path, tmp_path: Path, real_prompts):
    load = lambda name, files: Tokenizer.from_pretrained(copy_files(tiny_dir, tmp_path / name, files))
    bare_json = load("json", ("tokenizer.json",))
    bare_bpe = load("bpe", ("vocab.json", "merges.txt"))
    full_bpe = load("bpe_configs", ("vocab.json", "merges.txt", *CONFIGS))
    texts = real_prompts[:100] + [MULTIBYTE_TEXT]
    no_bos = bare_json.encode_batch(texts, add_special_tokens=False)
    assert bare_bpe.encode_batch(texts, add_special_tokens=False) == no_bos
    # BOS comes from tokenizer.json's post-processor, or from add_bos_token without it (as in transformers 5).
    assert bare_json.encode_batch(texts) == full_bpe.encode_batch(texts) == [[2, *ids] for ids in no_bos]
    assert not bare_bpe.add_bos and bare_bpe.encode("hi") == bare_bpe.encode("hi", add_special_tokens=False)


def test_missing_directory_is_a_clear_error(tmp_path: Path):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")


def test_directory_without_tokenizer_files_is_a_clear_error(tmp_path: Path, tiny_dir: Path):
    copy_files(tiny_dir, tmp_path / "m", ("vocab.json", "tokenizer_config.json"))  # merges.txt missing
    expected = r"no tokenizer in .*: expected tokenizer.json, or vocab.json \+ merges.txt"
    with pytest.raises(TokenizerError, match=expected):
        Tokenizer.from_pretrained(tmp_path / "m")


@pytest.mark.parametrize(
    ("filename", "content", "message"),
    [
        ("tokenizer.json", "{not json", "malformed tokenizer in .*tokenizer.json"),
        ("tokenizer.json", '{"model": {"type": "BPE"}}', "malformed tokenizer in .*tokenizer.json"),
        ("tokenizer_config.json", "[1, 2]", "malformed .*tokenizer_config.json: expected a JSON object"),
        ("special_tokens_map.json", '{"eos_token": 7}', "malformed token 7 in .*special_tokens_map.json"),
    ],
)
def test_malformed_files_are_clear_errors(tmp_path: Path, tiny_dir: Path, filename, content, message):
    model_dir = copy_files(tiny_dir, tmp_path / "m", TINY_FILES)
    (model_dir / filename).write_text(content)
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_pretrained(model_dir)


def test_negative_id_is_a_clear_error(tiny: Tokenizer):
    with pytest.raises(TokenizerError, match="negative token id -1"):
        tiny.decode([5, -1])


# --- incremental detokenization ----------------------------------------------------------------------


def stream(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> list[str]:
    """Feed `output` one id at a time; the step() returns, then flush()'s."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    pieces = [detok.step([i]) for i in output] + [detok.flush()]
    assert detok.text == "".join(pieces) and detok.token_ids == output
    return pieces


def test_multibyte_characters_stream_whole(gpt2: Tokenizer):
    ids = gpt2.encode(MULTIBYTE_TEXT)
    assert any("\ufffd" in gpt2.decode([i]) for i in ids), "test needs characters split across tokens"
    pieces = stream(gpt2, gpt2.encode("Say hello:"), ids)
    assert "".join(pieces) == MULTIBYTE_TEXT
    assert not any("\ufffd" in p for p in pieces)
    assert "好" in pieces and "👍" in pieces  # each arrives whole, in one step


def test_incomplete_bytes_are_held_until_flush(tiny: Tokenizer):
    # In byte-level BPE the vocabulary entry "ä" stands for the lone byte 0xE4, the lead byte of "你".
    lead_byte = [next(i for i in range(tiny.vocab_size) if tiny.id_to_token(i) == "\u00e4")]
    assert tiny.decode(lead_byte) == "\ufffd"
    detok = IncrementalDetokenizer(tiny, [2])
    assert detok.step(tiny.encode("ok", add_special_tokens=False) + lead_byte) == "ok"
    assert detok.flush() == "\ufffd" and detok.text == tiny.decode(detok.token_ids) == "ok\ufffd"


def test_special_tokens_are_skipped_or_kept(tiny: Tokenizer):
    ids = tiny.encode("one</s>two", add_special_tokens=False)
    assert "".join(stream(tiny, [2], ids, skip=True)) == "onetwo"
    assert "".join(stream(tiny, [2], ids, skip=False)) == "one</s>two"


def test_window_stays_small_on_long_outputs(gpt2: Tokenizer, real_prompts: list[str]):
    ids = gpt2.encode("\n".join(real_prompts))
    detok = IncrementalDetokenizer(gpt2, ids[:10])
    widest = 0
    for i in ids:
        detok.step([i])
        widest = max(widest, len(detok._window))  # the ids decoded per step: O(1), not O(length)
    assert len(ids) > 5000 and widest <= 8


@pytest.mark.parametrize("tok_name", ["gpt2", "tiny"])
@settings(max_examples=150, deadline=None)
@given(prompt=st.text(max_size=20), text=st.text(max_size=60))
def test_streaming_random_text_is_exact_and_never_broken(request, tok_name, prompt, text):
    tok: Tokenizer = request.getfixturevalue(tok_name)
    assume("\ufffd" not in text and not any(tok.id_to_token(i) in text for i in tok.all_special_ids))
    pieces = stream(tok, tok.encode(prompt), tok.encode(text, add_special_tokens=False))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def random_ids(vocab_size: int) -> st.SearchStrategy[list[int]]:
    """Mostly lone bytes and special tokens (ids < 260 in the tiny vocab), where UTF-8 breaks."""
    return st.lists(st.one_of(st.integers(0, 259), st.integers(0, vocab_size - 1)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(prompt=random_ids(4096), output=random_ids(4096), skip=st.booleans(), chunk=st.integers(1, 3))
def test_streaming_random_ids_equals_full_decode(tiny: Tokenizer, prompt, output, skip, chunk):
    detok = IncrementalDetokenizer(tiny, prompt, skip_special_tokens=skip)
    pieces = [detok.step(output[i : i + chunk]) for i in range(0, len(output), chunk)]
    assert not any(p.endswith("\ufffd") for p in pieces)  # a partial character is never emitted early
    assert "".join(pieces) + detok.flush() == tiny.decode(output, skip_special_tokens=skip) == detok.text


# --- training ----------------------------------------------------------------------------------------


def test_training_is_deterministic(tiny_dir: Path, tmp_path: Path):
    train_tiny_tokenizer(tmp_path / "again")
    # A fresh process with one thread and another hash seed must write the same bytes too.
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONHASHSEED": "123"}
    code = f"import modelmaker.tiny_tokenizer as t; t.train_tiny_tokenizer({str(tmp_path / 'proc')!r})"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True)
    for other in ("again", "proc"):
        match, mismatch, errors = filecmp.cmpfiles(tiny_dir, tmp_path / other, TINY_FILES, shallow=False)
        assert (mismatch, errors) == ([], []), f"training run '{other}' wrote different {mismatch + errors}"


def test_too_small_vocab_is_a_clear_error(tmp_path: Path):
    with pytest.raises(TokenizerError, match="vocab_size=100 is too small"):
        train_tiny_tokenizer(tmp_path, vocab_size=100)


# --- the word-level twin (multi-turn prefix caching benchmarks) ---------------------------------------


@pytest.fixture(scope="module")
def word_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("word")
    train_word_tokenizer(out)
    return out


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(len(SPECIAL_TOKENS), 2000), max_size=60))
def test_word_tokenizer_round_trips_any_output(word_dir: Path, ids):
    """What the byte-level BPE cannot do for a random model: decode -> encode gives the ids back, also after the
    chat template's "Assistant:" and a following turn, as the next turn of a chat renders them."""
    tok = Tokenizer.from_pretrained(word_dir)
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    prompt = tok.encode("User: the cat\nAssistant:")
    streamed = IncrementalDetokenizer(tok, prompt)
    text = streamed.step(ids) + streamed.flush()
    assert tok.encode(f"User: the cat\nAssistant:{text}\nUser: and") == [*prompt, *ids, *tok.encode("User: and")[1:]]


def test_word_tokenizer_loads_like_transformers(word_dir: Path, real_prompts):
    hf = transformers.AutoTokenizer.from_pretrained(word_dir)
    tok = Tokenizer.from_pretrained(word_dir)
    assert tok.encode_batch(real_prompts[:50]) == hf(real_prompts[:50])["input_ids"]
    assert tok.bos_token_id == 2 and tok.encode("Assistant:")[1] != tok.unk_token_id
    assert tok.vocab_size == len(hf) > 2000
