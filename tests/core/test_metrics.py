import json

from asyncrl.metrics import MetricsLogger, read_metrics


def test_metrics_jsonl_keeps_numbers_and_drops_non_finite(tmp_path, capsys):
    m = MetricsLogger(tmp_path, wandb_mode="off", progress=False, total_steps=3)
    m.log(1, {"train/reward_mean": 0.25, "bad": float("nan"), "flag": True, "note": "x", "lst": [1]})
    m.log(2, {"train/reward_mean": 0.5})
    m.close()
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[0]["train/reward_mean"] == 0.25 and recs[0]["flag"] == 1 and recs[0]["note"] == "x"
    assert "bad" not in recs[0] and "lst" not in recs[0]
    out = capsys.readouterr().out
    assert "step 1/3" in out and "reward 0.250" in out
    json.dumps(recs)
