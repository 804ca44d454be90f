"""The demo's timeline: rows from decision records, client-side SLO windows, the table and the PNG."""

from __future__ import annotations

from pathlib import Path

from rayscale.autoscale_demo import Row, client_windows, plot, row_of, timeline_table
from rayscale.controller.loop import DecisionRecord
from rayscale.core.catalog import SLO
from rayscale.loadgen import RequestResult


def _res(i: int, sent: float, ttft: float) -> RequestResult:
    return RequestResult(i, sent, sent, 100, 32, 32, ttft, 0.05, ttft + 1.6, 200, None)


def test_rows_table_client_windows_and_png(tmp_path: Path) -> None:
    rec = DecisionRecord(t=105.0, signals={"mistral-7b": {"freshness": "fresh", "arrival_rate_rps": 2.5,
                                                          "waiting": 3.0, "ttft_p95_s": 0.4,
                                                          "tpot_p95_s": 0.06}},
                         plan={"usd_per_h": 3.018}, actions=[], errors=[], durations_ms={},
                         gangs={"a": "ready", "b": "pending"},
                         serve={"mistral-7b--a10g": 2, "tiny-qwen2--cpu": 1})
    row = row_of(rec, 100.0)
    assert row == Row(5.0, 2.5, 3.0, 0.4, 2, 1, 1, 3.018, tpot_p95_s=0.06)  # only the demo model's replicas count
    table = timeline_table([row, Row(20.0, None, None, None, 3, 3, 0, 3.0)])
    assert "replicas (a10g)" in table and " - " in table
    client = client_windows([_res(i, i * 1.0, 0.1 if i < 10 else 5.0) for i in range(20)], replay_start_s=30.0,
                            ttft_target_s=2.0, tpot_target_s=0.1)
    assert [round(t) for t, _ in client] == [35, 45]
    first, second = client[0][1], client[1][1]
    assert first.share == 1.0 and first.ttft_p95_s is not None and first.ttft_p95_s < 0.2
    assert second.share == 0.0 and second.ttft_p95_s == 5.0 and second.tpot_p95_s == 0.05
    png = tmp_path / "p.png"
    plot([row, Row(20.0, 1.0, 0.0, 0.1, 3, 3, 0, 3.0)], SLO(ttft_p95_s=2.0, tpot_p95_s=0.1), png, client)
    assert png.stat().st_size > 10_000
