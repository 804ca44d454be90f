"""Trace readers, generators and operations (pure: files in tmp_path, the shared Azure sample)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from rayscale.sim import trace as T

AZURE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "azure_llm_2023_code.csv"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


# --- readers --------------------------------------------------------------------------------------


def test_azure_sample_loads_fast_and_completely() -> None:
    rows = sum(1 for line in AZURE.read_text().splitlines()[1:] if line.strip())
    start = time.perf_counter()
    tr = T.load_trace(AZURE)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"loading took {elapsed:.2f} s"
    assert len(tr) == rows > 8000
    assert tr.arrival_s[0] == 0.0
    assert np.all(np.diff(tr.arrival_s) >= 0)
    # first row: 2023-11-16 18:17:03.9799600,4808,10; second 52 ms later
    assert tr[0] == T.TraceRequest(0.0, 4808, 10)
    assert tr[1].arrival_s == pytest.approx(0.052, abs=1e-6)
    assert tr[1].prompt_tokens == 3180
    # about an hour, as SOURCES.md says
    assert 3000 < tr.duration_s < 3700
    assert tr.name == "azure_llm_2023_code"


def test_azure_csv_with_datetimes(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 23:59:59.5000000,100,10\n"
        "2023-11-17 00:00:01.2500000,200,20\n"  # crosses midnight
        "\n"
        "2023-11-16 23:59:59.7500000,300,30\n",  # out of order: sorted, not dropped
    )
    tr = T.load_trace(p)
    assert tr.arrival_s.tolist() == pytest.approx([0.0, 0.25, 1.75])
    assert tr.prompt_tokens.tolist() == [100, 300, 200]
    assert tr.output_tokens.tolist() == [10, 30, 20]


def test_csv_with_numeric_seconds_and_other_column_order(tmp_path: Path) -> None:
    p = write(tmp_path, "b.csv", "GeneratedTokens,TIMESTAMP,ContextTokens\n5,10.5,50\n6,12.0,60\n")
    tr = T.load_trace(p)
    assert tr.arrival_s.tolist() == [0.0, 1.5]
    assert tr.prompt_tokens.tolist() == [50, 60]
    assert tr.output_tokens.tolist() == [5, 6]


def test_burstgpt_csv_and_usage_field_names(tmp_path: Path) -> None:
    """BurstGPT's release (HPMLL/BurstGPT: Timestamp in seconds, Request/Response tokens, a failed request
    with 0 response tokens) and the usage names of OpenAI-style logs load without renaming a column."""
    p = write(tmp_path, "burst.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
              "5,ChatGPT,472,18,490,Conversation log\n45,GPT-4,1087,0,1087,Conversation log\n")
    tr = T.load_trace(p)
    assert tr.arrival_s.tolist() == [0.0, 40.0]
    assert tr.prompt_tokens.tolist() == [472, 1087]
    assert tr.output_tokens.tolist() == [18, 0]
    q = write(tmp_path, "usage.jsonl", '{"arrival_s": 1.0, "input_tokens": 30, "completion_tokens": 7}\n')
    assert (T.load_trace(q).prompt_tokens.tolist(), T.load_trace(q).output_tokens.tolist()) == ([30], [7])


def test_mooncake_jsonl_milliseconds(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 100, "output_length": 5},
        {"timestamp": 250, "input_length": 7, "output_length": 1},
    ]
    p = write(tmp_path, "m.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n\n")
    tr = T.load_trace(p)
    assert tr.arrival_s.tolist() == [0.0, 0.25, 1.5]
    assert tr.prompt_tokens.tolist() == [6955, 7, 100]
    assert tr.output_tokens.tolist() == [52, 1, 5]


def test_format_detected_by_content_without_extension(tmp_path: Path) -> None:
    j = write(tmp_path, "trace-one", '{"timestamp": 1000, "input_length": 3, "output_length": 4}\n')
    c = write(tmp_path, "trace-two", "TIMESTAMP,ContextTokens,GeneratedTokens\n3,4,5\n")
    assert T.detect_format(j) == "mooncake-jsonl"
    assert T.detect_format(c) == "azure-csv"
    assert T.load_trace(j)[0] == T.TraceRequest(0.0, 3, 4)
    assert T.load_trace(c)[0] == T.TraceRequest(0.0, 4, 5)


@pytest.mark.parametrize(
    ("name", "text", "line", "field", "words"),
    [
        (
            "bad_tokens.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n1,10,2\n2,ten,3\n",
            3,
            "ContextTokens",
            "token count",
        ),
        ("neg.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,10,-2\n", 2, "GeneratedTokens", ">= 0"),
        ("time.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,1,1\nyesterday,1,1\n", 3, "TIMESTAMP", "time"),
        ("short.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,1,1\n2,2\n", 3, "GeneratedTokens", "columns"),
        ("nohdr.csv", "when,ContextTokens,GeneratedTokens\n1,1,1\n", 1, "TIMESTAMP", "missing column"),
        ("frac.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,1.5,1\n", 2, "ContextTokens", "whole"),
        (
            "mixed.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 10:00:00,1,1\n5,1,1\n",
            3,
            "TIMESTAMP",
            "mixes",
        ),
        ("j.jsonl", '{"timestamp": 1, "input_length": 1, "output_length": 1}\n{"timestamp": 2,\n', 2, None, "JSON"),
        (
            "k.jsonl",
            '{"timestamp": 1, "input_length": 1, "output_length": 1}\n{"timestamp": 2, "input_length": 1}\n',
            2,
            "GeneratedTokens",
            "output_length",
        ),
        ("l.jsonl", '{"timestamp": 1, "input_length": "x", "output_length": 1}\n', 1, "input_length", "token"),
        ("m.jsonl", '[1, 2, 3]\n', 1, None, "JSON object"),
    ],
)
def test_bad_file_names_file_line_and_field(
    tmp_path: Path, name: str, text: str, line: int, field: str | None, words: str
) -> None:
    p = write(tmp_path, name, text)
    with pytest.raises(T.TraceFormatError) as ei:
        T.load_trace(p)
    err = ei.value
    assert err.path == str(p)
    assert err.line == line
    assert err.field == field
    msg = str(err)
    assert str(p) in msg and f"line {line}" in msg and words in msg
    if field:
        assert repr(field) in msg


def test_empty_missing_and_header_only_files(tmp_path: Path) -> None:
    with pytest.raises(T.TraceFormatError, match="empty"):
        T.load_trace(write(tmp_path, "e.csv", "\n\n"))
    with pytest.raises(T.TraceFormatError, match="no requests"):
        T.load_trace(write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"))
    with pytest.raises(T.TraceFormatError, match="no such file") as ei:
        T.load_trace(tmp_path / "absent.csv")
    assert "absent.csv" in str(ei.value)


# --- generators -----------------------------------------------------------------------------------


def test_poisson_rate_seed_and_lengths() -> None:
    a = T.poisson(20.0, 500.0, seed=3)
    b = T.poisson(20.0, 500.0, seed=3)
    c = T.poisson(20.0, 500.0, seed=4)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_tokens, b.prompt_tokens)
    assert not np.array_equal(a.arrival_s[:50], c.arrival_s[:50])
    # 10,000 expected; 4 sigma is 400
    assert abs(len(a) - 10_000) < 400
    gaps = np.diff(a.arrival_s)
    assert gaps.mean() == pytest.approx(0.05, rel=0.05)
    assert np.std(gaps) / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps: CV 1
    assert a.prompt_tokens.min() >= T.DEFAULT_PROMPT.low and a.prompt_tokens.max() <= T.DEFAULT_PROMPT.high
    assert np.median(a.output_tokens) == pytest.approx(T.DEFAULT_OUTPUT.median, rel=0.1)
    fixed = T.poisson(5, 10, seed=1, prompt=T.LengthDist(64, sigma=0), output=T.LengthDist(8, sigma=0))
    assert set(fixed.prompt_tokens.tolist()) == {64} and set(fixed.output_tokens.tolist()) == {8}


def test_diurnal_peaks_where_asked() -> None:
    tr = T.diurnal(1.0, 21.0, period_s=1000.0, duration_s=1000.0, seed=0)
    trough = len(tr.window(0, 100)) + len(tr.window(900, 1000))
    peak = len(tr.window(450, 550))
    assert peak > 5 * trough / 2  # rate near the peak is ~20/s, near the edges ~1.5/s
    assert len(tr) == pytest.approx(11 * 1000, rel=0.05)  # mean rate is (base + peak) / 2


def test_bursts_are_where_they_should_be() -> None:
    tr = T.bursts(1.0, 50.0, every_s=60.0, burst_s=5.0, duration_s=300.0, seed=2, first_at_s=30.0)
    in_burst = sum(len(tr.window(30 + 60 * k, 35 + 60 * k)) for k in range(4))
    quiet = len(tr.window(0, 30))
    assert in_burst == pytest.approx(4 * 5 * 50, rel=0.15)
    assert quiet == pytest.approx(30, abs=20)


# --- operations -----------------------------------------------------------------------------------


def small() -> T.Trace:
    return T.Trace.from_arrays([0.0, 1.0, 2.0, 4.0], [10, 20, 30, 40], [1, 2, 3, 4], "small")


def test_compress_and_time_scale() -> None:
    tr = small()
    assert tr.compress(2).arrival_s.tolist() == [0.0, 0.5, 1.0, 2.0]
    assert tr.time_scale(3).duration_s == 12.0
    assert tr.compress(2).prompt_tokens.tolist() == [10, 20, 30, 40]
    with pytest.raises(ValueError):
        tr.compress(0)


def test_rate_scale_thins_and_replicates_deterministically() -> None:
    base = T.poisson(10.0, 1000.0, seed=0)
    half = base.rate_scale(0.5, seed=7)
    assert len(half) == pytest.approx(len(base) / 2, rel=0.05)
    assert np.array_equal(half.arrival_s, base.rate_scale(0.5, seed=7).arrival_s)
    assert set(half.arrival_s.tolist()) <= set(base.arrival_s.tolist())  # thinning keeps real arrivals
    triple = base.rate_scale(2.5, seed=7)
    assert len(triple) == pytest.approx(2.5 * len(base), rel=0.02)
    assert triple.duration_s <= base.duration_s
    assert np.all(np.diff(triple.arrival_s) >= 0)
    # each original request appears at least twice; token totals scale with it
    assert triple.output_tokens.sum() == pytest.approx(2.5 * base.output_tokens.sum(), rel=0.05)
    assert len(base.rate_scale(0.0)) == 0
    assert np.array_equal(base.rate_scale(1.0).arrival_s, base.arrival_s)


def test_repeat_window_head_and_clip() -> None:
    tr = small()
    rep = tr.repeat(3, gap_s=1.0)
    assert len(rep) == 12
    assert rep.arrival_s.tolist()[:6] == [0.0, 1.0, 2.0, 4.0, 5.0, 6.0]
    assert rep.duration_s == 14.0
    w = tr.window(1.0, 4.0)
    assert w.arrival_s.tolist() == [0.0, 1.0] and w.prompt_tokens.tolist() == [20, 30]
    assert tr.window(1.0, 4.0, rebase=False).arrival_s.tolist() == [1.0, 2.0]
    assert len(tr.window(10, 20)) == 0
    assert tr.head(2).prompt_tokens.tolist() == [10, 20]
    c = tr.clip_tokens(max_prompt=25, max_output=3)
    assert c.prompt_tokens.tolist() == [10, 20, 25, 25] and c.output_tokens.tolist() == [1, 2, 3, 3]
    t = T.Trace.from_arrays([0, 1], [5000, 10], [100, 5000]).clip_tokens(max_total=1024)
    assert (t.prompt_tokens + t.output_tokens).max() <= 1024
    assert t.prompt_tokens.tolist() == [924, 1] and t.output_tokens.tolist() == [100, 1023]
    both = tr.concat(tr, offset_s=10.0)
    assert len(both) == 8 and both.duration_s == 14.0


def test_operations_do_not_mutate_and_arrays_are_read_only() -> None:
    tr = small()
    before = tr.arrival_s.copy()
    tr.compress(4).rate_scale(3, seed=1).repeat(2).clip_tokens(max_prompt=1)
    assert np.array_equal(tr.arrival_s, before)
    with pytest.raises(ValueError):
        tr.arrival_s[0] = 5.0
    with pytest.raises(ValueError, match="sorted"):
        T.Trace(np.array([1.0, 0.0]), np.array([1, 1]), np.array([1, 1]))
