"""Sampling and length defaults: from the model when it has them, one resolution for both APIs."""

from __future__ import annotations

import json
import logging
import shutil

import gguf
import httpx
import pytest

from tandem.entrypoints.server import defaults
from tandem.entrypoints.server.app import ServerConfig
from tests.conftest import TINY_CONFIG
from tests.server.conftest import tiny_engine


def _model_dir(tmp_path, generation_config: dict | None):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


def _gguf(path, **fields) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        (w.add_float32 if isinstance(value, float) else w.add_int32)(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_models_generation_config_wins_and_ignores_what_is_not_sampling(tmp_path):
    d = _model_dir(tmp_path, {"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 50,
                              "do_sample": True, "eos_token_id": [1, 2]})
    got = defaults.resolve("auto", None, d, None)
    assert got.values == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 50}
    assert got.sources["temperature"] == "the model's generation_config.json"
    assert "temperature=0.6" in got.describe()
    assert got.ollama_parameters() == ["temperature 0.6", "top_p 0.95", "num_predict 50"]


def test_gguf_sampling_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    _gguf(path, **{"general.sampling.temp": 0.7, "general.sampling.top_k": 20})
    got = defaults.resolve("auto", None, _model_dir(tmp_path / "d", {"eos_token_id": 2}), path)
    assert got.values == {"temperature": 0.7, "top_k": 20}  # float32 0.69999999 rounded
    assert "GGUF" in got.sources["top_k"]


def test_a_model_without_defaults_gets_the_server_default(tmp_path):
    got = defaults.resolve("auto", None, _model_dir(tmp_path, {"bos_token_id": 1}), None)
    assert got.values == defaults.SERVER_DEFAULT and "tandem's default" in got.describe()
    assert defaults.resolve("vllm", None, _model_dir(tmp_path, {"temperature": 0.1}),
                            None).values == {}


def test_invalid_model_values_are_left_out(tmp_path, caplog):
    d = _model_dir(tmp_path, {"temperature": 0.3, "top_p": 0.0})
    with caplog.at_level(logging.WARNING):
        got = defaults.resolve("auto", None, d, None)
    assert got.values == {"temperature": 0.3} and "top_p" in caplog.text
    (d / "generation_config.json").write_text("{not json")
    assert defaults.resolve("auto", None, d, None).values == defaults.SERVER_DEFAULT


def test_directory_mode_and_override(tmp_path):
    d = _model_dir(tmp_path, {"top_k": 7})
    override = defaults.parse_override('{"temperature": 0.5, "max_new_tokens": 100}')
    assert override == {"temperature": 0.5, "max_tokens": 100}
    got = defaults.resolve(defaults.check_mode(str(d)), override, None, None)
    assert got.values == {"top_k": 7, "temperature": 0.5, "max_tokens": 100}
    assert got.sources["temperature"] == "--override-generation-config"


@pytest.mark.parametrize("flag,words", [
    ('{"temperature": -1}', "temperature must be"),
    ('{"temprature": 0.5}', "unknown keys ['temprature']"),
    ("[1]", "JSON object"),
    ("{", "not valid JSON"),
])
def test_bad_override_names_the_flag(flag, words):
    with pytest.raises(ValueError, match="--override-generation-config") as e:
        defaults.parse_override(flag)
    assert words in str(e.value)


def test_bad_mode_names_the_flag():
    with pytest.raises(ValueError, match="--generation-config must be auto, vllm"):
        defaults.check_mode("/no/such/dir")


def test_server_applies_and_reports_the_models_defaults(start_server, tmp_path, caplog):
    d = _model_dir(tmp_path, {"temperature": 0.3, "top_k": 5, "max_new_tokens": 20})
    with caplog.at_level(logging.INFO, logger="tandem.entrypoints.server"):
        s = start_server(tiny_engine(str(d)), ServerConfig(max_queue=4))
        show = httpx.post(f"{s.url}/api/show", json={"model": s.model}, timeout=30).json()
    assert "temperature=0.3, top_k=5, max_tokens=20 (the model's generation_config.json)" \
        in caplog.text
    assert show["parameters"].splitlines()[1:] == ["temperature 0.3", "top_k 5",
                                                   "num_predict 20"]
    assert "PARAMETER temperature 0.3" in show["modelfile"]

    def complete(**fields) -> dict:
        r = httpx.post(f"{s.url}/v1/completions", timeout=60, json={
            "prompt": [1, 2, 3], "ignore_eos": True, **fields})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    # Left out, temperature and top_k are the model's: the same tokens as sent explicitly.
    default = complete(seed=7, max_tokens=8, return_token_ids=True)["token_ids"]
    assert default == complete(seed=7, max_tokens=8, temperature=0.3, top_k=5,
                               return_token_ids=True)["token_ids"]
    assert default != complete(seed=7, max_tokens=8, temperature=1.0, top_k=0,
                               return_token_ids=True)["token_ids"]
    # /v1/completions keeps OpenAI's 16; Ollama's open-ended default is capped by the model.
    assert complete(temperature=0)["finish_reason"] == "length"
    r = httpx.post(f"{s.url}/api/generate", timeout=60, json={
        "model": s.model, "context": [1, 2, 3], "stream": False,
        "options": {"temperature": 0}}).json()
    assert r["eval_count"] <= 20 and (r["eval_count"] == 20) == (r["done_reason"] == "length")


def test_open_ended_requests_fill_the_context(start_server, tiny_config_path, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(tiny_config_path, d / "config.json")
    s = start_server(tiny_engine(str(d), max_model_len=64), ServerConfig(max_queue=4))
    r = httpx.post(f"{s.url}/api/generate", timeout=60, json={
        "model": s.model, "context": [5, 6, 7], "stream": False,
        "options": {"temperature": 0}}).json()
    # Until EOS or the 64-token window is full (greedy, this random model repeats its
    # last token and never emits EOS), never cut at 16.
    assert r["done_reason"] == "length" and r["eval_count"] == 64 - 3
