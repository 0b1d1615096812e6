"""The command lines: `blockspec serve` as a real process (ready line, requests with the official client, SIGTERM
while a stream is running: the stream ends with finish_reason "abort", new requests get 503 during the grace period,
a second signal ends it, the lifespan completes, the process ends), its flag errors, and
`blockspec chat` fed from stdin (replies equal offline greedy outputs over the whole conversation, status line)."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from blockspec.cli import main
from blockspec.layers import cpu_packed
from blockspec.llm import LLM
from blockspec.sampling import SamplingParams
from hf_utils import make_hf_model, save_hf_model
from server_utils import tiny_pair


def test_serve_process_answers_then_shuts_down_on_sigterm():
    target, draft, lm, d = tiny_pair()
    ref = LLM.from_loaded(lm, d).generate(["Hello"], SamplingParams(max_tokens=10), use_tqdm=False)[0]
    proc = subprocess.Popen(
        [sys.executable, "-m", "blockspec", "serve", str(target), "--draft", str(draft), "--port", "0",
         "--served-model-name", "tiny", "--device", "cpu", "--log-level", "info", "--shutdown-grace", "60"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "BLOCKSPEC_API_KEY": "k"},
    )
    try:
        lines = [proc.stderr.readline()]
        while not lines[-1].startswith("blockspec: serving") and lines[-1]:
            lines.append(proc.stderr.readline())
        m = re.fullmatch(r"blockspec: serving 'tiny' on (http://127\.0\.0\.1:\d+/v1)\n", lines[-1])
        assert m, lines
        client = openai.OpenAI(base_url=m.group(1), api_key="k", max_retries=0, timeout=60)
        resp = client.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0)
        assert resp.choices[0].token_ids == ref.token_ids
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=m.group(1), api_key="nope", max_retries=0).models.list()
        stream = client.completions.create(model="tiny", prompt="long", max_tokens=480, temperature=0, stream=True)
        next(iter(stream))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        reasons = [c.finish_reason for ch in stream for c in ch.choices if c.finish_reason]
        assert reasons == ["abort"]
        # the grace period: still listening, new requests get the documented 503 (the probe: 0.3 s after)
        time.sleep(max(0.0, t0 + 0.3 - time.monotonic()))
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="tiny", prompt="late", max_tokens=2)
        assert refused.value.status_code == 503 and refused.value.response.json() == {"error": {
            "message": "the server is shutting down", "type": "unavailable", "param": None, "code": None}}
        health = httpx.get(m.group(1)[:-3] + "/health", headers={"Authorization": "Bearer k"})
        assert (health.status_code, health.json()) == (503, {"status": "shutting_down"})
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)  # a second signal ends the 60 s grace at once
        # uvicorn re-raises the signal once its shutdown (lifespan included: the engine thread joined) is complete
        assert proc.wait(timeout=30) == -signal.SIGTERM
        assert time.monotonic() - t0 < 15
        log = proc.stderr.read()
        assert "Application shutdown complete." in log and "Traceback" not in log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_serve_flag_errors(capsys):
    target, draft, _, _ = tiny_pair()
    capsys.readouterr()  # building the pair (first use in this process) writes progress bars
    assert main(["serve", str(target), "--model", "other"]) == 2
    assert capsys.readouterr().err == (f"blockspec: error: two models given: {str(target)!r} and --model 'other'; "
                                       f"pass one\n")
    for flag in (["--num-draft-tokens", "3"], ["--full-block-drafting"], ["--cpu-bf16-draft"],
                 ["--draft-vocab-size", "8"]):
        assert main(["serve", str(target), *flag]) == 2
        assert capsys.readouterr().err == f"blockspec: error: {flag[0]} needs --draft\n"
    assert main(["serve", str(target), "--draft", str(draft), "--draft-len-schedule", "1:7,16"]) == 2
    assert capsys.readouterr().err == ("blockspec: error: --draft-len-schedule '1:7,16': expected auto, off or "
                                       "batch:K pairs separated by commas, e.g. 1:15,16:7,64:3\n")
    assert main(["serve", str(target), "--draft", str(draft), "--draft-len-schedule", "0:7"]) == 2
    assert "draft_len_schedule={0: 7}" in capsys.readouterr().err
    assert main(["serve", str(target), "--max-request-bytes", "0"]) == 2
    assert capsys.readouterr().err == "blockspec: error: --max-request-bytes 0: must be >= 1\n"
    assert main(["serve", str(target), "--shutdown-grace", "-1"]) == 2
    assert capsys.readouterr().err == "blockspec: error: --shutdown-grace -1.0: must be a number of seconds >= 0\n"
    assert main(["serve", str(target), "--port", "99999"]) == 2
    assert "blockspec: error: cannot listen on 127.0.0.1:99999" in capsys.readouterr().err


def test_chat_streams_replies_over_a_conversation(monkeypatch, capsys):
    target, draft, lm, d = tiny_pair()
    tok = lm.tokenizer
    offline = LLM.from_loaded(lm, d)

    def reply(messages):
        out = offline.generate([tok.apply_chat_template(messages)], SamplingParams(max_tokens=12), use_tqdm=False)[0]
        return tok.decode(out.token_ids)

    sys_msg = {"role": "system", "content": "Be nice."}
    first = reply([sys_msg, {"role": "user", "content": "Hi"}])
    second = reply([sys_msg, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": first},
                    {"role": "user", "content": "More"}])
    fresh = reply([sys_msg, {"role": "user", "content": "More"}])
    assert len({first, second, fresh}) == 3
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\nMore\n\n/reset\nMore\n/exit\nnever read\n"))
    packed = []  # --cpu-packed reaches the target (serve and chat build their LLM the same way)
    monkeypatch.setattr(cpu_packed, "pack_target", lambda m, f=cpu_packed.pack_target: packed.append(m) or f(m))
    flag = ["--cpu-packed"] if cpu_packed.fp32_supported(torch.device("cpu")) else []
    assert main(["chat", str(target), "--draft", str(draft), "--device", "cpu", "--max-tokens", "12",
                 "--system", "Be nice.", "--draft-len-schedule", "off", *flag]) == 0  # tau printed: it drafts
    assert len(packed) == len(flag)
    out, err = capsys.readouterr()
    assert out == f">>> {first}\n>>> {second}\n>>> >>> >>> {fresh}\n>>> "
    status = re.findall(r"\[(\d+) tokens, [\d.]+ tok/s, tau ([\d.]+), finish: (\w+)\]", err)
    assert [s[0] for s in status] == ["12", "12", "12"] and all(float(s[1]) >= 1 for s in status)


def test_chat_needs_a_chat_model(tmp_path, capsys):
    plain = save_hf_model(make_hf_model("llama"), tmp_path / "plain")  # no tokenizer files
    assert main(["chat", str(plain), "--device", "cpu"]) == 2
    assert capsys.readouterr().err.endswith(f"blockspec: error: {plain} has no chat template: `blockspec chat` "
                                            f"needs a chat model\n")
