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


def test_eta_and_durations_hand_values():
    from asyncrl.metrics import eta_seconds, format_duration

    assert [format_duration(x) for x in (0, 59.4, 60, 245, 3599, 3600, 3725, -3)] == \
        ["0s", "59s", "1m00s", "4m05s", "59m59s", "1h00m", "1h02m", "0s"]
    # step 1 took 200 s (start-up included): alone it sets the pace; 10 steps in all
    assert eta_seconds(1, 10, (1, 1000.0, 200.0), 1000.0) == 9 * 200.0
    # steps 2..5 took 4 x 30 s after step 1: the start-up no longer counts
    assert eta_seconds(5, 10, (1, 1000.0, 200.0), 1120.0) == 5 * 30.0
    # a resumed run's first logged step is 7: the pace is measured from there
    assert eta_seconds(7, 10, (7, 50.0, 90.0), 50.0) == 3 * 90.0
    assert eta_seconds(9, 10, (7, 50.0, 90.0), 110.0) == 1 * 30.0
    assert eta_seconds(10, 10, (7, 50.0, 90.0), 200.0) is None  # nothing left


def test_status_lines_and_the_eta_on_a_log_file(tmp_path, capsys, monkeypatch):
    import asyncrl.metrics as metrics_mod

    clock = [1000.0]
    monkeypatch.setattr(metrics_mod.time, "time", lambda: clock[0])
    m = MetricsLogger(tmp_path, wandb_mode="off", progress=False, total_steps=4)
    m.status("starting the replay buffer")
    m.status("starting the replay buffer")  # the same text again at once: not repeated
    clock[0] += 31
    m.status("starting the replay buffer")  # ... but as a heartbeat after every_s
    m.status("step 1/4: waiting for a batch: 1/2 groups complete, 3 episodes stored")
    clock[0] += 69  # step 1 ends 100 s after the start
    m.log(1, {"train/reward_mean": 0.5, "version": 1})
    clock[0] += 20
    m.log(2, {"train/reward_mean": 0.5, "version": 2})
    m.log(2, {"eval/reward_mean": 0.1})  # an eval record has no ETA
    m.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "starting the replay buffer | 0s" and lines[1] == "starting the replay buffer | 31s"
    assert lines[2].startswith("step 1/4: waiting for a batch: 1/2 groups complete")
    assert lines[3].startswith("step 1/4 | v1 | reward 0.500") and lines[3].endswith("| 1m40s | eta 5m00s")
    assert lines[4].endswith("| 2m00s | eta 40s")  # (120 - 100) s per step since step 1, 2 steps left
    assert "eta" not in lines[5]


def test_the_eta_is_the_time_budget_where_it_ends_the_run_first():
    from asyncrl.metrics import shown_eta

    assert shown_eta(300.0, None) == " | eta 5m00s"
    assert shown_eta(300.0, 400.0) == " | eta 5m00s"  # the steps end first
    assert shown_eta(300.0, 125.0) == " | eta 2m05s (time budget)"
    assert shown_eta(300.0, -5.0) == " | eta 0s (time budget)"  # spent: never a negative time
    assert shown_eta(None, 125.0) == ""  # no step left


def test_a_budgeted_run_shows_the_budget_as_its_eta(tmp_path, capsys, monkeypatch):
    import asyncrl.metrics as metrics_mod

    clock = [1000.0]
    monkeypatch.setattr(metrics_mod.time, "time", lambda: clock[0])
    m = MetricsLogger(tmp_path, wandb_mode="off", progress=False, total_steps=25, budget_ends_at=1000.0 + 27 * 60)
    clock[0] += 600  # the warm start and step 1: 10 min of the 27
    m.log(1, {"train/reward_mean": 0.5, "version": 1})
    clock[0] += 85
    m.log(2, {"train/reward_mean": 0.5, "version": 2})
    m.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| 10m00s | eta 17m00s (time budget)")  # 24 steps x 600 s would be 4 h
    assert lines[1].endswith("| 11m25s | eta 15m35s (time budget)")  # 23 x 85 s = 32m35s > what is left


def test_waiting_line_counts_groups_and_episodes():
    from asyncrl.data.job_state import RolloutPosition, RolloutState
    from asyncrl.run.controller import waiting_line

    states = [RolloutState(worker_id=i, position=RolloutPosition(), episodes=5, episodes_failed=i) for i in range(2)]
    assert waiting_line(3, 20, 4, {"groups_complete": 9}, states) == \
        "step 3/20: waiting for a batch: 4/4 groups complete, 10 episodes stored, 1 failed"
    assert waiting_line(1, 2, 4, {}, states[:1]) == "step 1/2: waiting for a batch: 0/4 groups complete, 5 episodes stored"
