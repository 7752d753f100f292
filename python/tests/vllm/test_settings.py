"""The connector's `kvring.*` settings: defaults, the values a command line
gives, and clear refusals of what cannot work."""

from __future__ import annotations

import pytest

from e2e_support import require_vllm

require_vllm()

from kvring import KvringError  # noqa: E402
from kvring.vllm import KvringSettings  # noqa: E402


def test_defaults_load_as_vllm_schedules_with_a_bounded_wait():
    s = KvringSettings.from_extra_config({})
    assert s.async_load is None
    assert s.load_mode(async_scheduling=False).async_load is False
    assert s.load_mode(async_scheduling=True).async_load is True
    assert s.load_timeout_s == 5.0 and s.timeout_s == 60.0
    assert s.load_mode(async_scheduling=True).min_load_tokens == 0


def test_short_hits_are_recomputed_by_default_only_on_an_eager_gpu_engine():
    """There a hit of fewer than 1,280 tokens was measured slower than
    recomputing its prompt; a value given is kept."""
    s = KvringSettings.from_extra_config({})
    assert s.load_mode(async_scheduling=True, eager_gpu=True).min_load_tokens == 1280
    assert s.load_mode(async_scheduling=False, eager_gpu=False).min_load_tokens == 0
    given = KvringSettings.from_extra_config({"kvring.min_load_tokens": 0})
    assert given.load_mode(async_scheduling=True, eager_gpu=True).min_load_tokens == 0


def test_a_load_in_the_step_is_refused_with_asynchronous_scheduling():
    """vLLM queues a request's next step before it learns that a load in
    this one failed: that step's token would reach the user."""
    s = KvringSettings.from_extra_config({"kvring.async_load": "false"})
    assert s.load_mode(async_scheduling=False).async_load is False
    with pytest.raises(KvringError, match="synchronous scheduling"):
        s.load_mode(async_scheduling=True)
    s = KvringSettings.from_extra_config({"kvring.async_load": True})
    assert s.load_mode(async_scheduling=False).async_load is True
    assert s.load_mode(async_scheduling=True).async_load is True


def test_command_line_strings_are_parsed():
    s = KvringSettings.from_extra_config(
        {"kvring.async_load": "true", "kvring.load_timeout_s": "0.5", "kvring.min_load_tokens": "512"}
    )
    assert s.async_load is True and s.load_timeout_s == 0.5 and s.min_load_tokens == 512


def test_prompt_tails_are_stored_unless_turned_off():
    assert KvringSettings.from_extra_config({}).store_tails is True
    assert KvringSettings.from_extra_config({"kvring.store_tails": "false"}).store_tails is False
    with pytest.raises(KvringError, match="true or false"):
        KvringSettings.from_extra_config({"kvring.store_tails": "sometimes"})


def test_submit_s_bounds_every_submission_and_keeps_its_earlier_name():
    assert KvringSettings.from_extra_config({}).submit_s == 0.25
    assert KvringSettings.from_extra_config({"kvring.submit_s": "0.1"}).submit_s == 0.1
    assert KvringSettings.from_extra_config({"kvring.lookup_submit_s": 0.5}).submit_s == 0.5


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"kvring.load_timeout": 1}, "unknown"),
        ({"kvring.async_load": "maybe"}, "true or false"),
        ({"kvring.load_timeout_s": 0}, "positive"),
        ({"kvring.min_load_tokens": -1}, "negative"),
        ({"kvring.submit_s": 0}, "positive"),
    ],
)
def test_bad_settings_are_refused(extra, words):
    with pytest.raises(KvringError, match=words):
        KvringSettings.from_extra_config(extra)
