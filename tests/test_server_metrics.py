"""/metrics parses with prometheus_client's text parser and its counters match the requests made: responses by
endpoint and status, finish reasons, prompt and generated tokens, the tau histogram and the per-position draft
acceptance counters, which equal the offline engine's step traces for the same requests.

Served model: the trained tiny target + drafter (acceptance well above 1) without a tokenizer, so this also covers
token-id prompts, the `token_ids` output and the acceptance summary of a model with no text at all."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from blockspec.llm import LLM
from blockspec.sampling import SamplingParams
from server_utils import LiveServer
from trained_pair import CYCLE_A, CYCLE_B, cycle_seq, trained_pair

PROMPTS = [cycle_seq(CYCLE_A, 3, 12), cycle_seq(CYCLE_B, 0, 9), cycle_seq(CYCLE_A, 11, 20), cycle_seq(CYCLE_B, 5, 7)]
MAX_TOKENS = 40


def scrape(srv: LiveServer) -> dict[tuple[str, tuple], float]:
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    assert not [name for name, _ in samples if name.endswith("_created")]  # only blockspec's own series
    return samples


def test_metrics_match_the_requests():
    pair = trained_pair()
    refs = LLM.from_loaded(pair.lm, pair.draft).generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS),
                                                         use_tqdm=False)
    assert all(r.mean_acceptance_length > 2 for r in refs)
    srv = LiveServer(LLM.from_loaded(pair.lm, pair.draft).engine, name="cycles")
    total_blocks = srv.engine.pool.num_blocks
    try:
        client = srv.client()
        usages = []
        for prompt, ref in zip(PROMPTS[:2], refs):  # one request each, not streamed
            resp = client.completions.create(model="cycles", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert resp.choices[0].token_ids == ref.token_ids and resp.choices[0].text == ""
            assert resp.usage.acceptance["acceptance_lengths"] == [ref.acceptance_lengths]
            usages.append(resp.usage)
        chunks = list(client.completions.create(model="cycles", prompt=PROMPTS[2:], max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
        usages.append(chunks[-1].usage)
        assert usages[-1].acceptance["acceptance_lengths"] == [r.acceptance_lengths for r in refs[2:]]
        assert httpx.post(srv.url + "/v1/completions", json={"model": "cycles", "prompt": "text"}).status_code == 400
        client.models.list()
        srv.wait_idle()
        m = scrape(srv)
    finally:
        srv.stop()

    def value(name: str, **labels) -> float:
        return m[(name, tuple(sorted(labels.items())))]

    assert value("blockspec_requests_total", endpoint="/v1/completions", status="200") == 3
    assert value("blockspec_requests_total", endpoint="/v1/completions", status="400") == 1
    assert value("blockspec_requests_total", endpoint="/v1/models", status="200") == 1
    reasons = {r.finish_reason for r in refs}
    assert sum(value("blockspec_finished_requests_total", finish_reason=r) for r in reasons) == 4
    assert value("blockspec_prompt_tokens_total") == sum(u.prompt_tokens for u in usages) == sum(map(len, PROMPTS))
    assert value("blockspec_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    taus = [r.mean_acceptance_length for r in refs]
    assert value("blockspec_request_mean_acceptance_length_count") == 4
    assert value("blockspec_request_mean_acceptance_length_sum") == pytest.approx(sum(taus))
    assert value("blockspec_request_mean_acceptance_length_bucket", le="+Inf") == 4
    assert value("blockspec_request_mean_acceptance_length_bucket", le="1.0") == 0
    K = pair.draft.spec.num_draft_tokens
    for i in range(K):
        steps = [s for r in refs for s in r.steps]
        proposed = sum(len(s.draft) > i for s in steps)
        accepted = sum(len(s.draft) > i and s.num_accepted > i for s in steps)
        assert value("blockspec_draft_proposed_total", position=str(i + 1)) == proposed
        assert value("blockspec_draft_accepted_total", position=str(i + 1)) == accepted
    assert value("blockspec_draft_accepted_total", position="1") > 0
    assert value("blockspec_step_latency_seconds_count") > 0
    assert value("blockspec_kv_blocks_used") == 0 and value("blockspec_kv_usage_ratio") == 0
    assert value("blockspec_kv_blocks_total") == total_blocks
    assert value("blockspec_requests_running") == 0 and value("blockspec_requests_waiting") == 0
